"""The rollout engine: continuous-batching generation on the trainer's own modules.

Why in-process: Jet-RL is on-policy only if rollout samples from the graph the trainer
differentiates. The engine therefore calls the *same* ``nn.Module`` objects as the trainer,
and runs every forward inside ``torch.no_grad(), precision_phase("rollout")``: each
``Float8Linear`` then picks the recipe's rollout precision and reads its quantize-once weight
cache (under ``jet``, the very codes the trainer's forward uses). The engine never copies or
re-quantizes a weight; there is no weight transfer and no second quantizer.

One generation round (a *window*), repeated until every sequence has finished:

    admit   whole groups into free slots (scheduler.py); prefill each prompt ONCE -- one
            right-padded batch forward, lm_head only at the last prompt position -- write
            its K/V into the group's first slot, fork it to the other n-1 slots, and sample
            the n first tokens (one per sample stream).
    decode  ``steps`` times, over slots [0, B) (B = 1 + highest occupied slot):
                logits = model(pending tokens at positions lengths)   # CUDA graph if enabled
                token, logprob = sample(logits)                       # sampling.py
                lengths += active; counts += active; pending = token
                done |= token in stop ids | counts >= max_tokens | lengths + 1 >= max_len
            all on the device, with no host sync: a row that finishes mid-window is frozen
            (``active`` is 0: it keeps rewriting one unused cache position) and its later
            tokens are ignored.
    sync    one device->host copy of the window's tokens and logprobs; the host appends them
            in order, applies the same finish rules plus stop strings (scheduler.py), frees
            the slots of finished sequences and freezes their rows.

``steps`` is ``sync_every`` (8 on CUDA, 1 on CPU), cut to what the running sequences can
still generate, so a short tail does not run wasted steps. Larger windows mean fewer syncs
but admission only at window boundaries and up to ``sync_every - 1`` wasted steps per
finished sequence.

Overlap (``overlap_sync``, default on): the host's part of a sync -- appending a window's tokens,
the stop rules, freeing slots -- costs 1-3 ms per window of 256 rows, during which the GPU would
have nothing queued. While no group waits for a slot, the engine therefore launches window i+1
(its result copies to pinned memory are queued behind it) *before* it syncs window i. The device
state needs nothing from the host (the freeze rules run there), so each sequence gets the same
tokens, up to batch invariance (see the invariants below: a freed slot leaves the batch a window
later). The host's view lags one window: ``steps`` counts the tokens still in flight, and a rollout
whose last rows stop on a stop token may run one window of frozen rows at the end. While groups
wait, every sync comes first (admission needs the freed slots).

Invariants: a sequence's tokens depend only on its prompt, its seed and sample index, and the
logits of its own row (sampling.py); the device freeze rules equal the host's token rules, so
the host never reads a token of a frozen row as output (checked at every sync).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from jetrl.engine.cuda_graph import DecodeGraphs
from jetrl.engine.kv_cache import StaticKVCache
from jetrl.engine.sampling import SamplingParams, prompt_seed, sample, sequence_key
from jetrl.engine.scheduler import IncrementalDetokenizer, Scheduler, Sequence, StopChecker
from jetrl.engine.scoring import score
from jetrl.exact import exact_requested
from jetrl.fp8 import float8_modules, precision_phase
from jetrl.fp8.convert import model_recipe
from jetrl.fp8.kernels import has_triton
from jetrl.models.fused import fused_ops_requested
from jetrl.models.stacked_projections import refresh_stacked_projections


@dataclass
class Completion:
    """One sampled completion: its tokens, their processed logprobs, why it ended, its text."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (stop token or string) | "length" (max_tokens or context full)
    stop_reason: int | str | None = None  # the stop token id or stop string, if any
    text: str | None = None  # with a tokenizer; cut before a stop string


@dataclass
class EngineStats:
    """Counters since construction (tests and benchmarks read them)."""

    num_prefill_forwards: int = 0
    num_prefilled_prompts: int = 0
    num_prefill_tokens: int = 0  # real prompt tokens, not padding
    num_decode_steps: int = 0
    num_syncs: int = 0


