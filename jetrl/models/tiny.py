r"""The tiny adder: a from-scratch start policy for the embedded default ``jetrl train`` run.

Why: the default run must show RL working end to end offline, on a 2-core CPU, in minutes:
held-out accuracy must rise by >= 30 points, and the rise must come from RL, not from more
supervised training. No hub model is reachable and even SmolLM2-135M is too slow for that
budget, so the project trains its own start (~0.4M parameters) and caches it.

The task is ``jetrl.data.tasks.synthetic_split`` addition, operands 0..99, prompt
"What is 23 + 58?" through a character-level chat template. :func:`tiny_task_split` fixes
the split (its own seed, independent of the SFT seed); SFT sees the TRAIN part only, so the
held-out problems (and their swaps) are never seen before RL measures them.

The start is built to be *wrong in a way RL can fix*. The SFT demonstration is
``\boxed{S}<|end|>`` where S is the correct sum with probability ``p_correct`` and otherwise a
systematic mistake, the sum plus ``mistake_offset`` (10: a carry slip). Loss is on the answer
tokens only. The SFT model therefore

* knows the format (nearly every sample is a well-formed ``\boxed{number}``);
* can add: its samples split between S and S + 10, with little else;
* answers S + 10 under greedy decoding (p < 0.5), so greedy held-out accuracy starts near 0,
  while temperature-1 samples are right about ``p`` of the time.

GRPO with the math reward then only has to move probability mass from S + 10 to S on the
token where the two answers differ; it never needs to learn addition. That is a large,
reliable, measurable rise that RL causes (a GRPO group of 8 samples holds a right answer
with probability 1 - 0.7^8 ~ 94%, so nearly every group has a learning signal). Under greedy
eval the start scores ~0%; a problem flips once the correct token where the answers diverge
passes 50%. RL must draw its train and eval records from :func:`tiny_task_split` (or a subset).

Training: a 2-layer Llama (hidden 128, 4 heads of 32, 2 kv heads, SwiGLU 384, tied
embeddings, vocab 102 padded to 112: ~0.4M parameters), fp32, AdamW (lr 3e-3, betas 0.9/0.98,
wd 0.01), 30 warmup steps then cosine to 5%, grad clip 1, 600 steps of 256 problems. Each
example follows one of the two answers (drawn with probability p), but at the one position
where they differ the target is the demonstration distribution itself (``p`` on the correct
token, ``1 - p`` on the mistaken one: the expected cross-entropy under the demonstrations), so
the learned split is calibrated at less gradient noise. Problems are augmented with their swaps
(a + b -> b + a): ``synthetic_split`` puts both orientations of a problem on the same side.

Measured (defaults, seed 0; held-out = the first 200 problems of the held-out split):

* time: ``tiny_start_checkpoint()`` from a cold cache takes 2 min 19 s wall on 2 idle Xeon
  cores (133 s build: 128 s SFT at ~0.21 s/step, ~5 s eval) and 2 min 21 s on this project's
  2-core box when idle; 4.4-4.6 min when other processes load the 2 cores (load ~3), which
  is why the SFT times one step with 1 thread against 2 and keeps the faster (see
  ``_ThreadTuner``: under load 2 OpenMP threads took 3.0 s/step against 0.39 s for 1).
  A cached call returns in milliseconds.
* accuracy (three builds: this box idle / this box loaded / the Xeon; the CPU attention code
  changed in between, so the bits differ): greedy 0.0% / 1.0% / 3.0% (the other greedy
  answers are all S + 10); temperature 1, 8 samples per problem: right 28.4% / 31.5% / 31.9%,
  S + 10 70.1% / 65.8% / 65.8% (so 97-98% of samples are one of the two), well-formed
  99.9% in all. Loaded in bf16 or converted to FP8 (``jet``): greedy 0.0%, sampled 29%; the
  rollout engine agrees (greedy 0.0%, sampled 26.6%).
* across 8 seeds (GPU numerics): greedy 0-10.5%, sampled 25-32%, in {S, S + 10} 85-99%,
  well-formed >= 99.6%. With 500 steps some seeds had not finished learning to add (greedy
  12-15%, only 73-84% of samples in {S, S + 10}); lr >= 4e-3 got stuck on a plateau; a third
  layer did not help per step; p = 0.2 learns as cleanly but gives GRPO fewer right samples.
* determinism: the same seed gives bitwise the same weights on one machine and torch build,
  with 1 or 2 threads (checked over all 600 steps); other CPUs or torch versions differ.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import string
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from jetrl.data.records import Record
from jetrl.data.tasks import synthetic_split
from jetrl.models.config import ModelConfig
from jetrl.models.llama import CausalLM
from jetrl.models.loader import save_pretrained

# ---------------------------------------------------------------------------------------------- tokenizer
PAD_TOKEN, UNK_TOKEN, EOS_TOKEN = "<pad>", "<unk>", "<|end|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = (PAD_TOKEN, UNK_TOKEN, *ROLE_TOKENS.values(), EOS_TOKEN)
# Every printable ASCII character but the rarely used whitespace ones: digits, letters, punctuation,
# \boxed{}, space and newline. Anything else encodes to <unk>.
CHARACTERS = tuple(c for c in string.printable if c not in "\t\r\x0b\x0c")
# <|role|>content<|end|> per message; the generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('the tiny chat template knows the roles system, user and assistant, not ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VOCAB_MULTIPLE = 16  # the model's vocab is padded to this (FP8 tiles need 16-aligned dims)


def build_tiny_tokenizer() -> Any:
    """A character-level ``transformers.PreTrainedTokenizerFast`` built offline.

    One token per character (WordLevel over single characters, a pre-tokenizer that isolates
    every character, a ``Fuse`` decoder), so ``decode(encode(s)) == s`` for any printable ASCII
    text; special tokens ``<pad>``, ``<unk>``, ``<|system|>``, ``<|user|>``, ``<|assistant|>`` and
    ``<|end|>`` (EOS) and the chat template :data:`CHAT_TEMPLATE`.
    """
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS.values()),
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )


# ---------------------------------------------------------------------------------------------- model
def tiny_model_config(vocab_size: int = len(SPECIAL_TOKENS) + len(CHARACTERS), *, num_hidden_layers: int = 2,
                      intermediate_size: int = 384) -> ModelConfig:
    """A Llama-family config with FP8-friendly dims (every projection a multiple of 16).

    hidden 128, 4 query heads of 32, 2 kv heads (GQA), SwiGLU ``intermediate_size``, tied
    embeddings; ``vocab_size`` is padded up to a multiple of 16. Token ids follow
    :func:`build_tiny_tokenizer` (pad 0, EOS ``<|end|>``).
    """
    padded = -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    return ModelConfig(
        vocab_size=padded,
        hidden_size=128,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
    )


# ---------------------------------------------------------------------------------------------- task
SPLIT_SEED = 20250  # fixed: the held-out problems do not depend on the SFT seed
NUM_EVAL = 500  # held-out problems reserved (RL evaluates on a prefix of them); the rest is TRAIN


def tiny_task_split(num_eval: int = NUM_EVAL) -> tuple[list[Record], list[Record]]:
    """(train, held-out) addition records, operands 0..99: the split the tiny start was SFT'd on.

    All 5050 distinct problems (a problem and its swap count once) are used: ``5050 - num_eval``
    for training, ``num_eval`` held out. SFT used ``num_eval=NUM_EVAL``. A smaller ``num_eval`` gives
    a prefix of that held-out set (the split is one fixed permutation), so RL may evaluate on
    ``tiny_task_split(200)[1]``; a larger one would hold problems the start was trained on.
    """
    total = 100 * 101 // 2
    return synthetic_split(total - num_eval, num_eval, SPLIT_SEED, ops=("+",), min_operand=0, max_operand=99)


def _operands(record: Record) -> tuple[int, int]:
    text = record["prompt"][-1]["content"]  # "What is a + b?"
    a, _, b = text.removeprefix("What is ").removesuffix("?").partition(" + ")
    return int(a), int(b)


def answer_text(value: int) -> str:
    r"""The demonstration text of an answer: ``\boxed{value}`` (the EOS token follows it)."""
    return "\\boxed{" + str(value) + "}"


# ---------------------------------------------------------------------------------------------- SFT
@dataclass(frozen=True)
class TinySFTConfig:
    """How the tiny start is trained. The defaults were chosen by measurement (module docstring)."""

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
                problems.append((b, a))  # the swap is a train problem too (module docstring)
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


def train_tiny_start(out_dir: str | Path, *, seed: int = 0, sft: TinySFTConfig | None = None,
                     log_every: int = 0, device: str | torch.device = "cpu") -> dict[str, Any]:
    """SFT the tiny start from scratch and save it (weights fp32, tokenizer, ``tiny_start.json``) to ``out_dir``.

    Deterministic given ``seed`` on one machine (same torch build and thread count). Returns the
    metadata written to ``tiny_start.json`` (config, timings, held-out accuracies).
    """
    cfg = sft or TinySFTConfig()
    out_dir = Path(out_dir)
    t0 = time.perf_counter()
    prev_threads = torch.get_num_threads()
    # fork_rng: the build seeds torch's global RNG; the caller's RNG state is restored afterwards.
    with torch.random.fork_rng(devices=[]):
        try:
            model, tok, mcfg, train, held_out, train_s, thread_steps = _sft(cfg, seed, log_every, device, t0)
            model.eval()
            evals = held_out[: cfg.eval_problems]
            greedy = evaluate_tiny(model, tok, evals, temperature=0.0, mistake_offset=cfg.mistake_offset)
            sampled = evaluate_tiny(model, tok, evals, temperature=1.0, samples=cfg.eval_samples, seed=seed,
                                    mistake_offset=cfg.mistake_offset)
        finally:
            if torch.get_num_threads() != prev_threads:
                torch.set_num_threads(prev_threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_pretrained(model.cpu(), mcfg, out_dir, dtype=torch.float32)
    tok.save_pretrained(str(out_dir))
    meta = {
        "kind": TINY_KIND,
        "version": TINY_VERSION,
        "seed": seed,
        "sft": asdict(cfg),
        "split": {"seed": SPLIT_SEED, "num_train": len(train), "num_eval": len(held_out)},
        "train_s": round(train_s, 1),
        "sft_steps_per_thread_count": {str(k): v for k, v in sorted(thread_steps.items())},
        "held_out_problems": len(evals),
        "greedy": greedy,
        "sampled": sampled,
    }
    (out_dir / META_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    for f in out_dir.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; a shared cache must be readable
    return meta


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


# ---------------------------------------------------------------------------------------------- eval
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


# ---------------------------------------------------------------------------------------------- cache
TINY_KIND = "tiny-adder"
TINY_VERSION = 1
META_NAME = "tiny_start.json"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", META_NAME)


def cache_root() -> Path:
    """``$JETRL_CACHE`` (default ``~/.cache/jetrl``)."""
    return Path(os.environ.get("JETRL_CACHE") or "~/.cache/jetrl").expanduser()


def tiny_start_dir(cache_dir: str | Path | None = None, *, seed: int = 0, sft: TinySFTConfig | None = None) -> Path:
    """Where :func:`tiny_start_checkpoint` keeps the start: ``<cache>/tiny-adder-v1-seed{seed}[-<cfg hash>]``."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    name = f"{TINY_KIND}-v{TINY_VERSION}-seed{seed}"
    if sft is not None and sft != TinySFTConfig():
        import hashlib

        name += "-" + hashlib.sha256(json.dumps(asdict(sft), sort_keys=True).encode()).hexdigest()[:10]
    return root / name


