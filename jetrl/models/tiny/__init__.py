r"""The tiny adder: a from-scratch start policy for the embedded default ``jetrl train`` run.

Why: the default run must show RL working end to end offline, on a 2-core CPU, in minutes:
held-out accuracy must rise by >= 30 points, and the rise must come from RL, not from more
supervised training. No hub model is reachable and even SmolLM2-135M is too slow for that
budget, so the project trains its own start (~0.4M parameters) and ships the build (``start/``;
``cache.py`` says why).

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

* time: a build (``tiny_start_checkpoint(force=True)``) takes 2 min 19 s wall on 2 idle Xeon
  cores (133 s build: 128 s SFT at ~0.21 s/step, ~5 s eval) and 2 min 21 s on this project's
  2-core box when idle; 4.4-4.6 min when other processes load the 2 cores (load ~3), which
  is why the SFT times one step with 1 thread against 2 and keeps the faster (see
  ``sft._ThreadTuner``: under load 2 OpenMP threads took 3.0 s/step against 0.39 s for 1).
  A cached call returns in milliseconds. The shipped build took 287 s on the 2-core box (2026-12-07).
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

Layout, one concept per module: ``tokenizer`` (character tokenizer, chat template), ``model``
(the model config), ``task`` (the split, the answer text), ``sft`` (the SFT config, data, loss,
loop), ``evaluate`` (generation and held-out metrics), ``cache`` (the build written to disk and
its atomic cache).
"""

from jetrl.models.tiny.cache import (
    META_NAME,
    TINY_KIND,
    TINY_VERSION,
    cache_root,
    tiny_start_checkpoint,
    tiny_start_dir,
    train_tiny_start,
)
from jetrl.models.tiny.evaluate import evaluate_tiny, generate_tiny
from jetrl.models.tiny.model import VOCAB_MULTIPLE, tiny_model_config
from jetrl.models.tiny.sft import TinySFTConfig
from jetrl.models.tiny.task import NUM_EVAL, SPLIT_SEED, answer_text, tiny_task_split
from jetrl.models.tiny.tokenizer import (
    CHARACTERS,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    PAD_TOKEN,
    ROLE_TOKENS,
    SPECIAL_TOKENS,
    UNK_TOKEN,
    build_tiny_tokenizer,
)

__all__ = [
    "CHARACTERS",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "META_NAME",
    "NUM_EVAL",
    "PAD_TOKEN",
    "ROLE_TOKENS",
    "SPECIAL_TOKENS",
    "SPLIT_SEED",
    "TINY_KIND",
    "TINY_VERSION",
    "UNK_TOKEN",
    "VOCAB_MULTIPLE",
    "TinySFTConfig",
    "answer_text",
    "build_tiny_tokenizer",
    "cache_root",
    "evaluate_tiny",
    "generate_tiny",
    "tiny_model_config",
    "tiny_start_checkpoint",
    "tiny_start_dir",
    "tiny_task_split",
    "train_tiny_start",
]
