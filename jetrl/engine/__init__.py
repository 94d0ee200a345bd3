"""The rollout engine: continuous batching over a static KV cache, on the trainer's own modules.

Why here and not vLLM: the engine calls the same ``nn.Module`` objects (and, under the ``jet``
recipe, the same cached FP8 weight codes) as the trainer, inside ``precision_phase("rollout")``,
so the rollout samples from the trainer's forward graph with no weight transfer (design.md §5).

Files: ``sampling.py`` (SamplingParams, processed logprobs, counter-based seeded sampling),
``kv_cache.py`` (static per-slot cache), ``scheduler.py`` (slots, groups, finish rules),
``cuda_graph.py`` (decode capture/replay), ``decode_attention.py`` (attention over the cache's valid
positions, BF16 or FP8), ``engine.py`` (the loop), ``scoring.py`` (teacher-forced logprobs through the
rollout's path), ``kernels/`` (Triton: decode attention, K/V store, fused sampler; each with its PyTorch spec).
"""

from jetrl.engine.engine import Completion, Engine, EngineStats
from jetrl.engine.kv_cache import StaticKVCache
from jetrl.engine.sampling import SamplingParams, processed_logprobs, sample
from jetrl.engine.scheduler import Scheduler, Sequence

__all__ = [
    "Completion",
    "Engine",
    "EngineStats",
    "SamplingParams",
    "Scheduler",
    "Sequence",
    "StaticKVCache",
    "processed_logprobs",
    "sample",
]
