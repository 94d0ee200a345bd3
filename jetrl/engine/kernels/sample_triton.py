"""Triton: the engine's per-step draw from the full softmax, in ~1 streaming read of the logits.

Spec: :func:`jetrl.engine.sampling.sample_reference` for parameters that do not truncate
(``top_k == 0``, ``top_p == 1``), greedy included. For a row x (V logits, any float dtype) and
its uniform u = ``counter_uniform(key, step)`` in (0, 1):

    z = x / T (fp32)    token = min{i : cdf_i > u * cdf_V},  cdf = cumsum(softmax(z))
                        logprob = log_softmax(z)[token]
    greedy (T = 0):     token = first argmax of x,  logprob = log_softmax(x)[token]

Why: in PyTorch that is a fp32 copy of the logits, log_softmax, exp, cumsum, two searchsorted, a
gather and ~45 tiny integer ops for u: 720 µs of GPU time per decode step at B = 256, V = 151936
on the H200 (814 µs at T != 1, 319 µs greedy). Here the logits are read in their own dtype (bf16 on
the GPU), every intermediate stays in registers except 2-3 numbers per chunk, and u is computed in
the kernel: 31 µs in all three cases (B = 64: 11 µs, B = 8: 7 µs; CUDA-graph replays, 2026-11-30).

The math, with q_i = exp(z_i - m) and S = sum_i q_i (so softmax(z)_i = q_i / S):

    pass 1  grid (B, C): chunk c of the row (CHUNK = BLOCK * TILES consecutive logits) gives
            m_c = max z and S_c = sum exp(z - m_c), online over its tiles (S rescaled by
            exp(m_old - m_new) when the max grows), and for greedy the first index of m_c.
    pass 2  grid (B,): m = max_c m_c; M_c = S_c exp(m_c - m) is chunk c's mass; P = cumsum(M)
            over chunks, S = P[C-1], target = u * S. The chunk holding the draw is the first c
            with P[c] > target; only that chunk is read again, scanned in vocabulary order with
            tile prefix sums (tl.cumsum) of q starting from P[c-1]: token = first i with q_i > 0
            and prefix_i > target. logprob = (z_token - m) - log S, as log_softmax computes it.
            Greedy reads no logits here: token = the first index of m in the first chunk whose
            m_c == m (torch.argmax's first maximal index); logprob = (m - m) - log S.

Why rows are split into chunks: pass 2 then rereads one chunk per row instead of the whole row, so
a step reads the logits (1 + 1/C) times, not twice; and pass 1 has B * C programs, which fill the
GPU at small batches too (one program per row would leave SMs idle below B = 132). Bytes per step
at B = 256, V = 151936 bf16, CHUNK = 4096 (C = 38): 77.8 MB (pass 1) + 256 * 8 KB = 2.1 MB (pass 2)
+ 78 KB of stats, against ~1.2 GB of fp32 traffic in PyTorch. Pass 1 takes 25 µs (3.1 TB/s; a
clone of the logits moves 3.9 TB/s), pass 2 and the second launch the other ~5 µs. Sweep (BLOCK,
TILES, warps) at B = 256: (4096, 1, 4) 30.4 µs, (8192, 1, 8) 31.0, (2048, 1, 4) 32.5, (4096, 2, 8)
34.6, (16384, 1, 8) 36.4; 16 warps and 1024-wide tiles were slower (39-115 µs).

Temperature: z = x * fl(1/T), within an ulp of the spec's x / T. IEEE division (div_rn) in the
kernel cost 59 µs instead of 34 at T = 0.7: it is compute, not bytes, at 39M logits per step.

Rounding and ties. The chunk sums and the in-chunk scan are fp32 sums in another order than the
spec's cumsum, and exp (and z at T != 1) may differ by an ulp, so a draw whose target lies within
rounding (< 1e-6 of the total) of a cdf boundary can take the neighbouring token; elsewhere the
token is the spec's. Measured on the H200 against the spec there, B = 256 rows of std-3 bf16 logits:
V = 151936, 107 of 8192 draws at T = 1 and 39 of 8192 at T = 0.7, all within 6e-7 of a boundary
(the spec itself disagrees between GPU and CPU on 19 of 1024); V = 4099, 25 and 22 of 65536. If rounding puts the target past every prefix
of the chosen chunk (its scan sums a bit less than M_c), the token is the chunk's last with q_i > 0,
as the spec takes the last token of positive probability when its target reaches the total; if no
chunk's prefix exceeds the target, the last chunk of positive mass is scanned. Tokens of zero
probability (z = -inf, or q underflows) are never drawn. A row that is all -inf gives token 0
(greedy and sampled) and a NaN logprob, as the spec does. Logprobs agree within 1e-5.

The uniform. u is computed in the draw kernel with the integer ops of ``counter_uniform`` on uint32
(multiplications wrap mod 2^32, which the spec's split 16-bit products emulate on int64), bit for
bit the same value (tested, edge keys included); in PyTorch those ops are ~45 tiny launches per
step: 57 µs of GPU time and ~0.4 ms of host time, at any batch size.

Batch invariance: BLOCK and TILES are fixed constants (not tuned per batch), so a row's token and
logprob depend on its own logits, key and step only, whatever else is in the batch.

No host sync and no data-dependent allocation: the stats are (B, C) tensors of a size known from
the shapes; both launches are CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl.engine.sampling import SamplingParams

# The H200 sweep's best at B = 256, V = 151936 bf16 (module docstring); fixed, not tuned per batch.
BLOCK = 4096  # logits per tile: 32 per thread at 4 warps (four 16-byte bf16 loads)
TILES = 1  # tiles per chunk: CHUNK = 4096, C = 38 chunks at V = 151936
NUM_WARPS = 4
LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _scaled(x, inv_temperature, SCALE: tl.constexpr):
    """fp32 z = x * (1 / T): within an ulp of the spec's x / T (module docstring); T = 1 (or greedy) skips it."""
    z = x.to(tl.float32)
    if SCALE:
        z = z * inv_temperature
    return z


