"""Synthetic inputs for timing the RL loop on a random model: token-id prompts, a tokenizer, a reward.

Why: speed depends on shapes (batch, prompt and completion lengths, vocabulary), not on what
the tokens mean, and the bench must run offline with no tokenizer files. So a prompt is a list
of random token ids, written as decimal text so it passes through the trainer's real path
(records -> chat template -> token ids -> engine -> completion text -> reward):

* :class:`IdTokenizer` -- "text" is space-separated token ids; its "chat template" is the last
  message's ids (no role tokens), and it has no EOS, so every completion runs to its length limit;
* :func:`parity_reward` -- the fraction of even token ids in a completion: cheap, and it varies
  across samples of a group, so GRPO advantages are not all zero and the update does real work;
* :func:`random_batch` -- a ready :class:`~jetrl.rl.batch.RolloutBatch` (prompt + full-length
  completion, random rollout logprobs and advantages) for timing the training phase alone.
"""

from __future__ import annotations

from typing import Any

import torch

from jetrl.rl.batch import RolloutBatch


class IdTokenizer:
    """Text = space-separated token ids (module docstring)."""

    chat_template = "{{ messages[-1]['content'] }}"  # what apply_chat_template implements
    eos_token_id = None
    stop_token_ids: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(t)) for t in ids)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            tokenize: bool = True, return_dict: bool = False) -> list[int] | str:
        text = messages[-1]["content"]
        return self.encode(text) if tokenize else text


def random_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num, length), generator=gen).tolist()


def random_records(num: int, length: int, vocab: int, seed: int = 0) -> list[dict[str, Any]]:
    """Dataset records whose prompts are ``length`` random token ids (as IdTokenizer text)."""
    return [{"prompt": [{"role": "user", "content": " ".join(map(str, ids))}], "ground_truth": ""}
            for ids in random_prompts(num, length, vocab, seed)]


def parity_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """Fraction of even token ids in each completion (TRL reward signature)."""
    out = []
    for text in completions:
        ids = text.split()
        out.append(sum(int(t) % 2 == 0 for t in ids) / max(len(ids), 1))
    return out


def batch_of_lengths(lengths: list[int], prompt_len: int, vocab: int, gen: torch.Generator,
                     seed: int = 0) -> RolloutBatch:
    """A rollout batch of random tokens whose completions have these ``lengths`` (drawn from ``gen``, after whatever
    chose the lengths), prompts of ``prompt_len`` tokens, logprobs in [-5, 0) and N(0, 1) advantages."""
    completions = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    logprobs = [(-5 * torch.rand(n, generator=gen)).tolist() for n in lengths]
    return RolloutBatch.build(random_prompts(len(lengths), prompt_len, vocab, seed), completions, logprobs,
                              torch.randn(len(lengths), generator=gen), [True] * len(lengths))


def random_batch(num: int, prompt_len: int, completion_len: int, vocab: int, seed: int = 0) -> RolloutBatch:
    """A full-length rollout batch of random tokens, logprobs in [-5, 0) and N(0, 1) advantages."""
    gen = torch.Generator().manual_seed(seed)
    prompts = random_prompts(num, prompt_len, vocab, seed)
    completions = torch.randint(0, vocab, (num, completion_len), generator=gen).tolist()
    logprobs = (-5 * torch.rand(num, completion_len, generator=gen)).tolist()
    return RolloutBatch.build(prompts, completions, logprobs, torch.randn(num, generator=gen), [True] * num)
