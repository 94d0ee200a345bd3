"""The HF transformers baseline of section (e): ``Qwen3ForCausalLM.generate`` on the same weights.

Why this baseline: it is what an RL framework without its own engine runs, and design.md §5
measured it 20-25x above the bytes floor at batch 256 (~110 ms per step, bound by per-step host
overhead), which is the gap an engine with CUDA graphs closes.

Same model: the HF config is ``ModelConfig.to_hf_dict()`` of the jetrl model and the state dict
is loaded strictly (the parameter names are identical). BF16, SDPA attention, sampling at
temperature 1 with no top-k/top-p, no EOS (the random model's config has none) and
``min_new_tokens = max_new_tokens``, so every row generates exactly ``new_tokens``.

Matched context: HF at ~110 ms/step cannot run the whole 1024-token rollout inside the bench's
budget, and its per-step cost grows with the context (its cache is concatenated each step). So
the caller gives HF prompts as long as the rollout's *mean* context minus half of HF's new
tokens, and this measures HF's decode step there: ``(t(generate N) - t(generate 1)) / (N - 1)``,
prefill excluded -- the figure to set against jetrl's decode ms/step over the whole rollout.

transformers is imported lazily: ``jetrl bench`` imports nothing heavy at module import.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from jetrl.bench.models import free_device_memory
from jetrl.bench.timing import wall_s


def hf_generate(model: nn.Module, prompts: list[list[int]], new_tokens: int, device: torch.device) -> dict[str, Any]:
    """HF ``generate`` on ``model``'s weights: decode ms/step (prefill excluded), tok/s (module docstring)."""
    import transformers

    hf_config = transformers.AutoConfig.for_model(**model.config.to_hf_dict())
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa", dtype=torch.bfloat16)
    hf = hf.to(device).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    ids = torch.tensor(prompts, device=device)
    kwargs = {"attention_mask": torch.ones_like(ids), "do_sample": True, "temperature": 1.0, "top_k": 0,
              "top_p": 1.0, "pad_token_id": 0, "eos_token_id": None}
    try:
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up: kernels, allocator
            first_s, _ = wall_s(lambda: hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs), device)
            seconds, out = wall_s(lambda: hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                      **kwargs), device)
        generated = out.shape[1] - ids.shape[1]
    finally:
        hf = None
        free_device_memory()
    step_s = max(seconds - first_s, 1e-9) / max(generated - 1, 1)
    return {"ms_per_step": step_s * 1e3, "tok_s": ids.shape[0] / step_s, "prefill_and_first_s": first_s,
            "wall_s": seconds, "new_tokens": generated, "prompt_len": ids.shape[1], "ok": generated == new_tokens,
            "transformers": transformers.__version__}
