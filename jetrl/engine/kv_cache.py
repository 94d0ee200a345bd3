"""A static per-slot KV cache: fixed shapes, one row ("slot") per running sequence.

Why static: every decode step then has the same tensor shapes and addresses for a given
batch size, so it can be captured once in a CUDA graph and replayed (engine/cuda_graph.py).
Why per-slot rather than paged: it is the smallest correct design in pure PyTorch (SDPA
reads a dense cache at the bytes floor, design.md §5); the cost is memory reserved for
``max_len`` per slot whatever the sequence's length.

Layout (preallocated once):

    k, v      (num_layers, num_slots, num_kv_heads, max_len, head_dim)   model dtype, or FP8 codes
    k_scale,  (num_layers, num_slots, num_kv_heads, max_len) fp32        FP8 only: one scale per
    v_scale                                                             token per KV head
    lengths   (num_slots,) int64: positions [0, lengths[s]) of slot s hold valid K/V

FP8 cache (``kv_spec`` given, from the recipe's rollout ``kv_cache`` op): K/V are written as
float8_e4m3fn codes + fp32 scales by :func:`jetrl.fp8.kv_quant.quantize_kv` -- the quantizer the
trainer's forward applies to the same K/V -- and read back with :func:`~jetrl.fp8.kv_quant.dequantize_kv`
in the model dtype, so attention sees exactly the trainer's quantize->dequantize values, prefill
included (a prefill attends over the dequantized prompt K/V, not the ones it just computed; on CUDA
:func:`~jetrl.fp8.kv_quant.store_quantized_kv` quantizes, stores and decodes them in one pass). The
codes are written through uint8 views: ``scatter_`` is not implemented for float8 dtypes (torch
2.13 CPU), and a byte copy is exact. Memory per token-head: head_dim + 4 bytes, about
0.52x of BF16 at head_dim 128.

Invariants:
* Positions >= lengths[s] hold stale data and are never attended to.
* Prefill writes positions [0, T) of a slot (T = the padded prompt length of its batch) and
  sets lengths[s] = its prompt length; K/V beyond are padding garbage, masked and overwritten.
* A decode step over the first ``B`` slots feeds each row's pending token at position
  lengths[s], writes its K/V there (each row at its *own* position), and attends to keys
  ``j <= lengths[s]``. The caller advances ``lengths`` afterwards, so a row that must not
  advance (finished, or an empty slot) can be frozen: it then rewrites one unused position.
* ``fork`` copies a prefilled prompt's K/V into other slots, so the ``n`` samples of a group
  share one prefill.

The two views below implement the model's ``KVCache`` protocol (models/llama.py): ``offset``
is read once per forward, ``update(layer, k, v)`` stores this call's K/V (post-RoPE, as the
model's single KV hook produces them) and returns the K/V to attend over. A decode view
returns the whole fixed-length row, ``(B, Hkv, max_len, D)``, so its ``offset`` is
``max_len - 1`` (``offset + T`` keys) and the per-row validity comes from :meth:`decode_mask`.

Fused decode (GPU): with ``use_decode_kernel`` set (the engine sets it on CUDA when Triton is
available) a decode view also exposes ``attend(layer, q, k, v[, quantized])``: it stores k/v as ``update``
does and returns ``jetrl.engine.decode_attention.decode_attention`` over the cache rows, which
reads FP8 codes and scales directly instead of materializing a dequantized cache, and the step's
K/V are written (and quantized) by one fused kernel (``kernels/kv_store_triton.py``, spec
:meth:`DecodeView.store_reference`). No host sync, so a decode step stays CUDA-graph capturable.
The CPU path never uses them: it dequantizes and runs the model's own attention, the reference the
kernel is tested against. In exact mode (jetrl/exact.py) ``attend`` is exact mode's attention kernel instead, the
trainer's own (``exact_cache_attention``): it too reads each row's keys ``0..lengths[s]`` only, FP8 codes and scales
directly, with the bits of the model's attention over the dequantized cache and :meth:`decode_mask`. With the flag
set a prefill's store into a model-dtype cache is one Triton pass too (``store_prefill_triton``: PyTorch's indexed
store of a transposed K/V runs at ~0.8 TB/s).
"""

from __future__ import annotations

import torch
from torch import Tensor

