"""The fused decode-step K/V store (jetrl/engine/kernels/kv_store_triton.py) against its spec,
``DecodeView.store_reference``, under ``TRITON_INTERPRET=1`` on CPU: for a BF16 and an FP8 cache
(fp32 and power-of-two scales), rows at different positions, a row holding NaN and an all-zero
row, every buffer of the cache -- written positions and untouched ones -- is bit-identical.
The FP8 codes and scales it writes are therefore the trainer's ``quantize_kv`` of the same K/V."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import torch
from jetrl.engine.kv_cache import StaticKVCache
from jetrl.fp8.recipe import KVCacheSpec

torch.manual_seed(0)
layers, slots, Hkv, S, D, B = 2, 6, 2, 9, 64, 4
for spec in (None, KVCacheSpec(False), KVCacheSpec(True)):
    caches = [StaticKVCache(layers, slots, Hkv, S, D, torch.bfloat16, "cpu", spec) for _ in range(2)]
    lengths = torch.tensor([0, 5, 8, 3, 7, 2])
    k = (torch.randn(B, Hkv, 1, D) * 3).bfloat16()
    v = torch.randn(B, 1, Hkv, D).bfloat16().transpose(1, 2)  # the model's strided view
    k[1, 0, 0, 5] = float("nan")
    v[2] = 0.0
    for cache, fused in zip(caches, (True, False)):
        cache.lengths.copy_(lengths)
        view = cache.decode(B)
        view.store_fused(1, k, v) if fused else view.store_reference(1, k, v)
    fused, ref = caches
    for name in ("k", "v", "k_scale", "v_scale"):
        a, b = getattr(fused, name), getattr(ref, name)
        if a is None:
            continue
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)  # codes: bit for bit, NaN code included
        else:
            a, b = a.nan_to_num(7.0), b.nan_to_num(7.0)  # NaN payloads may differ (the interpreter)
        assert torch.equal(a, b), (spec, name)
    assert spec is None or torch.isnan(fused.k_scale[1, 1, 0, 5]), "a NaN group gets a NaN scale"
# a position outside the row (never produced by the engine) writes nothing, anywhere
cache = StaticKVCache(layers, slots, Hkv, S, D, torch.bfloat16, "cpu", KVCacheSpec(False))
before = [t.clone() for t in cache.storage(1)]
cache.lengths.copy_(torch.tensor([S, -1, S + 5, 0, 0, 0]))
cache.decode(3).store_fused(1, k[:3], v[:3])
assert all(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))  # bitwise
           for a, b in zip(cache.storage(1), before))

# a prefill into a model-dtype cache: store_prefill_triton(x, buf, slots) is buf[slots, :, :T] = x, bit for bit
from jetrl.engine.kernels.kv_store_triton import store_prefill_triton
for dtype in (torch.bfloat16, torch.float32):
    x = torch.randn(3, 7, Hkv, D).to(dtype).transpose(1, 2)  # (B, Hkv, T, D), the model's strided view
    x[0, 1, 2, 3] = float("nan")
    bufs = [torch.full((slots, Hkv, S, D), 5.0, dtype=dtype) for _ in range(2)]
    rows = torch.tensor([4, 0, 2])
    store_prefill_triton(x, bufs[0], rows)
    bufs[1][rows, :, :7] = x
    assert torch.equal(bufs[0].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       bufs[1].view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), dtype
print("OK")
"""


def test_fused_store_matches_reference_in_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], check=False, env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prefill_store_on_cuda_is_the_indexed_store():
    """An engine's BF16 cache on CUDA takes a prefill's K/V through store_prefill_triton: the same bits as the
    indexed store, untouched slots and positions left alone."""
    pytest.importorskip("triton")
    from jetrl.engine.kv_cache import StaticKVCache

    k = torch.randn(3, 40, 8, 128, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(3, 8, 40, 128, dtype=torch.bfloat16)
    slots, lengths = torch.tensor([4, 0, 2]), torch.tensor([40, 33, 17])
    caches = []
    for device, fused in (("cpu", False), ("cuda", True)):
        cache = StaticKVCache(2, 5, 8, 48, 128, torch.bfloat16, device)
        cache.k.fill_(3.0)
        cache.v.fill_(3.0)
        cache.use_decode_kernel = fused
        kd, vd = k.to(device), v.to(device)
        assert cache.prefill(slots.to(device), lengths.to(device)).update(1, kd, vd) == (kd, vd)  # read as given
        caches.append(cache)
    for name in ("k", "v"):
        assert torch.equal(getattr(caches[1], name).cpu().view(torch.int16), getattr(caches[0], name).view(torch.int16))
