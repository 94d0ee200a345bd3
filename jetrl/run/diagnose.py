"""``jetrl diagnose``: sample completions with the rollout engine, then compare the rollout's forward with the
trainer's layer by layer on those tokens (:mod:`jetrl.rl.diagnose` has the method and the metrics).

Prints the per-layer table, then one JSON line: the recipe, the model, ``first_divergence``, the mismatch metrics
and every layer's gaps. Prompts are given as for ``jetrl generate`` (chat template unless ``--raw``).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from jetrl.engine import Engine, SamplingParams
from jetrl.exact import exact_requested
from jetrl.rl.diagnose import diagnose, format_report
from jetrl.run.generate import encode_prompts
from jetrl.run.models import load_model


def diagnose_main(model: str, prompts: list[Any], *, recipe: str = "jet", dtype: str = "float32", n: int = 1,
                  temperature: float = 1.0, max_tokens: int = 32, seed: int = 0, raw: bool = False,
                  device: str | None = None, template_kwargs: dict[str, Any] | None = None) -> dict:
    if not temperature > 0:
        raise ValueError(f"--temperature {temperature}: the comparison scores the tokens at this temperature, which "
                         "must be > 0 (1.0 is the policy itself)")
    if n < 1 or max_tokens < 1:
        raise ValueError(f"--n {n} and --max-tokens {max_tokens} must be >= 1")
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"--device {device!r}: use 'cpu' or 'cuda' (or leave it out: cuda when available)")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this torch sees no CUDA GPU; use --device cpu")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    net, tokenizer, path = load_model(model, dtype, recipe=recipe, device=device)
    prompt_ids = encode_prompts(tokenizer, prompts, raw, template_kwargs)
    engine = Engine(net, tokenizer, max_slots=n * len(prompt_ids),
                    max_len=max(len(p) for p in prompt_ids) + max_tokens + 1)
    groups = engine.generate(prompt_ids, SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, seed=seed))
    pairs = [(p, c.token_ids) for p, group in zip(prompt_ids, groups) for c in group]
    report = diagnose(engine, [p for p, _ in pairs], [c for _, c in pairs], temperature)
    print(format_report(report))
    result = {"recipe": recipe, "exact": exact_requested(), "model": str(path), "device": str(device),
              "temperature": temperature, **report}
    print(json.dumps(result))
    return result