from jetrl.exact import exact_active
from jetrl.fp8.kv_quant import dequantize_kv, kv_names, quantize_kv, store_quantized_kv
from jetrl.fp8.quant import E4M3
from jetrl.fp8.recipe import KVCacheSpec
from jetrl.models.config import ModelConfig


class StaticKVCache:
    """Preallocated K/V for ``num_slots`` sequences of up to ``max_len`` tokens each.

    ``kv_spec`` None: K/V in ``dtype``. A :class:`~jetrl.fp8.recipe.KVCacheSpec`: FP8 codes and
    per-token-head scales (module docstring), dequantized to ``dtype`` on read.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_spec: KVCacheSpec | None = None,
    ) -> None:
        if min(num_layers, num_slots, num_kv_heads, max_len, head_dim) < 1:
            raise ValueError(
                f"StaticKVCache needs positive sizes, got layers={num_layers} slots={num_slots} "
                f"kv_heads={num_kv_heads} max_len={max_len} head_dim={head_dim}"
            )
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        store = E4M3 if kv_spec is not None else dtype
        self.k = torch.zeros(shape, dtype=store, device=device)
        self.v = torch.zeros(shape, dtype=store, device=device)
        self.k_scale = self.v_scale = None
        if kv_spec is not None:
            self.k_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
            self.v_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
        self.lengths = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.positions = torch.arange(max_len, device=device)  # (max_len,), for masks
        self.num_slots, self.max_len, self.dtype, self.kv_spec = num_slots, max_len, dtype, kv_spec
        self.use_decode_kernel = False  # decode views expose ``attend`` (module docstring); set by the engine

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_spec: KVCacheSpec | None = None,
    ) -> StaticKVCache:
        return cls(
            config.num_hidden_layers, num_slots, config.num_key_value_heads, max_len, config.head_dim, dtype, device,
            kv_spec,
        )

    @property
    def is_fp8(self) -> bool:
        return self.kv_spec is not None

    @property
    def pow2_scales(self) -> bool:
        """An FP8 cache whose scales are powers of two (its spec's rule; ``jet_kv``'s)."""
        return self.is_fp8 and self.kv_spec.pow2_scale

    @property
    def nbytes(self) -> int:
        scales = self.k_scale.nbytes + self.v_scale.nbytes if self.is_fp8 else 0
        return self.k.nbytes + self.v.nbytes + scales

    # ------------------------------------------------------------------ storage format
    def encode(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, ...]:
        """This call's k/v (B, Hkv, T, D) as stored, in the order of :meth:`storage`: (k, v) for a model-dtype
        cache, or (k codes as uint8, v codes as uint8, k scales (B, Hkv, T), v scales) for an FP8 cache."""
        if not self.is_fp8:
            return k, v
        k_name, v_name = kv_names(layer_idx)
        kq = quantize_kv(k, pow2_scale=self.pow2_scales, name=k_name)
        vq = quantize_kv(v, pow2_scale=self.pow2_scales, name=v_name)
        return (kq.codes.view(k.shape).view(torch.uint8), vq.codes.view(v.shape).view(torch.uint8),
                kq.scales.view(k.shape[:-1]), vq.scales.view(v.shape[:-1]))

    def storage(self, layer_idx: int) -> tuple[Tensor, ...]:
        """Layer ``layer_idx``'s writable buffers: (k, v), or (k codes uint8, v codes uint8, k_scale, v_scale)."""
        if not self.is_fp8:
            return self.k[layer_idx], self.v[layer_idx]
        return (self.k[layer_idx].view(torch.uint8), self.v[layer_idx].view(torch.uint8),
                self.k_scale[layer_idx], self.v_scale[layer_idx])

    def read(self, layer_idx: int, num_rows: int) -> tuple[Tensor, Tensor]:
        """K/V of slots [0, num_rows) to attend over, (num_rows, Hkv, max_len, D) in the model dtype."""
        k, v = self.k[layer_idx, :num_rows], self.v[layer_idx, :num_rows]  # views, no copy
        if not self.is_fp8:
            return k, v
        return (dequantize_kv(k, self.k_scale[layer_idx, :num_rows], self.dtype),
                dequantize_kv(v, self.v_scale[layer_idx, :num_rows], self.dtype))

    # ------------------------------------------------------------------ prefill
    def prefill(self, slots: Tensor, lengths: Tensor) -> PrefillView:
        """A KVCache for one right-padded prefill batch: row i goes to slot ``slots[i]``.

        Sets ``lengths[slots] = lengths`` (the real prompt lengths). The forward must run with
        positions 0..T-1 and plain causal attention (no mask): right padding never precedes a
        real token, so real tokens see only real keys.
        """
        self.lengths[slots] = lengths
        return PrefillView(self, slots)

    def fork(self, src: Tensor, dst: Tensor, upto: int) -> None:
        """Copy positions [0, upto) of slots ``src[i]`` into slots ``dst[i]`` (all layers), and their lengths."""
        buffers = [self.k, self.v]
        if self.is_fp8:
            buffers = [self.k.view(torch.uint8), self.v.view(torch.uint8), self.k_scale, self.v_scale]
        for buf in buffers:
            buf[:, dst, :, :upto] = buf[:, src, :, :upto]
        self.lengths[dst] = self.lengths[src]

    # ------------------------------------------------------------------ decode
    def decode(self, num_rows: int) -> DecodeView:
        """A KVCache for one decode step over slots [0, num_rows), one token per row."""
        if not 1 <= num_rows <= self.num_slots:
            raise ValueError(f"decode over {num_rows} rows; the cache has {self.num_slots} slots")
        return DecodeView(self, num_rows)

    def decode_mask(self, num_rows: int) -> Tensor:
        """(num_rows, 1, 1, max_len) bool: row s may attend to keys j <= lengths[s] (its prefix + itself)."""
        return (self.positions[None, :] <= self.lengths[:num_rows, None])[:, None, None, :]

    def decode_positions(self, num_rows: int) -> Tensor:
        """(num_rows, 1) int64 RoPE positions of the pending tokens: lengths[s]."""
        return self.lengths[:num_rows, None]