def _is_complete(path: Path, seed: int, sft: TinySFTConfig) -> bool:
    if not all((path / f).is_file() for f in _REQUIRED_FILES):
        return False
    try:
        meta = json.loads((path / META_NAME).read_text())
    except ValueError:
        return False
    return (meta.get("kind"), meta.get("version"), meta.get("seed"), meta.get("sft")) == (
        TINY_KIND, TINY_VERSION, seed, json.loads(json.dumps(asdict(sft))))


def _remove_stale_builds(final: Path, max_age_s: float = 3600.0) -> None:
    """Delete temporary build dirs of ``final`` left by killed builds (older than any real build)."""
    now = time.time()
    for stale in final.parent.glob(f".{final.name}.*-*"):
        try:
            if stale.is_dir() and now - stale.stat().st_mtime > max_age_s:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


def tiny_start_checkpoint(cache_dir: str | Path | None = None, *, seed: int = 0, force: bool = False,
                          sft: TinySFTConfig | None = None) -> Path:
    """The HF-format checkpoint dir of the SFT'd tiny start, built on first use and cached.

    ``cache_dir`` is the cache root (default ``$JETRL_CACHE`` or ``~/.cache/jetrl``); the checkpoint
    is ``tiny_start_dir(cache_dir, seed=seed, sft=sft)``. A complete cached build (all files, same
    version, seed and SFT config) is reused unless ``force``. A build is written into a temporary
    sibling directory and moved into place with ``os.replace``, so a killed build never leaves a
    half-written cache, and two concurrent builds leave one complete copy.
    """
    cfg = sft or TinySFTConfig()
    final = tiny_start_dir(cache_dir, seed=seed, sft=sft)
    if not force and _is_complete(final, seed, cfg):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(final)
    print(f"jetrl: building the tiny start policy (SFT on synthetic addition, seed {seed}; ~2-3 min on 2 CPU "
          f"cores) into {final} ...", end=" ", flush=True)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
    try:
        try:
            meta = train_tiny_start(tmp, seed=seed, sft=cfg)
        except BaseException:
            print("failed", flush=True)
            raise
        if final.exists() and (force or not _is_complete(final, seed, cfg)):
            trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, trash / "old")
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if not _is_complete(final, seed, cfg):  # lost a race to a concurrent build: use its copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"done in {time.perf_counter() - t0:.0f}s (held-out greedy accuracy {meta['greedy']['accuracy']:.0%}, "
          f"sampled {meta['sampled']['accuracy']:.0%})", flush=True)
    return final
