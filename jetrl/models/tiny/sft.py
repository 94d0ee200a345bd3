"""Supervised training of the tiny start: its config, data, loss, loop and thread tuning.

Why the loss is not plain cross-entropy: at the one token where the correct and the mistaken
answer differ, the target is the demonstration distribution itself, which calibrates the
learned split at less gradient noise (see the ``jetrl.models.tiny`` package docstring).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from jetrl.data.records import Record
from jetrl.models.config import ModelConfig
from jetrl.models.llama import CausalLM
from jetrl.models.tiny.model import tiny_model_config
from jetrl.models.tiny.task import _operands, answer_text, tiny_task_split
from jetrl.models.tiny.tokenizer import build_tiny_tokenizer


@dataclass(frozen=True)
class TinySFTConfig:
    """How the tiny start is trained. The defaults were chosen by measurement (package docstring)."""

    p_correct: float = 0.3  # probability that a demonstration is the correct sum
    mistake_offset: int = 10  # otherwise it is sum + mistake_offset (10: a carry slip)
    steps: int = 600
    batch_size: int = 256  # problems per step
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    num_hidden_layers: int = 2
    intermediate_size: int = 384
    num_threads: int | None = None  # torch threads for the build (restored after); None: auto (_ThreadTuner)
    eval_problems: int = 200  # held-out problems measured after the build (stored in tiny_start.json)
    eval_samples: int = 8  # temperature-1 samples per problem for the sampled accuracy

    def __post_init__(self) -> None:
        if not 0.0 <= self.p_correct <= 1.0:
            raise ValueError(f"p_correct={self.p_correct} must be in [0, 1]")
        if self.mistake_offset == 0:
            raise ValueError("mistake_offset=0 would make the mistake the correct answer; use e.g. 10")
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps={self.steps} and batch_size={self.batch_size} must be >= 1")


class _SFTData:
    """Every (train problem, answer) example pre-tokenized; ``batch`` draws a batch of them.

    An example is prompt ids + answer ids + EOS, with loss on the answer tokens (and EOS) only.
    Both variants of each problem (following the correct or the mistaken answer) are built once,
    as rows of equal length ``T`` (right padding, never attended to by a real token).
    """

    def __init__(self, tok: Any, records: Sequence[Record], cfg: TinySFTConfig) -> None:
        self.p = cfg.p_correct
        eos, pad = tok.eos_token_id, tok.pad_token_id
        problems = []
        for r in records:
            a, b = _operands(r)
            problems.append((a, b))
            if a != b:
                problems.append((b, a))  # the swap is a train problem too (package docstring)
        # The template is plain concatenation: render it once around a sentinel (9k renders take seconds).
        head, sentinel, tail = tok.apply_chat_template([{"role": "user", "content": "\x00"}], tokenize=False,
                                                       add_generation_prompt=True).partition("\x00")
        assert sentinel, "the chat template dropped the user message"
        rows: list[tuple[list[int], list[int], list[int], list[float]]] = []
        for a, b in problems:
            prompt = tok.encode(f"{head}What is {a} + {b}?{tail}", add_special_tokens=False)
            right = tok.encode(answer_text(a + b), add_special_tokens=False) + [eos]
            wrong = tok.encode(answer_text(a + b + cfg.mistake_offset), add_special_tokens=False) + [eos]
            d = next(i for i, (x, y) in enumerate(zip(right, wrong)) if x != y)  # first differing token
            pos = len(prompt) - 1 + d  # the input position that predicts it
            for follow, other, w_other in ((wrong, right, cfg.p_correct), (right, wrong, 1.0 - cfg.p_correct)):
                tgt = [-100] * (len(prompt) - 1) + follow
                alt = list(tgt)
                alt[pos] = other[d]
                w = [0.0] * len(tgt)
                w[pos] = w_other  # (1 - w) on the followed answer's token, w on the other's
                rows.append((prompt + follow[:-1], tgt, alt, w))
        T = max(len(r[0]) for r in rows)
        n = len(rows)
        self.ids = torch.full((n, T), pad, dtype=torch.int64)
        self.tgt = torch.full((n, T), -100, dtype=torch.int64)
        self.alt = torch.full((n, T), -100, dtype=torch.int64)
        self.w = torch.zeros(n, T)
        for i, (x, t, al, w) in enumerate(rows):
            k = len(x)
            self.ids[i, :k], self.tgt[i, :k] = torch.tensor(x), torch.tensor(t)
            self.alt[i, :k], self.w[i, :k] = torch.tensor(al), torch.tensor(w)
        self.num_problems = len(problems)

    def batch(self, rng: random.Random, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``size`` examples: problems uniformly, the correct answer followed with probability p.

        Returns input ids, targets, alternative targets and the alternative's weight, each (B, T).
        """
        idx = []
        for _ in range(size):
            i = rng.randrange(self.num_problems)
            idx.append(2 * i + (rng.random() < self.p))
        sel = torch.tensor(idx)
        return self.ids[sel], self.tgt[sel], self.alt[sel], self.w[sel]