class PrefillView:
    """KVCache protocol for a prefill: stores K/V at positions [0, T) of the target slots."""

    offset = 0

    def __init__(self, cache: StaticKVCache, slots: Tensor) -> None:
        self.cache, self.slots = cache, slots

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        T = k.shape[2]  # k, v: (B, Hkv, T, D)
        if T > self.cache.max_len:
            raise ValueError(f"prefill of {T} positions exceeds the cache's max_len={self.cache.max_len}")
        cache = self.cache
        if cache.is_fp8:  # one pass per tensor on CUDA: quantize, store codes and scales, return the decode
            k_codes, v_codes, k_scales, v_scales = cache.storage(layer_idx)
            k_name, v_name = kv_names(layer_idx)
            return (store_quantized_kv(k, k_codes, k_scales, self.slots, pow2_scale=cache.pow2_scales, name=k_name),
                    store_quantized_kv(v, v_codes, v_scales, self.slots, pow2_scale=cache.pow2_scales, name=v_name))
        if (cache.use_decode_kernel and k.is_cuda and k.shape[-1] & (k.shape[-1] - 1) == 0
                and k.dtype == v.dtype == cache.k.dtype):  # else the indexed store (it casts)
            from jetrl.engine.kernels.kv_store_triton import store_prefill_triton  # lazy: Triton

            store_prefill_triton(k, cache.k[layer_idx], self.slots)
            store_prefill_triton(v, cache.v[layer_idx], self.slots)
        else:
            for buf, value in zip(cache.storage(layer_idx), (k, v)):
                buf[self.slots, :, :T] = value
        return k, v  # attend within the prompt only (causal), over what the cache holds


