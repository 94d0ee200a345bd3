"""GRPO on one shared precision flow, in TRL's vocabulary.

Pure functions (each file gives its math): ``advantages.py`` (group-normalized advantages),
``loss.py`` (PPO-clip with DAPO options, k3 KL), ``correction.py`` (TIS / MIS weights),
``metrics.py`` (rollout-vs-trainer mismatch under the names verl and NeMo-RL log), ``logprobs.py``,
``batch.py`` and ``token_logprobs.py`` + ``kernels/`` (trainer logprobs of sampled tokens; streaming Triton
kernels on CUDA). Orchestration: ``rollout.py`` (generate, score, batch), ``trainer.py`` (GRPOTrainer),
``train_graphs.py`` (the decoder layers' training forward+backward replayed from CUDA graphs),
``checkpoint.py`` (atomic save, exact resume), ``logger.py`` (metrics.jsonl, TensorBoard, W&B, progress),
``memory.py`` (out-of-memory advice), ``diagnose.py`` (per-layer rollout-vs-trainer comparison),
``replicas.py`` (data parallelism over torchrun).
``config.py`` holds GRPOConfig.
"""

from jetrl.rl.config import GRPOConfig
from jetrl.rl.memory import StepOutOfMemoryError
from jetrl.rl.trainer import GRPOTrainer, NonFiniteStepError

__all__ = ["GRPOConfig", "GRPOTrainer", "NonFiniteStepError", "StepOutOfMemoryError"]
