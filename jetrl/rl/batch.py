"""A rollout batch as padded tensors, and the trainer's per-token logprobs over it.

Layout. Sequence i is prompt p_i (P_i tokens) followed by completion c_i (C_i tokens). The
forward input is right-padded ``input_ids`` (B, L) with L = max(P_i + C_i); per-token
tensors live on completion positions (B, T) with T = max C_i:

    completion_mask[i, j] = 1  for j < C_i (and the token is trained on), else 0
    logprob[i, j]         = log softmax(logits[i, P_i - 1 + j])[c_i[j]]

so prompt and padding tokens never enter the loss. Right padding with plain causal
attention leaves every real token's logits as in an unpadded forward (padding only follows).
Only the completion positions go through the lm_head: for a 49k vocabulary the (B, L, V)
logits would dominate memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from jetrl.rl.token_logprobs import token_logprobs


@dataclass
class RolloutBatch:
    """Padded per-sequence tensors of one rollout batch (row i = one completion)."""

    input_ids: Tensor  # (B, L) prompt + completion, right-padded with 0
    prompt_lengths: Tensor  # (B,) P_i
    completion_lengths: Tensor  # (B,) C_i
    completion_ids: Tensor  # (B, T) right-padded with 0
    completion_mask: Tensor  # (B, T) 1 on completion tokens that count in the loss
    rollout_logprobs: Tensor  # (B, T) the engine's logprobs of the sampled tokens
    advantages: Tensor  # (B,)
    old_logprobs: Tensor | None = None  # (B, T) pi_old (trainer pass or rollout, see GRPOConfig.old_logprobs)
    ref_logprobs: Tensor | None = None  # (B, T) reference policy, if beta > 0

    @classmethod
    def build(cls, prompts: list[list[int]], completions: list[list[int]], rollout_logprobs: list[list[float]],
              advantages: Tensor, loss_mask: list[bool]) -> RolloutBatch:
        if not (len(prompts) == len(completions) == len(rollout_logprobs) == len(advantages) == len(loss_mask)):
            raise ValueError("RolloutBatch.build: prompts, completions, logprobs, advantages and masks differ in length")
        rows = len(prompts)
        seq_len = max(len(p) + len(c) for p, c in zip(prompts, completions))
        comp_len = max(1, max(len(c) for c in completions))
        input_ids = torch.zeros(rows, seq_len, dtype=torch.int64)
        completion_ids = torch.zeros(rows, comp_len, dtype=torch.int64)
        mask = torch.zeros(rows, comp_len)
        lps = torch.zeros(rows, comp_len)
        for i, (p, c, lp) in enumerate(zip(prompts, completions, rollout_logprobs)):
            input_ids[i, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.int64)
            completion_ids[i, : len(c)] = torch.tensor(c, dtype=torch.int64)
            lps[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
            if loss_mask[i]:
                mask[i, : len(c)] = 1.0
        return cls(input_ids, torch.tensor([len(p) for p in prompts]), torch.tensor([len(c) for c in completions]),
                   completion_ids, mask, lps, advantages.float())

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def token_mask(self) -> Tensor:
        """(B, T) 1.0 on every completion token, whether or not it counts in the loss (``completion_mask`` drops
        truncated completions under ``mask_truncated_completions``): what the rollout sampled, where the
        trainer-vs-rollout mismatch is measured."""
        positions = torch.arange(self.completion_ids.shape[1])
        return (positions[None, :] < self.completion_lengths.cpu()[:, None]).float()

    def select(self, index: Tensor | slice) -> RolloutBatch:
        """Rows ``index`` (a micro-batch), trimmed to their own longest sequence."""
        parts = {f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[index]) for f in fields(self)}
        sub = RolloutBatch(**parts)
        sub.input_ids = sub.input_ids[:, : int((sub.prompt_lengths + sub.completion_lengths).max())]
        comp_len = max(1, int(sub.completion_lengths.max()))
        for name in ("completion_ids", "completion_mask", "rollout_logprobs", "old_logprobs", "ref_logprobs"):
            if getattr(sub, name) is not None:
                setattr(sub, name, getattr(sub, name)[:, :comp_len])
        return sub


def completion_logprobs(model: nn.Module, batch: RolloutBatch, temperature: float = 1.0,
                        with_entropy: bool = False,
                        hidden_states: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
    """(B, T) fp32 logprobs of the completion tokens under ``model`` (the current precision phase),
    and optionally the (B, T) entropy of the full next-token distribution (no grad). ``hidden_states``
    replaces ``model.hidden_states`` (the trainer's CUDA graphs, train_graphs.py)."""
    device = model.model.embed_tokens.weight.device
    hidden = (hidden_states or model.hidden_states)(batch.input_ids.to(device))  # (B, L, H)
    comp_len = batch.completion_ids.shape[1]
    offsets = torch.arange(comp_len, device=device)
    positions = (batch.prompt_lengths.to(device)[:, None] - 1 + offsets).clamp(max=hidden.shape[1] - 1)  # (B, T)
    h = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))  # (B, T, H)
    logits = model.logits_from_hidden(h)  # (B, T, V) in the model dtype
    return token_logprobs(logits, batch.completion_ids.to(device), temperature, with_entropy)
