"""GRPO on one shared precision flow, in TRL's vocabulary.

Pure functions (each file gives its math): ``advantages.py`` (group-normalized advantages),
``loss.py`` (PPO-clip with DAPO options, k3 KL), ``correction.py`` (TIS / MIS weights),
``metrics.py`` (rollout-vs-trainer mismatch under the anchors' names), ``logprobs.py`` and
``batch.py`` (trainer logprobs of sampled tokens). Orchestration: ``rollout.py`` (generate,
score, batch), ``trainer.py`` (GRPOTrainer), ``checkpoint.py`` (atomic save, exact resume),
``logger.py`` (metrics.jsonl, TensorBoard, W&B, progress), ``memory.py`` (out-of-memory advice).
``config.py`` holds GRPOConfig.
"""

from jetrl.rl.config import GRPOConfig
from jetrl.rl.memory import StepOutOfMemoryError
from jetrl.rl.trainer import GRPOTrainer, NonFiniteStepError

__all__ = ["GRPOConfig", "GRPOTrainer", "NonFiniteStepError", "StepOutOfMemoryError"]
