"""Sampling from and scoring a small model on the tiny adder's held-out problems.

The build measures the start with :func:`evaluate_tiny` (the accuracies in ``tiny_start.json``),
and tests use it too. Why plain repeated full forwards (no KV cache, no rollout engine): for a
~0.4M-parameter model and answers of a few tokens they are simple and fast enough.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from jetrl.data.records import Record
from jetrl.models.llama import CausalLM


def generate_tiny(model: CausalLM, tok: Any, prompts: Sequence[str | Sequence[dict[str, str]]], *,
                  temperature: float = 0.0, samples: int = 1, seed: int = 0,
                  max_new_tokens: int = 16) -> list[list[str]]:
    """``samples`` completions per prompt (a user message or a list of chat messages): the text before EOS.

    Plain repeated full forwards (no KV cache): prompts of equal token length run as one batch,
    so no padding is needed; a row keeps decoding after its EOS and its tail is cut. Greedy at
    ``temperature=0``; otherwise deterministic given ``seed``. For evaluating small models.
    ``tok`` is a :class:`jetrl.models.Tokenizer` or a transformers tokenizer.
    """
    return _generate(model, tok, prompts, temperature, samples, seed, max_new_tokens)[0]


@torch.no_grad()
def _generate(model: CausalLM, tok: Any, prompts: Sequence[str | Sequence[dict[str, str]]], temperature: float,
              samples: int, seed: int, max_new_tokens: int) -> tuple[list[list[str]], list[list[bool]]]:
    hf = getattr(tok, "hf", tok)  # a jetrl Tokenizer wraps the transformers one
    eos = hf.eos_token_id
    gen = torch.Generator().manual_seed(seed)
    encoded = []
    for p in prompts:
        messages = [{"role": "user", "content": p}] if isinstance(p, str) else [dict(m) for m in p]
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        encoded.append(hf.encode(text, add_special_tokens=False))
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_len.setdefault(len(ids), []).append(i)
    texts: list[list[str]] = [[] for _ in prompts]
    finished: list[list[bool]] = [[] for _ in prompts]
    device = next(model.parameters()).device
    for _, idx in sorted(by_len.items()):
        x = torch.tensor([encoded[i] for i in idx for _ in range(samples)], dtype=torch.int64, device=device)
        start = x.shape[1]
        for _ in range(max_new_tokens):
            logits = model(x)[:, -1].float()
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / temperature, -1).cpu()
                nxt = torch.multinomial(probs, 1, generator=gen)[:, 0].to(device)
            x = torch.cat([x, nxt[:, None]], dim=1)
            if bool((x[:, start:] == eos).any(-1).all()):
                break
        for r, row in enumerate(x[:, start:].tolist()):
            done = eos in row
            texts[idx[r // samples]].append(hf.decode(row[: row.index(eos)] if done else row,
                                                      skip_special_tokens=False))
            finished[idx[r // samples]].append(done)
    return texts, finished


def evaluate_tiny(model: CausalLM, tok: Any, records: Sequence[Record], *, temperature: float = 0.0,
                  samples: int = 1, seed: int = 0, mistake_offset: int = 10,
                  max_new_tokens: int = 16) -> dict[str, float]:
    r"""Held-out metrics of ``model`` on addition ``records``.

    accuracy:    fraction of completions that ``jetrl.rewards.math_reward`` scores 1;
    mistake:     fraction of well-formed completions answering exactly ``sum + mistake_offset``;
    well_formed: fraction that are exactly ``\boxed{<integer>}`` followed by EOS;
    n:           number of completions (``len(records) * samples``).
    Greedy at ``temperature=0`` (then use ``samples=1``), else ``samples`` draws per problem.
    """
    import re

    from jetrl.rewards.math import math_reward

    was_training = model.training
    model.eval()
    try:
        completions, finished = _generate(model, tok, [r["prompt"] for r in records], temperature, samples, seed,
                                          max_new_tokens)
    finally:
        model.train(was_training)
    flat = [c for cs in completions for c in cs]
    golds = [r["ground_truth"] for r, cs in zip(records, completions) for _ in cs]
    rewards = math_reward(flat, ground_truth=golds)
    form = re.compile(r"\\boxed\{(-?\d+)\}")
    well, mistake = 0, 0
    for c, done, g in zip(flat, (f for fs in finished for f in fs), golds):
        m = form.fullmatch(c)
        if m and done:
            well += 1
            mistake += int(m.group(1)) == int(g) + mistake_offset
    n = max(1, len(flat))
    return {"accuracy": sum(rewards) / n, "mistake": mistake / n, "well_formed": well / n, "n": len(flat)}