@dataclass
class _Round:
    """One admission + decode window, launched: its results on their way to the host (engine._stage)."""

    pending: list  # (sequences, first tokens, logprobs) per prefill, host copies
    running: list  # (sequence, slot) of the window's rows, as at launch
    window: tuple[Tensor, Tensor] | None  # (steps, rows) tokens and logprobs, host copies
    done: Tensor  # the rows' freeze flags after the window, host copy
    ready: Any  # a CUDA event recorded after the copies (None on CPU)


def check_context(prompt_ids: list[list[int]], max_tokens: int, max_len: int, context: int) -> None:
    """Every position a sequence can reach (its prompt, then each generated token but the last fed back; at most
    ``max_len`` cache positions) must be inside the model's context of ``context`` positions
    (``max_position_embeddings``): RoPE would run past it without an error, and the tokens would be garbage."""
    for i, ids in enumerate(prompt_ids):
        positions = len(ids) + min(max_tokens, max_len - len(ids)) - 1
        if positions > context:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; with up to {positions - len(ids) + 1} generated tokens it "
                f"needs {positions} positions, more than the model's context of {context} "
                "(max_position_embeddings): shorten the prompt or generate fewer tokens")


class Engine:
    """Generate completions with ``model`` (a :class:`jetrl.models.CausalLM`, FP8-converted or not).

    tokenizer:        anything with ``encode(str) -> list[int]`` and ``decode(ids, skip_special_tokens=)``;
                      needed for string prompts, stop strings and ``Completion.text``.
    max_slots:        sequences decoded concurrently (rows of the KV cache).
    max_len:          prompt + completion tokens per sequence (the KV cache's length).
    max_prefill_tokens: padded tokens per prefill forward (a longer prompt still runs, alone).
    sync_every:       decode steps between host syncs (default 8 on CUDA, 1 on CPU).
    overlap_sync:     launch the next decode window before syncing the last one (module docstring).
    use_cuda_graphs:  capture the decode forward per batch-size bucket (default on CUDA; ignored on CPU).
    use_decode_kernel: decode attention by the fused kernel (jetrl/engine/decode_attention.py) that
                      reads the cache (FP8 codes + scales) directly; default on CUDA with Triton,
                      never on CPU, where the cache is dequantized and the model's attention runs.

    KV cache format: the model's recipe decides (:func:`jetrl.fp8.convert.model_recipe`): FP8 codes
    + per-token-head scales when its rollout ``kv_cache`` op is FP8 (``jet_kv``, ``fp8kv_rollout``),
    the model dtype otherwise. KV memory: 2 * layers * max_slots * kv_heads * max_len * head_dim *
    bytes(model dtype); for FP8, 1 byte per element plus a 4-byte scale per head_dim elements.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        *,
        max_slots: int = 64,
        max_len: int = 2048,
        max_prefill_tokens: int = 16384,
        sync_every: int | None = None,
        use_cuda_graphs: bool | None = None,
        graph_buckets: list[int] | None = None,
        use_decode_kernel: bool | None = None,
        overlap_sync: bool = True,
    ) -> None:
        for name, value in (("max_slots", max_slots), ("max_len", max_len), ("max_prefill_tokens", max_prefill_tokens)):
            if not isinstance(value, int) or value < 1 or (name == "max_len" and value < 2):
                raise ValueError(f"Engine {name}={value!r} must be a positive int (max_len >= 2)")
        if sync_every is not None and (not isinstance(sync_every, int) or sync_every < 1):
            raise ValueError(f"Engine sync_every={sync_every!r} must be an int >= 1")
        self.model, self.tokenizer = model, tokenizer
        self.config = model.config
        self.max_slots, self.max_len, self.max_prefill_tokens = max_slots, max_len, max_prefill_tokens
        self._sync_every, self._want_graphs = sync_every, use_cuda_graphs is not False
        self._want_decode_kernel = use_decode_kernel
        self.overlap_sync = bool(overlap_sync)
        self.stats = EngineStats()
        self._graph_buckets = graph_buckets
        self._state_key: tuple | None = None
        self._fingerprint: tuple | None = None
        self._held_codes: list = []  # keeps captured FP8 weight codes alive while a graph may read them
        self.graphs: DecodeGraphs | None = None
        self._ensure_state()

    # ------------------------------------------------------------------ persistent device state
    def _ensure_state(self) -> None:
        """(Re)allocate the KV cache and per-slot state if the model's device, dtype or KV format changed."""
        weight = self.model.model.embed_tokens.weight
        recipe = model_recipe(self.model)
        key = (weight.device, weight.dtype, recipe.kv_cache("rollout") if recipe is not None else None)
        if key == self._state_key:
            return
        self.device, dtype, kv_spec = key
        on_cuda = self.device.type == "cuda"
        self.sync_every = self._sync_every or (8 if on_cuda else 1)
        self.use_cuda_graphs = on_cuda and self._want_graphs
        if self._want_decode_kernel and not on_cuda:
            raise ValueError("Engine(use_decode_kernel=True) needs a CUDA model; the CPU path runs the reference")
        self.cache = StaticKVCache.for_model(self.config, self.max_slots, self.max_len, dtype, self.device, kv_spec)
        self.cache.use_decode_kernel = on_cuda and (
            has_triton() if self._want_decode_kernel is None else self._want_decode_kernel
        )
        self.next_tokens = torch.zeros(
            self.max_slots, dtype=torch.int64, device=self.device
        )  # (S,) sampled, not cached
        self.counts = torch.zeros_like(self.next_tokens)  # (S,) tokens generated so far
        self.keys = torch.zeros_like(self.next_tokens)  # (S,) 32-bit noise keys
        self.done = torch.ones(self.max_slots, dtype=torch.bool, device=self.device)  # frozen rows
        self._state_key = key
        if self.use_cuda_graphs:
            if self.graphs is not None:
                self.graphs.reset()
            self.graphs = DecodeGraphs(self._decode_forward, self.max_slots, self._graph_buckets)
            self._fingerprint = None

    def _check_graph_weights(self) -> None:
        """Drop CUDA graphs if a parameter moved, an FP8 weight was re-quantized into new buffers, a BF16
        sibling stack was reallocated, or the fused-ops switch (models/fused.py) or exact mode (jetrl/exact.py)
        changed since capture. Stale FP8 codes and stacks are refreshed here, in place, before any replay reads them."""
        # quantized_weight() reads (and if stale fills) the same cache entry the rollout forward reads
        codes = [m.quantized_weight() for m in float8_modules(self.model).values() if m.recipe.rollout.is_fp8]
        stacks = refresh_stacked_projections(self.model)  # BF16 sibling copies, refreshed in place like FP8 codes
        fingerprint = (tuple(p.data_ptr() for p in self.model.parameters()), tuple(id(q) for q in codes),
                       tuple(w.data_ptr() for w in stacks), fused_ops_requested(), exact_requested())
        if fingerprint != self._fingerprint:
            self.graphs.reset()
            self._fingerprint, self._held_codes = fingerprint, codes

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]] | list[str], params: SamplingParams, seeds: list[int] | None = None
    ) -> list[list[Completion]]:
        """``params.n`` completions for each prompt, in prompt order then sample order.

        ``seeds`` (one per prompt) pins each prompt's sample streams; without it prompt i uses
        ``prompt_seed(params.seed, i)``. The same prompt, seed and sample index give the same
        completion whatever else is in the batch (up to GEMM batch invariance, see tests).
        """
        prompt_ids = self._encode(prompts)
        self._check_context(prompt_ids, params.max_tokens)
        if seeds is not None and len(seeds) != len(prompt_ids):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompt_ids)} prompts; pass one per prompt or None")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {params.stop!r} need a tokenizer; pass Engine(model, tokenizer=...)")
        if params.n > self.max_slots:
            raise ValueError(f"n={params.n} samples per prompt exceed max_slots={self.max_slots}; raise max_slots")
        base = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        scheduler = Scheduler(self.max_slots)
        groups = []
        for i, ids in enumerate(prompt_ids):
            seed = seeds[i] if seeds is not None else prompt_seed(base, i)
            group = [Sequence(ids, i, j, sequence_key(seed, j)) for j in range(params.n)]
            if params.stop:
                for seq in group:
                    seq.detokenizer = IncrementalDetokenizer(self.tokenizer)
            scheduler.add_group(group)
            groups.append(group)
        stop_ids = self._stop_token_ids(params)
        check = StopChecker(params, stop_ids, self.max_len)
        with precision_phase("rollout"):
            self._ensure_state()
            stop_tensor = torch.tensor(sorted(stop_ids), dtype=torch.int64, device=self.device) if stop_ids else None
            if self.use_cuda_graphs:
                self._check_graph_weights()
            self.done.fill_(True)
            in_flight: dict[int, int] = {}  # id(seq) -> its tokens made on the device, not yet on the host
            last: _Round | None = None  # launched, not yet synced
            while scheduler.has_work():
                if last is not None and (scheduler.waiting or not self.overlap_sync):
                    self._sync(scheduler, check, last, in_flight)  # admission needs the slots it frees
                    last = None
                    continue
                admitted = scheduler.admit()
                pending = [self._prefill(chunk, params, stop_tensor) for chunk in self._prefill_chunks(admitted)]
                for seqs, _, _ in pending:
                    for seq in seqs:
                        in_flight[id(seq)] = in_flight.get(id(seq), 0) + 1
                running = [(seq, seq.slot) for seq in scheduler.running_in_slot_order()]
                num_rows = scheduler.num_active_rows
                steps = self._window_steps(running, params, in_flight)
                window = self._decode_window(num_rows, steps, params, stop_tensor)
                if window is not None:
                    for seq, _ in running:
                        in_flight[id(seq)] = in_flight.get(id(seq), 0) + steps
                current = self._stage(pending, running, window, num_rows)
                if last is not None:
                    self._sync(scheduler, check, last, in_flight)  # the GPU runs `current` meanwhile
                last = current
                if window is None and not pending:  # nothing launched: the host catches up
                    self._sync(scheduler, check, last, in_flight)
                    last = None
            if last is not None:
                self._sync(scheduler, check, last, in_flight)
        return [[self._completion(seq) for seq in group] for group in groups]

    def score(self, prompts: list[list[int]], completions: list[list[int]], temperature: float = 1.0,
              after_forward: Callable[[Tensor, Tensor], None] | None = None) -> list[Tensor]:
        """Teacher-forced rollout logprobs of ``completions`` after ``prompts``: :func:`jetrl.engine.scoring.score`."""
        return score(self, prompts, completions, temperature, after_forward)

    # ------------------------------------------------------------------ prefill
    def _prefill_chunks(self, groups: list[list[Sequence]]) -> list[list[list[Sequence]]]:
        return [[groups[i] for i in chunk] for chunk in self._pack([len(g[0].prompt_ids) for g in groups])]

    def _pack(self, lengths: list[int]) -> list[list[int]]:
        """Consecutive indices per prefill forward: at most ``max_prefill_tokens`` padded tokens each (or one)."""
        chunks, current, longest = [], [], 0
        for i, length in enumerate(lengths):
            if current and max(longest, length) * (len(current) + 1) > self.max_prefill_tokens:
                chunks.append(current)
                current, longest = [], 0
            current.append(i)
            longest = max(longest, length)
        return chunks + ([current] if current else [])

    def _prefill(
        self, groups: list[list[Sequence]], params: SamplingParams, stop_tensor: Tensor | None
    ) -> tuple[list[Sequence], Tensor, Tensor]:
        """Prefill each group's prompt once, fork its K/V to the group's slots, sample the first tokens."""
        dev = self.device
        lengths = [len(g[0].prompt_ids) for g in groups]
        logits = self._prefill_logits([g[0].prompt_ids for g in groups], [g[0].slot for g in groups])
        siblings = [(g[0].slot, s.slot) for g in groups for s in g[1:]]
        if siblings:
            src, dst = (torch.tensor(x, device=dev) for x in zip(*siblings))
            self.cache.fork(src, dst, max(lengths))
        seqs = [s for g in groups for s in g]
        rows = torch.tensor([i for i, g in enumerate(groups) for _ in g], device=dev)
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        keys = torch.tensor([s.key for s in seqs], dtype=torch.int64, device=dev)
        tokens, logprobs = sample(logits[rows], params, keys, torch.zeros_like(keys))
        self.keys[slots], self.next_tokens[slots] = keys, tokens
        self.counts[slots] = 1
        self.done[slots] = self._finished(tokens, self.counts[slots], self.cache.lengths[slots], params, stop_tensor)
        self.stats.num_prefill_forwards += 1
        self.stats.num_prefilled_prompts += len(groups)
        self.stats.num_prefill_tokens += sum(lengths)
        return seqs, tokens, logprobs

    def _prefill_logits(self, prompts: list[list[int]], slots: list[int]) -> Tensor:
        """One right-padded prefill forward: each prompt's K/V written into its slot (and the slot's length set),
        and the logits (G, V), in the model dtype, at each prompt's last position (lm_head there only)."""
        dev = self.device
        lengths = [len(p) for p in prompts]
        ids = torch.zeros(len(prompts), max(lengths), dtype=torch.int64)  # right padding, never seen by real tokens
        for row, prompt in enumerate(prompts):
            ids[row, : lengths[row]] = torch.tensor(prompt)
        lengths_t = torch.tensor(lengths, device=dev)
        hidden = self.model.hidden_states(ids.to(dev), kv_cache=self.cache.prefill(torch.tensor(slots, device=dev),
                                                                                   lengths_t))
        return self.model.logits_from_hidden(hidden[torch.arange(len(prompts), device=dev), lengths_t - 1])

    # ------------------------------------------------------------------ decode
    def _decode_forward(self, num_rows: int) -> Tensor:
        """Logits (num_rows, V) for the pending token of slots [0, num_rows), in the model dtype (sample() reads
        them as they are; its PyTorch path upcasts to fp32 itself). Graph-capturable."""
        hidden = self.model.hidden_states(
            self.next_tokens[:num_rows, None],
            attention_mask=self.cache.decode_mask(num_rows),
            position_ids=self.cache.decode_positions(num_rows),
            kv_cache=self.cache.decode(num_rows),
        )
        return self.model.logits_from_hidden(hidden[:, 0])

    def _decode_window(
        self, num_rows: int, steps: int, params: SamplingParams, stop_tensor: Tensor | None
    ) -> tuple[Tensor, Tensor] | None:
        """Run ``steps`` decode steps on the device; return (steps, num_rows) tokens and logprobs."""
        if steps == 0 or num_rows == 0:
            return None
        tokens = torch.empty(steps, num_rows, dtype=torch.int64, device=self.device)
        logprobs = torch.empty(steps, num_rows, dtype=torch.float32, device=self.device)
        for step in range(steps):
            logits = self.graphs(num_rows)[:num_rows] if self.use_cuda_graphs else self._decode_forward(num_rows)
            tok, lp = sample(logits, params, self.keys[:num_rows], self.counts[:num_rows])
            active = ~self.done[:num_rows]
            self.cache.lengths[:num_rows] += active  # the fed token is now cached
            self.counts[:num_rows] += active
            self.next_tokens[:num_rows] = torch.where(active, tok, self.next_tokens[:num_rows])
            self.done[:num_rows] |= self._finished(
                tok, self.counts[:num_rows], self.cache.lengths[:num_rows], params, stop_tensor
            )
            tokens[step], logprobs[step] = tok, lp
            self.stats.num_decode_steps += 1
        return tokens, logprobs

    def _finished(
        self, tokens: Tensor, counts: Tensor, lengths: Tensor, params: SamplingParams, stop_tensor: Tensor | None
    ) -> Tensor:
        """The device's freeze rule: stop token, max_tokens, or no cache position for the next token."""
        done = (counts >= params.max_tokens) | (lengths + 1 >= self.max_len)
        return done if stop_tensor is None else done | torch.isin(tokens, stop_tensor)

    def _window_steps(self, running: list[tuple[Sequence, int]], params: SamplingParams,
                      in_flight: dict[int, int]) -> int:
        """``sync_every``, cut to the most tokens any running sequence may still generate, counting its
        tokens made on the device but not yet synced."""
        most = 0
        for seq, _ in running:
            made = len(seq.output_ids) + in_flight.get(id(seq), 0)
            most = max(most, min(params.max_tokens - made, self.max_len - len(seq.prompt_ids) - made))
        return max(0, min(self.sync_every, most))

    # ------------------------------------------------------------------ host sync
    def _stage(self, pending: list, running: list[tuple[Sequence, int]], window: tuple[Tensor, Tensor] | None,
               num_rows: int) -> _Round:
        """Queue the device->host copies of a round's results behind its work (pinned memory, no host wait):
        the prefills' first tokens, the window's tokens and logprobs, and the rows' freeze flags after it."""
        to_host = self._to_host
        staged = [(seqs, to_host(tokens), to_host(logprobs)) for seqs, tokens, logprobs in pending]
        window = None if window is None else (to_host(window[0]), to_host(window[1]))
        done = to_host(self.done[:num_rows])
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return _Round(staged, running, window, done, ready)

    def _to_host(self, t: Tensor) -> Tensor:
        if t.device.type == "cpu":
            return t.clone()  # a snapshot: the engine's state tensors change in place
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

    def _sync(self, scheduler: Scheduler, check: StopChecker, round_: _Round, in_flight: dict[int, int]) -> None:
        """Wait for a round's copies, append its tokens in order, free finished slots (module docstring)."""
        if round_.ready is not None:
            round_.ready.synchronize()  # this round's copies only, not the work queued after them
        self.stats.num_syncs += 1
        for seqs, tokens, logprobs in round_.pending:
            for seq, tok, lp in zip(seqs, tokens.tolist(), logprobs.tolist()):
                in_flight[id(seq)] -= 1
                scheduler.append(seq, tok, lp, check)
        if round_.window is not None:
            # (rows, steps): each running sequence's tokens of the window in one list, appended at once
            steps = round_.window[0].shape[0]
            tokens, logprobs = round_.window[0].t().tolist(), round_.window[1].t().tolist()
            for seq, slot in round_.running:
                in_flight[id(seq)] -= steps
                if not seq.is_finished:
                    scheduler.extend(seq, tokens[slot], logprobs[slot], check)
        # Invariant: every row the device froze is finished on the host too (same token rules).
        done = round_.done.tolist()
        stray = [seq for seq, slot in round_.running if done[slot] and not seq.is_finished]
        if stray:
            raise RuntimeError(f"engine bug: device froze {len(stray)} sequences the host still runs")
        freed = sorted({slot for seq, slot in round_.running if seq.is_finished})
        if freed:
            index = torch.tensor(freed, dtype=torch.int64)
            if self.device.type == "cuda":  # pinned, non-blocking: no wait for the window in flight
                index = index.pin_memory().to(self.device, non_blocking=True)
            self.done[index] = True

    # ------------------------------------------------------------------ inputs and outputs
    def _encode(self, prompts: list[list[int]] | list[str]) -> list[list[int]]:
        if isinstance(prompts, (str, Tensor)) or not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of token-id lists or of strings")
        out = []
        vocab = self.config.vocab_size
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError(f"prompt {i} is a string but the engine has no tokenizer; pass token ids")
                prompt = self.tokenizer.encode(prompt)
            ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if len(ids) >= self.max_len:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens but max_len={self.max_len} allows at most "
                    f"{self.max_len - 1} prompt tokens (one position is needed per generated token); "
                    "raise Engine(max_len=...) or shorten the prompt"
                )
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"prompt {i} holds token ids outside [0, {vocab}): min {min(ids)}, max {max(ids)}")
            out.append(ids)
        return out

    def _check_context(self, prompt_ids: list[list[int]], max_tokens: int) -> None:
        check_context(prompt_ids, max_tokens, self.max_len, self.config.max_position_embeddings)

    def _stop_token_ids(self, params: SamplingParams) -> set[int]:
        ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            eos = self.config.eos_token_id
            ids.update([eos] if isinstance(eos, int) else (eos or []))
            tok = self.tokenizer
            if tok is not None:
                ids.update(getattr(tok, "stop_token_ids", None) or [])
                if isinstance(getattr(tok, "eos_token_id", None), int):
                    ids.add(tok.eos_token_id)
        return ids

    def _completion(self, seq: Sequence) -> Completion:
        text = None
        if self.tokenizer is not None:
            # a completion that a stop token ended leaves that token out of its text (it stays in its ids), and one
            # that a stop string ended is cut before the string: the text is what precedes the stop, as in vLLM
            stopped_by_token = seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
            text = self.tokenizer.decode(seq.output_ids[:-1] if stopped_by_token else seq.output_ids,
                                         skip_special_tokens=True)
            if isinstance(seq.stop_reason, str) and seq.stop_reason in text:
                text = text[: text.index(seq.stop_reason)]
        return Completion(list(seq.output_ids), list(seq.output_logprobs), seq.finish_reason, seq.stop_reason, text)