@triton.jit
def _mix32(x):
    """sampling._mix32 on uint32: multiplications wrap mod 2^32 as the spec's split products do."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _counter_uniform(key, step):
    """sampling.counter_uniform for one row, bit for bit: (2 * (h >> 9) + 1) * 2^-24 is exact in fp32."""
    h = _mix32(key.to(tl.uint32) ^ _mix32(step.to(tl.uint32) ^ 0x9E3779B9))  # int64 -> uint32 keeps the low bits
    return (2 * (h >> 9) + 1).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _counter_uniform_kernel(keys_ptr, steps_ptr, out_ptr, B, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < B
    tl.store(out_ptr + i, _counter_uniform(tl.load(keys_ptr + i, mask=ok), tl.load(steps_ptr + i, mask=ok)), mask=ok)


@triton.jit
def online_logsumexp_step(m, s, z, tile_max):
    """One tile z of an online log-sum-exp, given the running max m and sum s = sum exp(z_seen - m) and
    the tile's max: (m_new, m_safe, alpha, e, s_new) with alpha = exp(m - m_new) rescaling the old sum,
    e = exp(z - m_new) and s_new = alpha s + sum e. m_safe is m_new, or 0 while everything seen is -inf
    (so no -inf - -inf). Shared by the sampler and the trainer's logprob kernels
    (jetrl/rl/kernels/token_logprobs_triton.py): the same arithmetic on both sides."""
    m_new = tl.maximum(m, tile_max)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    e = tl.exp(z - m_safe)
    return m_new, m_safe, alpha, e, s * alpha + tl.sum(e, axis=0)


@triton.jit
def _chunk_stats_kernel(logits_ptr, m_ptr, s_ptr, arg_ptr, V, stride_b, num_chunks, inv_temperature,
                        BLOCK: tl.constexpr, TILES: tl.constexpr, SCALE: tl.constexpr, GREEDY: tl.constexpr):
    b, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    row = logits_ptr + b * stride_b
    offs = tl.arange(0, BLOCK)
    first = c * (TILES * BLOCK)
    m = tl.full((), float("-inf"), tl.float32)  # running max of z over the chunk
    s = tl.zeros((), tl.float32)  # running sum of exp(z - m)
    arg = first  # first index of m (an all -inf chunk keeps its first index)
    for t in range(TILES):
        idx = first + t * BLOCK + offs
        z = _scaled(tl.load(row + idx, mask=idx < V, other=float("-inf")), inv_temperature, SCALE)
        tile_max = tl.max(z, axis=0)
        if GREEDY:  # strictly greater: an earlier tile keeps a tie
            arg = tl.where(tile_max > m, tl.min(tl.where(z == tile_max, idx, 2147483647), axis=0), arg)
        m, _, _, _, s = online_logsumexp_step(m, s, z, tile_max)
    out = b * num_chunks + c
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, s)
    if GREEDY:
        tl.store(arg_ptr + out, arg)


@triton.jit
def _scan_chunk(row, chunk, carry, target, m_safe, V, inv_temperature,
                BLOCK: tl.constexpr, TILES: tl.constexpr, SCALE: tl.constexpr):
    """The first index i of the chunk with q_i > 0 and carry + prefix_i > target; if none, the last
    index with q_i > 0 (the chunk's first index if it has none: only in an all -inf row)."""
    offs = tl.arange(0, BLOCK)
    first = chunk * (TILES * BLOCK)
    found = tl.full((), 2147483647, tl.int32)
    last_positive = tl.full((), -1, tl.int32)
    for t in range(TILES):
        idx = first + t * BLOCK + offs
        q = tl.exp(_scaled(tl.load(row + idx, mask=idx < V, other=float("-inf")), inv_temperature, SCALE) - m_safe)
        hit = (carry + tl.cumsum(q, axis=0) > target) & (q > 0)
        found = tl.minimum(found, tl.min(tl.where(hit, idx, 2147483647), axis=0))
        last_positive = tl.maximum(last_positive, tl.max(tl.where(q > 0, idx, -1), axis=0))
        carry += tl.sum(q, axis=0)
    fallback = tl.where(last_positive >= 0, last_positive, first)
    return tl.where(found < 2147483647, found, fallback).to(tl.int64)


@triton.jit
def _draw_kernel(logits_ptr, m_ptr, s_ptr, arg_ptr, keys_ptr, steps_ptr, tokens_ptr, logprobs_ptr, V, stride_b, num_chunks,
                 inv_temperature, BLOCK: tl.constexpr, TILES: tl.constexpr, BLOCK_C: tl.constexpr,
                 SCALE: tl.constexpr, GREEDY: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_C)
    valid = j < num_chunks
    m_c = tl.load(m_ptr + b * num_chunks + j, mask=valid, other=float("-inf"))
    s_c = tl.load(s_ptr + b * num_chunks + j, mask=valid, other=0.0)
    m = tl.max(m_c, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    mass = tl.where(m_c == float("-inf"), 0.0, s_c * tl.exp(m_c - m_safe))  # (BLOCK_C,) chunk masses
    prefix = tl.cumsum(mass, axis=0)
    total = tl.sum(tl.where(j == num_chunks - 1, prefix, 0.0), axis=0)  # S = prefix[C - 1]
    log_total = tl.log(total)
    if GREEDY:
        first = tl.min(tl.where(valid & (m_c == m), j, BLOCK_C), axis=0)
        first = tl.where(first == BLOCK_C, 0, first)  # an all -inf row: chunk 0
        token = tl.load(arg_ptr + b * num_chunks + first).to(tl.int64)
        logprob = (m - m) - log_total
    else:
        target = _counter_uniform(tl.load(keys_ptr + b), tl.load(steps_ptr + b)) * total
        chunk = tl.min(tl.where(valid & (prefix > target) & (mass > 0), j, BLOCK_C), axis=0)
        last_chunk = tl.max(tl.where(valid & (mass > 0), j, 0), axis=0)
        chunk = tl.where(chunk == BLOCK_C, last_chunk, chunk)  # rounding put the target at the total
        before = tl.sum(tl.where(j == chunk - 1, prefix, 0.0), axis=0)  # prefix[chunk - 1], 0 for chunk 0
        token = _scan_chunk(logits_ptr + b * stride_b, chunk, before, target, m_safe, V, inv_temperature,
                            BLOCK, TILES, SCALE)
        z = _scaled(tl.load(logits_ptr + b * stride_b + token), inv_temperature, SCALE)
        logprob = (z - m) - log_total
    tl.store(tokens_ptr + b, token)
    tl.store(logprobs_ptr + b, logprob)


def sample_triton(logits: torch.Tensor, params: SamplingParams, keys: torch.Tensor, steps: torch.Tensor, *,
                  block: int = BLOCK, tiles: int = TILES, num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`jetrl.engine.sampling.sample_reference` for params that do not truncate: tokens (B,) int64
    and their logprobs (B,) fp32, with the uniforms of ``counter_uniform(keys, steps)`` (computed in the kernel).

    logits (B, V) bf16/fp16/fp32, any row stride, unit column stride; keys, steps (B,) int64.
    ``block`` (a power of two) and ``tiles`` set the chunk (``block * tiles`` logits); the defaults are
    the engine's, and a row's result depends on them (module docstring), so pass them only in tests
    and sweeps.
    """
    assert not params.truncates(logits.shape[-1]), "top-k/top-p truncation is sample_reference's (a vocabulary sort)"
    assert logits.dim() == 2 and logits.stride(-1) == 1 and logits.dtype in LOGIT_DTYPES, (
        logits.shape, logits.stride(), logits.dtype)
    B, V = logits.shape
    assert keys.shape == steps.shape == (B,) and keys.dtype == steps.dtype == torch.int64, (keys, steps)
    assert block & (block - 1) == 0 and tiles >= 1 and V >= 1, (block, tiles, V)
    keys, steps = keys.contiguous(), steps.contiguous()
    greedy = params.is_greedy
    scale = not greedy and params.temperature != 1
    inv_temperature = 1.0 if not scale else 1.0 / params.temperature  # passed as fp32
    num_chunks = triton.cdiv(V, block * tiles)
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    if B == 0:
        return tokens, logprobs
    m = torch.empty(B, num_chunks, dtype=torch.float32, device=logits.device)  # per-chunk max of z
    s = torch.empty_like(m)  # per-chunk sum of exp(z - m_c)
    arg = torch.empty(B, num_chunks, dtype=torch.int32, device=logits.device) if greedy else m  # first argmax
    _chunk_stats_kernel[(B, num_chunks)](logits, m, s, arg, V, logits.stride(0), num_chunks, inv_temperature,
                                         BLOCK=block, TILES=tiles, SCALE=scale, GREEDY=greedy, num_warps=num_warps)
    _draw_kernel[(B,)](logits, m, s, arg, keys, steps, tokens, logprobs, V, logits.stride(0), num_chunks,
                       inv_temperature, BLOCK=block, TILES=tiles, BLOCK_C=max(triton.next_power_of_2(num_chunks), 2),
                       SCALE=scale, GREEDY=greedy, num_warps=num_warps)
    return tokens, logprobs


def counter_uniform_triton(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """:func:`jetrl.engine.sampling.counter_uniform` as the sampler computes it, in one launch (tests: bit for bit)."""
    assert keys.shape == steps.shape and keys.dim() == 1 and keys.dtype == steps.dtype == torch.int64, (keys, steps)
    keys, steps = keys.contiguous(), steps.contiguous()
    out = torch.empty(keys.shape, dtype=torch.float32, device=keys.device)
    _counter_uniform_kernel[(triton.cdiv(keys.numel(), 1024),)](keys, steps, out, keys.numel(), BLOCK=1024)
    return out
