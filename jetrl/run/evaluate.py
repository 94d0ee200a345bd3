"""Held-out evaluation: pass@1 and pass@k with the rollout engine.

For each problem, n samples are drawn (n = 1 and greedy by default) and c of them are
correct: full credit (a reward of 1) from the task's answer reward (``correctness_func``: the
math reward against the gold answer, or the reasoning-gym task's own scorer). With the
unbiased estimator of Chen et al. (2021),

    pass@k = mean over problems of  1 - C(n - c, k) / C(n, k)        (k <= n)

pass@1 is the mean of c / n. Evaluation runs in the rollout phase, i.e. in the precision the
recipe samples with, on the same modules as training.
"""

from __future__ import annotations

from collections.abc import Callable
from math import comb
from typing import Any

from jetrl.data.records import column_names, reward_columns
from jetrl.engine import Engine, SamplingParams
from jetrl.rewards import correctness_func, is_correct, math_reward
from jetrl.rewards.registry import call_reward


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def evaluate(engine: Engine, prompt_ids: list[list[int]], records: list[dict[str, Any]], *, max_tokens: int,
             num_samples: int = 1, temperature: float = 0.0, seed: int = 0,
             correct_func: Callable = math_reward, seeds: list[int] | None = None) -> dict[str, float]:
    """{"pass@1", "pass@<n>" (n > 1), "num_problems", "mean_length"} on ``records``. ``seeds``: one per problem
    (default: the engine's, from ``seed`` and the problem's index here)."""
    if not records:
        raise ValueError("evaluate: no held-out records (set task.num_eval > 0 or task.eval_path)")
    params = SamplingParams(n=num_samples, temperature=temperature, max_tokens=max_tokens, seed=seed)
    names = column_names(records)  # every problem's reward call passes the same columns
    groups = engine.generate(prompt_ids, params, seeds=seeds)
    pass1 = passk = length = 0.0
    for record, group in zip(records, groups):
        texts = [c.text or "" for c in group]
        columns = reward_columns([record], len(texts), names, completion_ids=[c.token_ids for c in group])
        correct = call_reward(correct_func, texts, columns)
        c = sum(1 for r in correct if is_correct(r))
        pass1 += c / num_samples
        passk += pass_at_k(num_samples, c, num_samples)
        length += sum(len(x.token_ids) for x in group) / num_samples
    n = len(records)
    out = {"pass@1": pass1 / n, "num_problems": n, "mean_length": length / n}
    if num_samples > 1:
        out[f"pass@{num_samples}"] = passk / n
    return out


def evaluate_config(cfg: Any, model_name: str, *, num_samples: int | None = None,
                    temperature: float | None = None) -> dict[str, float]:
    """``jetrl eval``: the held-out split of ``cfg.task``, for the model ``model_name``, in ``cfg.recipe``."""
    from jetrl.data import encode_prompts
    from jetrl.run.models import load_model
    from jetrl.run.tasks import load_task

    n = num_samples or cfg.eval.num_samples
    temp = cfg.eval.temperature if temperature is None else temperature
    if n > 1 and temp == 0:
        raise ValueError("--num-samples > 1 needs --temperature > 0 (greedy samples are all the same)")
    model, tokenizer, path = load_model(model_name, cfg.model.dtype, recipe=cfg.recipe)
    _, records = load_task(cfg.task)
    prompt_ids = encode_prompts(records, tokenizer, system_prompt=cfg.task.system_prompt,
                                max_prompt_length=cfg.grpo.max_prompt_length,
                                template_kwargs=cfg.grpo.chat_template_kwargs)
    engine = Engine(model, tokenizer, max_slots=max(n, 64), max_len=cfg.grpo.max_prompt_length + cfg.grpo.max_completion_length)
    result = evaluate(engine, prompt_ids, records, max_tokens=cfg.grpo.max_completion_length, num_samples=n,
                      temperature=temp, seed=cfg.grpo.seed, correct_func=correctness_func(cfg.task.reward_funcs))
    return {"model": str(path), "recipe": cfg.recipe, **result}
