"""A static per-slot KV cache: fixed shapes, one row ("slot") per running sequence.

Why static: every decode step then has the same tensor shapes and addresses for a given
batch size, so it can be captured once in a CUDA graph and replayed (engine/cuda_graph.py).
Why per-slot rather than paged: it is the smallest correct design in pure PyTorch (SDPA
reads a dense cache at the bytes floor, design.md §5); the cost is memory reserved for
``max_len`` per slot whatever the sequence's length.

Layout (model dtype, preallocated once):

    k, v      (num_layers, num_slots, num_kv_heads, max_len, head_dim)
    lengths   (num_slots,) int64: positions [0, lengths[s]) of slot s hold valid K/V

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
"""

from __future__ import annotations

import torch
from torch import Tensor

from jetrl.models.config import ModelConfig


class StaticKVCache:
    """Preallocated K/V for ``num_slots`` sequences of up to ``max_len`` tokens each."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if min(num_layers, num_slots, num_kv_heads, max_len, head_dim) < 1:
            raise ValueError(
                f"StaticKVCache needs positive sizes, got layers={num_layers} slots={num_slots} "
                f"kv_heads={num_kv_heads} max_len={max_len} head_dim={head_dim}"
            )
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.positions = torch.arange(max_len, device=device)  # (max_len,), for masks
        self.num_slots, self.max_len = num_slots, max_len

    @classmethod
    def for_model(
        cls, config: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str
    ) -> StaticKVCache:
        return cls(
            config.num_hidden_layers, num_slots, config.num_key_value_heads, max_len, config.head_dim, dtype, device
        )

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

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
        self.k[:, dst, :, :upto] = self.k[:, src, :, :upto]
        self.v[:, dst, :, :upto] = self.v[:, src, :, :upto]
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
        self.cache.k[layer_idx][self.slots, :, :T] = k
        self.cache.v[layer_idx][self.slots, :, :T] = v
        return k, v  # attend within the prompt only (causal)


class DecodeView:
    """KVCache protocol for one decode step over slots [0, B): row s writes at position lengths[s]."""

    def __init__(self, cache: StaticKVCache, num_rows: int) -> None:
        self.cache, self.num_rows = cache, num_rows
        self.offset = cache.max_len - 1  # the forward sees offset + T = max_len keys
        self._index: Tensor | None = None

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        B, H, T, D = k.shape  # (B, Hkv, 1, D)
        if T != 1 or B != self.num_rows:
            raise ValueError(
                f"a decode step takes one token for each of {self.num_rows} rows, got k of shape {tuple(k.shape)}"
            )
        if self._index is None:  # same for every layer: (B, Hkv, 1, D) copies of lengths[s]
            self._index = self.cache.lengths[:B].view(B, 1, 1, 1).expand(B, H, 1, D)
        k_rows, v_rows = self.cache.k[layer_idx, :B], self.cache.v[layer_idx, :B]  # views, no copy
        k_rows.scatter_(2, self._index, k)
        v_rows.scatter_(2, self._index, v)
        return k_rows, v_rows