class DecodeView:
    """KVCache protocol for one decode step over slots [0, B): row s writes at position lengths[s].

    ``attend`` is the fused decode kernel if the cache's ``use_decode_kernel`` is set (module docstring), exact
    mode's attention kernel in exact mode, and None otherwise.
    """

    def __init__(self, cache: StaticKVCache, num_rows: int) -> None:
        self.cache, self.num_rows = cache, num_rows
        self.offset = cache.max_len - 1  # the forward sees offset + T = max_len keys
        self._index: Tensor | None = None
        self._row_order: Tensor | None = None  # decode attention's program order, longest row first
        self.attend = None
        if exact_active(cache.k.device):  # exact mode (jetrl/exact.py): the trainer's batch-invariant attention
            self.attend = self._attend_exact
        elif cache.use_decode_kernel:
            self.attend = self._attend_fused

    def _store(self, layer_idx: int, k: Tensor, v: Tensor) -> None:
        """Write each row's k/v (B, Hkv, 1, D) at its own position lengths[s]; no host sync."""
        B, _, T, D = k.shape
        if T != 1 or B != self.num_rows:
            raise ValueError(
                f"a decode step takes one token for each of {self.num_rows} rows, got k of shape {tuple(k.shape)}"
            )
        if self.cache.use_decode_kernel and k.is_cuda and D & (D - 1) == 0 and k.stride(-1) == v.stride(-1) == 1:
            self.store_fused(layer_idx, k, v)
        else:
            self.store_reference(layer_idx, k, v)

    def store_fused(self, layer_idx: int, k: Tensor, v: Tensor) -> None:
        """The store as one Triton kernel (kernels/kv_store_triton.py; its spec is :meth:`store_reference`)."""
        from jetrl.engine.kernels.kv_store_triton import store_kv_triton  # lazy: Triton

        cache, B = self.cache, self.num_rows
        buffers = cache.storage(layer_idx)  # (k, v) or (k codes uint8, v codes uint8, k_scale, v_scale)
        scales = (buffers[2][:B], buffers[3][:B]) if cache.is_fp8 else (None, None)
        store_kv_triton(k, v, cache.lengths[:B], buffers[0][:B], buffers[1][:B], *scales, cache.pow2_scales)

    def store_reference(self, layer_idx: int, k: Tensor, v: Tensor) -> None:
        """The store in PyTorch ops (the spec of the fused kernel): ``encode``, then one ``scatter_`` per buffer."""
        B, H, _, D = k.shape
        if self._index is None:  # same for every layer: (B, Hkv, 1, D) copies of lengths[s]
            self._index = self.cache.lengths[:B].view(B, 1, 1, 1).expand(B, H, 1, D)
        stored = self.cache.encode(layer_idx, k, v)
        for buf, value in zip(self.cache.storage(layer_idx), stored):
            rows = buf[:B]  # a view: (B, Hkv, max_len, D) data or (B, Hkv, max_len) scales
            index = self._index if value.dim() == 4 else self._index[..., 0]
            rows.scatter_(2, index, value)

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self._store(layer_idx, k, v)
        return self.cache.read(layer_idx, self.num_rows)

    def _attend_fused(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, quantized=None) -> Tensor:
        """Store k/v, then the decode attention kernel over the cache rows: q (B, H, 1, D) -> (B, H, 1, D).
        ``quantized``: the output's FP8 codes for o_proj too (``decode_attention``'s argument)."""
        from jetrl.engine.decode_attention import decode_attention, longest_first  # lazy: Triton, GPU only

        self._store(layer_idx, k, v)
        cache, B = self.cache, self.num_rows
        if self._row_order is None:  # once per step: the lengths are the same for every layer
            self._row_order = longest_first(cache.lengths[:B])
        k_scales = cache.k_scale[layer_idx, :B] if cache.is_fp8 else None
        v_scales = cache.v_scale[layer_idx, :B] if cache.is_fp8 else None
        out = decode_attention(q[:, :, 0], cache.k[layer_idx, :B], cache.v[layer_idx, :B], cache.lengths[:B],
                               k_scales=k_scales, v_scales=v_scales, sm_scale=q.shape[-1] ** -0.5,
                               pow2_scales=cache.pow2_scales, row_order=self._row_order, quantized=quantized)
        return out.unsqueeze(2)

    def _attend_exact(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, quantized=None) -> Tensor:
        """Exact mode: store k/v, then the trainer's batch-invariant attention kernel over the cache rows, reading
        each row's keys 0..lengths[s] only and an FP8 cache's codes and scales directly (the same values and bits
        as the model's attention over :meth:`StaticKVCache.read` and :meth:`StaticKVCache.decode_mask`)."""
        from jetrl.engine.decode_attention import quantize_output
        from jetrl.models.exact_ops import exact_cache_attention  # lazy: Triton, GPU only

        self._store(layer_idx, k, v)
        cache, B = self.cache, self.num_rows
        scales = (cache.k_scale[layer_idx, :B], cache.v_scale[layer_idx, :B]) if cache.is_fp8 else (None, None)
        out = exact_cache_attention(q, cache.k[layer_idx, :B], cache.v[layer_idx, :B], cache.lengths[:B], *scales)
        if quantized is not None:  # o_proj's FP8 input, by the one quantizer (what o_proj would compute itself)
            quantize_output(out[:, :, 0], quantized)
        return out