def _sft_loss(model: CausalLM, ids: torch.Tensor, tgt: torch.Tensor, alt: torch.Tensor,
              w: torch.Tensor) -> torch.Tensor:
    """Mean over answer tokens of ``(1 - w) * CE(target) + w * CE(alt)`` (logits only where needed)."""
    mask = tgt != -100
    logp = F.log_softmax(model.logits_from_hidden(model.hidden_states(ids)[mask]).float(), dim=-1)
    w = w[mask]
    nll_t = -logp.gather(-1, tgt[mask][:, None])[:, 0]
    nll_a = -logp.gather(-1, alt[mask][:, None])[:, 0]
    return ((1.0 - w) * nll_t + w * nll_a).mean()


class _ThreadTuner:
    """Runs the SFT steps with whichever is faster now: the process's torch thread count or 1 thread.

    Why: on a 2-core box that other processes also load, two OpenMP threads spin at every
    barrier while one of them waits for a core; we measured 3.0 s per step with 2 threads
    against 0.39 s with 1 (and 0.23 s vs 0.37 s on idle cores). Every ``every`` steps (and
    when a step takes over 3x the last best), one real training step is timed under each
    candidate and the faster one is kept. The thread count did not change a single bit of
    the trained weights on the CPU builds we checked (GEMMs split rows, not the reduction),
    so tuning does not cost reproducibility there; ``TinySFTConfig.num_threads`` pins it.
    """

    def __init__(self, fixed: int | None, every: int = 100) -> None:
        n = torch.get_num_threads()
        self.candidates = [fixed] if fixed is not None else ([n, 1] if n > 1 else [n])
        self.every, self.current = every, self.candidates[0]
        self.queue: list[int] = []
        self.times: dict[int, float] = {}
        self.best: float | None = None
        self.slow = False
        self.steps_at: dict[int, int] = {}

    def before(self, step: int) -> None:
        if len(self.candidates) > 1 and not self.queue and step > 0 and (step % self.every == 1 or self.slow):
            self.queue, self.times, self.slow = list(self.candidates), {}, False
        threads = self.queue[0] if self.queue else self.current
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self.steps_at[threads] = self.steps_at.get(threads, 0) + 1

    def after(self, seconds: float) -> None:
        if self.queue:
            self.times[self.queue.pop(0)] = seconds
            if not self.queue:
                self.current = min(self.times, key=self.times.__getitem__)
                self.best = self.times[self.current]
        elif self.best is not None and seconds > 3 * self.best:
            self.slow = True


def _sft(cfg: TinySFTConfig, seed: int, log_every: int, device: str | torch.device,
         t0: float) -> tuple[CausalLM, Any, ModelConfig, list[Record], list[Record], float, dict[int, int]]:
    """The SFT loop: AdamW, linear warmup then cosine decay to 5% of ``lr``, grad clip 1, fp32."""
    tok = build_tiny_tokenizer()
    mcfg = tiny_model_config(len(tok), num_hidden_layers=cfg.num_hidden_layers,
                             intermediate_size=cfg.intermediate_size)
    train, held_out = tiny_task_split()
    torch.manual_seed(seed)
    model = CausalLM(mcfg).float().to(device)
    data = _SFTData(tok, train, cfg)
    rng = random.Random(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))

    model.train()
    tuner = _ThreadTuner(cfg.num_threads if str(device) == "cpu" else torch.get_num_threads())
    for step in range(cfg.steps):
        tuner.before(step)
        t_step = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        ids, tgt, alt, w = (t.to(device) for t in data.batch(rng, cfg.batch_size))
        loss = _sft_loss(model, ids, tgt, alt, w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tuner.after(time.perf_counter() - t_step)
        if log_every and (step % log_every == 0 or step == cfg.steps - 1):
            print(f"  sft step {step:5d} loss {loss.item():.4f} ({time.perf_counter() - t0:.0f}s, "
                  f"steps per thread count {tuner.steps_at})", flush=True)
    return model, tok, mcfg, train, held_out, time.perf_counter() - t0, tuner.steps_at
