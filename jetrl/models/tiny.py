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
one token where the two answers differ; it never needs to learn addition. That is a large,
reliable, measurable rise that RL causes (a GRPO group of 8 samples holds a right answer
with probability 1 - 0.7^8 ~ 94%, so nearly every group has a learning signal).

Training detail: each example follows one of the two answers (drawn with probability p), but
at the one position where they differ the target is the demonstration distribution itself,
``p`` on the correct token and ``1 - p`` on the mistaken one (the expected cross-entropy under
the demonstrations), so the learned split is calibrated at far less gradient noise. Problems
are augmented with their swaps (a + b -> b + a): the swap of a train problem is a train
problem, as ``synthetic_split`` puts both orientations of a problem on the same side.

Measured (2 shared CPU cores, seed 0, defaults; held-out = the first 200 problems of the
held-out split; fp32 weights): see ``MEASURED`` below, filled in from ``evaluate_tiny``.
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
from dataclasses import asdict, dataclass, field
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
    for training, ``num_eval`` held out. SFT used ``num_eval=NUM_EVAL``; RL must use the same (or
    evaluate only on held-out records of it), or its eval set would hold SFT training problems.
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
    num_threads: int | None = None  # torch threads during the build (restored after); None: leave as is
    eval_problems: int = 200  # held-out problems measured after the build (stored in tiny_start.json)
    eval_samples: int = 8  # temperature-1 samples per problem for the sampled accuracy
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.p_correct <= 1.0:
            raise ValueError(f"p_correct={self.p_correct} must be in [0, 1]")
        if self.mistake_offset == 0:
            raise ValueError("mistake_offset=0 would make the mistake the correct answer; use e.g. 10")
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps={self.steps} and batch_size={self.batch_size} must be >= 1")


def _encode_examples(tok: Any, records: Sequence[Record]) -> list[tuple[list[int], int, int, int, int]]:
    """Per problem: (prompt ids, a, b) -- answers are rendered per step."""
    raise NotImplementedError


class _SFTData:
    """Token tensors of (problem, answer) examples: prompt ids + answer ids + EOS, loss on the answer."""

    def __init__(self, tok: Any, records: Sequence[Record], cfg: TinySFTConfig) -> None:
        self.tok, self.cfg = tok, cfg
        self.eos = tok.eos_token_id
        self.pad = tok.pad_token_id
        problems = []
        for r in records:
            a, b = _operands(r)
            problems.append((a, b))
            if a != b:
                problems.append((b, a))  # the swap is a train problem too (module docstring)
        self.problems = problems

    def _prompt(self, a: int, b: int) -> list[int]:
        text = self.tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}], tokenize=False,
                                            add_generation_prompt=True)
        return self.tok.encode(text, add_special_tokens=False)

    def batch(self, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """input ids (B, T), targets (B, T), alternative targets (B, T), weight of the alternative (B, T).

        A position's loss is ``(1 - w) * CE(target) + w * CE(alt)``; ``target = -100`` ignores it.
        """
        cfg = self.cfg
        rows = []
        for a, b in (rng.choice(self.problems) for _ in range(cfg.batch_size)):
            s = a + b
            right = self.tok.encode(answer_text(s), add_special_tokens=False) + [self.eos]
            wrong = self.tok.encode(answer_text(s + cfg.mistake_offset), add_special_tokens=False) + [self.eos]
            correct = rng.random() < cfg.p_correct
            follow, other = (right, wrong) if correct else (wrong, right)
            d = next(i for i, (x, y) in enumerate(zip(follow, other)) if x != y)  # first differing position
            prompt = self._prompt(a, b)
            ids = prompt + follow
            tgt = [-100] * (len(prompt) - 1) + follow + [-100]
            alt = list(tgt)
            w = [0.0] * len(ids)
            pos = len(prompt) - 1 + d  # input position whose next token is the differing one
            alt[pos] = other[d]
            w[pos] = 1.0 - cfg.p_correct if correct else cfg.p_correct
            # target gets (1 - w): the followed answer's probability; alt gets the other's.
            rows.append((ids, tgt, alt, w))
        T = max(len(r[0]) for r in rows)
        ids = torch.full((len(rows), T), self.pad, dtype=torch.int64)
        tgt = torch.full((len(rows), T), -100, dtype=torch.int64)
        alt = torch.full((len(rows), T), -100, dtype=torch.int64)
        wt = torch.zeros(len(rows), T)
        for i, (x, t, al, w) in enumerate(rows):
            n = len(x)
            ids[i, :n], tgt[i, :n], alt[i, :n], wt[i, :n] = (torch.tensor(x), torch.tensor(t[:n]),
                                                             torch.tensor(al[:n]), torch.tensor(w))
        return ids, tgt, alt, wt


def _sft_loss(logits: torch.Tensor, tgt: torch.Tensor, alt: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    logp = F.log_softmax(logits.float(), dim=-1)
    mask = tgt != -100
    nll_t = -logp.gather(-1, tgt.clamp(min=0)[..., None])[..., 0]
    nll_a = -logp.gather(-1, alt.clamp(min=0)[..., None])[..., 0]
    per_tok = (1.0 - w) * nll_t + w * nll_a
    return (per_tok * mask).sum() / mask.sum()


def train_tiny_start(out_dir: str | Path, *, seed: int = 0, sft: TinySFTConfig | None = None,
                     log_every: int = 0) -> dict[str, Any]:
    """SFT the tiny start from scratch and save it (weights fp32, tokenizer, ``tiny_start.json``) to ``out_dir``.

    Deterministic given ``seed`` on one machine (same torch build and thread count). Returns the
    metadata written to ``tiny_start.json`` (config, timings, held-out accuracies).
    """
    cfg = sft or TinySFTConfig()
    out_dir = Path(out_dir)
    t0 = time.perf_counter()
    prev_threads = torch.get_num_threads()
    try:
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        tok = build_tiny_tokenizer()
        mcfg = tiny_model_config(len(tok), num_hidden_layers=cfg.num_hidden_layers,
                                 intermediate_size=cfg.intermediate_size)
        train, held_out = tiny_task_split()
        torch.manual_seed(seed)
        model = CausalLM(mcfg).float()
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
        for step in range(cfg.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            ids, tgt, alt, w = data.batch(rng)
            loss = _sft_loss(model(ids), tgt, alt, w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if log_every and (step % log_every == 0 or step == cfg.steps - 1):
                print(f"  sft step {step:5d} loss {loss.item():.4f} ({time.perf_counter() - t0:.0f}s)", flush=True)
        train_s = time.perf_counter() - t0
        model.eval()
        evals = held_out[: cfg.eval_problems]
        greedy = evaluate_tiny(model, tok, evals, temperature=0.0, mistake_offset=cfg.mistake_offset)
        sampled = evaluate_tiny(model, tok, evals, temperature=1.0, samples=cfg.eval_samples, seed=seed,
                                mistake_offset=cfg.mistake_offset)
    finally:
        torch.set_num_threads(prev_threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, mcfg, out_dir, dtype=torch.float32)
    tok.save_pretrained(str(out_dir))
    meta = {
        "kind": TINY_KIND,
        "version": TINY_VERSION,
        "seed": seed,
        "sft": asdict(cfg),
        "split": {"seed": SPLIT_SEED, "num_train": len(train), "num_eval": len(held_out)},
        "train_s": round(train_s, 1),
        "held_out_problems": len(evals),
        "greedy": greedy,
        "sampled": sampled,
    }
    (out_dir / META_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return meta


# ---------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def generate_tiny(model: CausalLM, tok: Any, prompts: Sequence[str], *, temperature: float = 0.0, samples: int = 1,
                  seed: int = 0, max_new_tokens: int = 16) -> list[list[str]]:
    """``samples`` completions per user prompt (text before EOS; '' if none), by repeated full forwards.

    Prompts of equal token length run as one batch (no padding); a row keeps decoding after its
    EOS and its tail is cut. Deterministic given ``seed``. For evaluation of small models only.
    """
    eos = tok.eos_token_id
    gen = torch.Generator().manual_seed(seed)
    encoded = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for p in prompts]
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_len.setdefault(len(ids), []).append(i)
    out: list[list[str]] = [[] for _ in prompts]
    dtype = next(model.parameters()).dtype
    del dtype
    for _, idx in sorted(by_len.items()):
        rows = [encoded[i] for i in idx for _ in range(samples)]
        x = torch.tensor(rows, dtype=torch.int64)
        start = x.shape[1]
        for _ in range(max_new_tokens):
            logits = model(x)[:, -1].float()
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)[:, 0]
            x = torch.cat([x, nxt[:, None]], dim=1)
            if bool(((x[:, start:] == eos).any(-1)).all()):
                break
        for r, row in enumerate(x[:, start:].tolist()):
            if eos in row:
                text = tok.decode(row[: row.index(eos)], skip_special_tokens=False)
            else:
                text = tok.decode(row, skip_special_tokens=False) + "<no-eos>"
            out[idx[r // samples]].append(text)
    return out


def evaluate_tiny(model: CausalLM, tok: Any, records: Sequence[Record], *, temperature: float = 0.0,
                  samples: int = 1, seed: int = 0, mistake_offset: int = 10,
                  max_new_tokens: int = 16) -> dict[str, float]:
    r"""Held-out metrics of ``model`` on addition ``records``.

    accuracy:    fraction of completions the math reward scores 1 (``jetrl.rewards.is_equivalent``
                 on the extracted answer);
    mistake:     fraction answering exactly ``sum + mistake_offset`` in the well-formed format;
    well_formed: fraction that are exactly ``\boxed{<integer>}`` followed by EOS.
    """
    import re

    from jetrl.rewards.math import math_reward

    was_training = model.training
    model.eval()
    try:
        completions = generate_tiny(model, tok, [r["prompt"][-1]["content"] for r in records],
                                    temperature=temperature, samples=samples, seed=seed, max_new_tokens=max_new_tokens)
    finally:
        model.train(was_training)
    flat = [c for cs in completions for c in cs]
    golds = [r["ground_truth"] for r, cs in zip(records, completions) for _ in cs]
    rewards = math_reward(flat, ground_truth=golds)
    form = re.compile(r"\\boxed\{(-?\d+)\}")
    well, mistake = 0, 0
    for c, g in zip(flat, golds):
        m = form.fullmatch(c)
        if m:
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
    print(f"jetrl: building the tiny start policy (SFT of a {cfg.num_hidden_layers}-layer adder, seed {seed}) "
          f"into {final} ...", end=" ", flush=True)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        meta = train_tiny_start(tmp, seed=seed, sft=cfg)
        if final.exists():
            if force or not _is_complete(final, seed, cfg):
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
