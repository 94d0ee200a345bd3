"""The training forward and backward of the decoder layers, replayed from CUDA graphs.

Why: an eager FP8 linear costs the host ~0.7-1.4 ms per forward+backward whatever its size (quantizer
launches, ``F.scaled_mm``, autograd; bench/probe_host_parts.py), so below ~2B parameters the GPU waits on
Python and FP8 training ran *slower* than BF16: 0.59x at Qwen3-0.6B's shapes, 0.93-1.13x at 1.7B's
(docs/benchmarks.md (f)). A CUDA graph replays a whole micro-batch's layers with one launch, forward and
backward each, so the host cost no longer scales with the number of layers.

What is graphed: ``DecoderModel.run_layers`` -- every decoder layer and the final norm -- from the embedded
tokens x (B, L, H) to the normed hidden states. The embedding, the LM head, the logprobs and the loss stay
eager (a handful of ops, and the LM head's (tokens, vocab) logits are sized by the completion, not by L).
Under autograd (the update) a forward graph and a backward graph per micro-batch shape; without it (the
old-logprob pass) a forward graph alone. A shape is (rows rounded up to ``row_multiple``, length rounded up to
``length_multiple``, training or not, the precision phase, exact mode or not): the input is padded on the right
with token 0, which changes no real token's hidden state (causal attention; padding only follows), and below with
rows of token 0, which share nothing with the real rows (attention stays within a row); the padded positions and
rows get no gradient (the loss never gathers them).

    forward   copy x into the graph's input; replay; the output is the graph's static (B, L', H) buffer
    backward  copy dh into the graph's static gradient; replay: dx for the embedding's backward, and every
              layer parameter's gradient *added in place into its .grad* (captured accumulation), so gradient
              accumulation over micro-batches is the eager one, with no extra kernel per parameter

Short micro-batches (``grpo.train_graph_row_multiple``, 1 by default). Under DAPO's dynamic sampling a rank keeps
whole groups of G rows, so the last micro-batch of its rollout batch holds G*k mod ``size`` rows
(``per_device_train_batch_size``): one of ``size / gcd(G, size) - 1`` counts, each a shape of its own at each length
it lands in, and with a recomputed old-logprob pass a second (no-grad) shape. With ``row_multiple = size`` it
replays the full micro-batch's graph at its length instead, and computes its padding rows at every step. Measured
on the H200 at Qwen3-1.7B's shapes, old logprobs recomputed, micro-batches of 16, 4 per optimizer step (runs GS,
GT; bench/probe_graph_rows.py: 6 steps of 24-64 rows, 128 + 64-1024 tokens, then 6 new ones with the graphs held):
with G = 8 (short micro-batches always of 8 rows) padding saved the first steps 4 of 12 captures (1.12-1.15x over
them) and was then 2-6% slower in steady state, computing its padding rows for nothing; with G = 4 (4, 8 or 12
rows) the shapes outgrew the cache and a long run kept capturing (2 captures in 6 steps): padding was 1.01-1.10x in
steady state and 1.20-1.22x over the first steps (14 captures down to 8). It is not on by default because it loses
where the short shapes fit in the cache -- one count, and with the old-logprob pass reused from the rollout
(``jet``'s default: one shape per length, not two; run GV: 0.95-0.97x steady with G = 8, 1.00-1.12x with G = 4) --
and its cost grows as a rank's rollout batch shrinks toward one micro-batch: padding a lone micro-batch of 16 kept
rows to 64 computes 4x the rows.

Capture on second use (``capture_on_use``, 2 by default). A capture costs a shape ``num_warmup`` warm-up passes
and the recording on top of its replay, so a shape used once -- a length or a short micro-batch's row count that a
run meets only now and then -- costs far more graphed than eager. A shape's first use therefore runs eagerly, at the
padded shape (the very numbers a replay gives), and its second use captures it, with one warm-up fewer: the eager
pass already compiled and initialized what a warm-up would. Uses are counted for up to ``MAX_TRACKED_SHAPES``
shapes. ``capture_on_use=1`` (``grpo.train_graph_capture_on_use=1``) captures at the first use. Measured on the
H200 at Qwen3-1.7B's shapes (run GX, the eager pass's first form, whose autograd graph was the caller's: the same
kernels; bench/probe_graph_rows.py with ``USES=1,2``, groups of 4, old logprobs reused, 6 + 6 steps): the first 6
steps 1.14-1.31x (``bf16``) and 1.08-1.10x (``jet``) faster, the next 6 1.00-1.13x and 0.87-0.93x (they capture the
shapes the first ones met once, now met again), all 12 1.08-1.24x and 0.99-1.03x; with padded rows (fewer shapes)
1.00-1.04x and 1.01-1.03x over the 12. So a run's first steps are faster, a run as a whole no slower (within 1%),
and a shape a run meets once costs one eager pass instead of a capture.

What a replay cannot do, and how this file covers it:
* **Weights.** The graph reads the FP8 weight caches' buffers (codes and scales of W, W^T, the stacked W_s
  and W_s^T) and, in a BF16 no-grad pass, the BF16 sibling stacks (jetrl/models/stacked_projections.py), which
  host logic refreshes lazily -- and no host logic runs on a replay. Capture records every FP8 buffer read
  (:func:`~jetrl.fp8.weight_cache.recorded_weight_reads`); before a replay, if any parameter's version, address or
  identity, or any of the decoder's caches (its ``epoch``: a prime, an eager re-quantization, a re-pointing; another
  model's caches do not count), changed since the last look, every one of those buffers and the stacks are brought
  up to date for the weights' current version, in place. (After an optimizer step the trainer's refresh has usually
  done it already, from a CUDA graph of its own, and says so through :meth:`TrainingGraphs.assume_current`: then that
  check and its rereads are skipped; jetrl/fp8/refresh_graph.py.) The other BF16 parameters are read where they are,
  as the optimizer writes them in place. If a buffer or a parameter moved to a new address, a parameter was replaced,
  or the set of trained parameters changed, the graphs are dropped and captured again.
* **Gradients.** The backward graph adds into the ``.grad`` tensors that existed at capture. Just before each
  backward replay, a parameter whose ``.grad`` is None (``zero_grad(set_to_none=True)``) gets that tensor back,
  zeroed, and one whose ``.grad`` was replaced (same shape and dtype) has it copied in. So zeroing, clipping and the
  optimizer work unchanged, in any order. Two differences from eager autograd: those gradient tensors stay
  allocated between steps (a parameter's worth of memory), and a backward through the graph adds into every layer
  parameter's ``.grad`` even under ``torch.autograd.grad`` or ``backward(inputs=...)`` -- the graphs serve the
  trainer's plain ``loss.backward()``.
* **One micro-batch at a time.** Every shape shares one memory pool, so a replay overwrites what an
  earlier forward left for its backward: the hidden states of a call are valid until the next call, and a
  backward after a later forward raises instead of reading overwritten activations.

Memory: the pool holds the activations of the largest micro-batch captured, shared by every shape; each shape
also keeps its static tensors, (rows, L', hidden) each -- input, output, output gradient and input gradient for
training, input and output for a forward-only graph (at Qwen3-1.7B's width, 8 rows of 1152 tokens: 151 MB a
training shape). At most ``max_graphs`` shapes are kept; the least recently used one is dropped beyond that, once
the new one is captured (a failed capture drops nothing), and with it the weight buffers only it read.

Numerics: a replay runs exactly the kernels an eager call at the padded shape runs, so results are
bit-identical to the eager model at that shape (tests/test_train_graphs.py). That holds for exact mode's
batch-invariant kernels too (jetrl/exact.py): the rollout's logprobs still equal the graphed trainer's at every
token (a GPU test). Against the eager model at the unpadded length, the FP8 wgrad's 1x128 groups along tokens take
in the padding positions' activations, as they already take in the padding of a micro-batch's shorter sequences
(padded rows add whole groups of their own where the length multiple is one of 128, as the 'auto' one always is).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor, nn

from jetrl.engine.cuda_graph import capturing, warm_up
from jetrl.exact import exact_active
from jetrl.fp8.convert import float8_modules
from jetrl.fp8.linear import clear_shared_input
from jetrl.fp8.recipe import current_phase
from jetrl.fp8.weight_cache import recorded_weight_reads
from jetrl.fp8.weight_shard import sharded_parameters
from jetrl.models.stacked_projections import refresh_stacked_projections

DEFAULT_LENGTH_MULTIPLE = 128
DEFAULT_MAX_GRAPHS = 16  # captured shapes kept (module docstring: memory)
DEFAULT_CAPTURE_ON_USE = 2  # a shape is captured on its second use; its first runs eagerly (module docstring)
MAX_TRACKED_SHAPES = 1024  # shapes used but not captured whose uses are counted (least recently used dropped)
AUTO_MAX_LENGTHS = 6  # auto_length_multiple: 6 lengths x (training, no-grad) shapes leave 4 of DEFAULT_MAX_GRAPHS
AUTO_MAX_PARAMETERS = 3.5e9  # auto_enabled


def auto_length_multiple(max_length: int) -> int:
    """The length multiple that pads sequences of up to ``max_length`` tokens to at most ``AUTO_MAX_LENGTHS`` lengths
    (a multiple of 128, at least 128). Why: micro-batches grouped by length (jetrl/rl/micro_batches.py) span every
    length from the shortest to the longest, each a shape to capture, once for the update (training) and once for a
    recomputed old-logprob pass (no-grad); past ``max_graphs`` shapes the least recently used is dropped and captured
    again at its next use, and micro-batches cycle through their lengths, so every one would pay a capture. 6
    lengths take 12 of the 16 shapes kept, leaving 4 for short last micro-batches (dynamic sampling: their row count
    can change from step to step, so those may still be captured again; ``row_multiple`` in the module docstring)."""
    return max(DEFAULT_LENGTH_MULTIPLE, _round_up(-(-max_length // AUTO_MAX_LENGTHS), DEFAULT_LENGTH_MULTIPLE))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class TrainingGraphs:
    """``hidden_states(input_ids)`` of a :class:`~jetrl.models.llama.CausalLM` for training micro-batches, with
    its decoder layers replayed from CUDA graphs (module docstring): forward and backward under autograd, the
    forward alone without it (an old-logprob pass)."""

    def __init__(self, model: nn.Module, length_multiple: int = DEFAULT_LENGTH_MULTIPLE, num_warmup: int = 2,
                 max_graphs: int = DEFAULT_MAX_GRAPHS, row_multiple: int = 1,
                 capture_on_use: int = DEFAULT_CAPTURE_ON_USE) -> None:
        problem = unsupported_reason(model)
        if problem:
            raise ValueError(f"CUDA graphs for training: {problem}")
        for name, value in (("length_multiple", length_multiple), ("max_graphs", max_graphs),
                            ("row_multiple", row_multiple), ("capture_on_use", capture_on_use)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        self.model, self.decoder = model, model.model
        self.length_multiple, self.num_warmup, self.max_graphs = length_multiple, num_warmup, max_graphs
        self.row_multiple, self.capture_on_use = row_multiple, capture_on_use
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()  # least recently used first
        self._uses: OrderedDict[tuple, int] = OrderedDict()  # eager uses of shapes not captured, least recent first
        self._pool = None
        self._reads: dict = {}  # every FP8 weight buffer the held graphs read (recorded_weight_reads)
        self._grads: list[tuple[nn.Parameter, Tensor]] = []  # (parameter, the .grad tensor the graphs add into)
        self._captured: tuple | None = None  # (ids, addresses) of the parameters and stacks at the last capture
        self._checked: tuple | None = None  # _weights_state() when the buffers were last brought up to date
        self._caches: list = []  # the decoder's FP8 weight caches at the last capture, whose epochs _checked holds
        self.generation = 0  # forward replays so far: a backward must belong to the latest
        # an input of every replay that requires grad, so the layers train even when x does not (a frozen embedding)
        self._anchor = torch.zeros((), device=next(model.parameters()).device, requires_grad=True)
        self.num_captures = 0
        self.num_replays = 0
        self.num_eager = 0  # calls run eagerly, before their shape's capture_on_use-th use

    def padded_length(self, length: int) -> int:
        return _round_up(length, self.length_multiple)

    def padded_rows(self, rows: int) -> int:
        return _round_up(rows, self.row_multiple)

    def hidden_states(self, input_ids: Tensor) -> Tensor:
        """Final normed hidden states (B, L, H) of right-padded ``input_ids`` (B, L), as ``model.hidden_states``:
        valid until the next call (they live in the graph's static buffer)."""
        rows, length = input_ids.shape
        padded, padded_rows = self.padded_length(length), self.padded_rows(rows)
        if (padded_rows, padded) != (rows, length):
            input_ids = nn.functional.pad(input_ids, (0, padded - length, 0, padded_rows - rows))
        x = self.decoder.embed_tokens(input_ids)
        self._prepare()
        train = torch.is_grad_enabled()
        key = (padded_rows, padded, train, current_phase(), exact_active(x.device))
        graph = self._graphs.get(key)
        if graph is None:
            uses = self._uses.pop(key, 0) + 1
            if uses < self.capture_on_use:  # eager: at the padded shape, the very numbers a replay gives
                self._uses[key] = uses
                if len(self._uses) > MAX_TRACKED_SHAPES:
                    self._uses.popitem(last=False)
                self.num_eager += 1
                out = _Eager.apply(x, self._anchor, self) if train else self._eager(x)
                return out[:rows, :length]
            # earlier eager uses already ran this shape's kernels on the current stream (compilation, lazy caches)
            graph = self._capture(x, key, max(1, self.num_warmup - (uses - 1)))
        self._graphs.move_to_end(key)
        if train:
            return _Replay.apply(x, self._anchor, graph, self)[:rows, :length]
        self._replay_forward(graph, x)
        return graph.out[:rows, :length]

    def _eager(self, x: Tensor) -> Tensor:
        rows, length, _ = x.shape
        cos, sin = self.decoder.rotary_emb(torch.arange(length, device=x.device).expand(rows, length), x.dtype)
        return self.decoder.run_layers(x, cos, sin)

    def _replay_forward(self, graph: _Graph, x: Tensor) -> None:
        with torch.no_grad():
            graph.x.copy_(x)
        graph.fwd.replay()
        self.generation += 1
        self.num_replays += 1

    # ------------------------------------------------------------------ before a replay
    def _prepare(self) -> None:
        """Bring every weight buffer the graphs read up to date, in place, if a weight or a cache changed since the
        last look; drop the graphs if a buffer or parameter moved or the trained set changed (module docstring)."""
        if not self._graphs:
            return
        params = _params(self.decoder)
        if self._weights_state(params) == self._checked:
            return
        with torch.no_grad():
            moved = any(_moved(entry.redo(), entry.blocks) for entry in self._reads.values())
            now = _identity(params, refresh_stacked_projections(self.decoder))
        if moved or now != self._captured or (self._grads and [id(p) for p, _ in self._grads] !=
                                              [id(p) for p in params if p.requires_grad]):
            self.reset()
            return
        self._checked = self._weights_state(params)  # after the rereads, which re-quantized what was stale

    def _weights_state(self, params: list[nn.Parameter]) -> tuple:
        """The decoder's weight caches' epochs and every decoder parameter's identity, version and address: while it
        holds, no buffer the graphs read can have gone stale, and the rereads (~10 µs each, a dozen per layer) are
        skipped. Per cache, not process-wide: a second model's caches changing (a reference model's, an evaluation
        copy's) leaves this one's graphs unchecked."""
        return (tuple(cache.epoch for cache in self._caches),
                tuple((id(p), p._version, p.data_ptr(), p.requires_grad) for p in params))

    def bind_grads(self) -> None:
        """Just before a backward replay: hand each parameter the ``.grad`` tensor the graph adds into (module
        docstring). Also what a data-parallel rank without micro-batches in an optimizer step calls, so that the
        gradient sum it joins with zeros reuses these tensors instead of allocating a second set."""
        changed = [(p, buf) for p, buf in self._grads if p.grad is not buf]
        for p, buf in changed:  # check them all before touching any
            grad = p.grad
            if grad is not None and (grad.shape != buf.shape or grad.dtype != buf.dtype or grad.device != buf.device):
                raise ValueError(f"CUDA-graphed training: a parameter's .grad was replaced by a {grad.dtype} "
                                 f"{tuple(grad.shape)} tensor on {grad.device}; the graph accumulates {buf.dtype} "
                                 f"{tuple(buf.shape)} on {buf.device} (set it to None, or grpo.train_cuda_graphs='off')")
        zero = [buf for p, buf in changed if p.grad is None]
        if zero:
            torch._foreach_zero_(zero)
        for p, buf in changed:
            if p.grad is not None:
                buf.copy_(p.grad)
            p.grad = buf

    def reset(self) -> None:
        """Drop every graph (the next call captures again); the parameters keep their gradients."""
        if self._graphs:
            torch.cuda.synchronize()  # no replay may still be in flight when its graph is freed
        self._graphs.clear()
        self._reads, self._grads, self._pool, self._captured, self._checked = {}, [], None, None, None

    def assume_current(self, keys: frozenset) -> None:
        """The weight buffers named by ``keys`` (``recorded_weight_reads`` keys) were all just brought up to date for
        the weights' current versions, without a read (jetrl/fp8/refresh_graph.py's replay): if they include every
        buffer the graphs read, the next replay skips its check and rereads."""
        if self._graphs and keys.issuperset(self._reads):
            self._checked = self._weights_state(_params(self.decoder))

    # ------------------------------------------------------------------ capture
    def _capture(self, x: Tensor, key: tuple, num_warmup: int) -> _Graph:
        """Capture the layers' forward (and, under autograd, their backward) at ``x``'s shape, after ``num_warmup``
        warm-up passes on a side stream."""
        rows, length, _ = x.shape
        train = torch.is_grad_enabled()
        params = _params(self.decoder)
        trained = [p for p in params if p.requires_grad]
        if train and not self._grads:
            for p in trained:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._grads = [(p, p.grad) for p in trained]
        if train:
            self.bind_grads()  # the backward is captured adding into these
        static_x = x.detach().clone().requires_grad_(train)
        positions = torch.arange(length, device=x.device).expand(rows, length)
        cos, sin = self.decoder.rotary_emb(positions, x.dtype)
        grad_out = torch.randn_like(static_x) * 1e-3 if train else None  # warm-up gradient (random, never zeros)

        def body() -> Tensor:
            return self.decoder.run_layers(static_x, cos, sin)

        def warm() -> None:  # every gradient computed, none accumulated; no autograd graph outlives it (its nodes
            if train:        # would carry the side stream into the capture)
                torch.autograd.grad(body(), [static_x, *trained], grad_out, allow_unused=True)
            else:
                body()

        warm_up(warm, num_warmup)  # also fills the lazy caches the graphs read: W^T, the stacks
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        fwd, bwd = torch.cuda.CUDAGraph(), (torch.cuda.CUDAGraph() if train else None)
        clear_shared_input()
        with recorded_weight_reads() as reads:
            with capturing(fwd, self._pool):
                out = body()
            if train:
                with capturing(bwd, self._pool):
                    torch.autograd.backward(out, grad_out, inputs=[static_x, *trained])
        clear_shared_input()  # hold nothing the capture quantized
        with torch.no_grad():  # what the graphs read the BF16 parameters and stacks from
            self._captured = _identity(params, refresh_stacked_projections(self.decoder))
        self._caches = [m.weight_cache for m in float8_modules(self.decoder).values()]
        self._checked = None  # check on the next call (a capture's reads may have filled a lazy cache)
        graph = _Graph(fwd, bwd, static_x, out.detach(), grad_out, static_x.grad, reads, keep=(cos, sin))
        static_x.grad = None  # the graph keeps writing into it; nothing may accumulate there
        if len(self._graphs) >= self.max_graphs:  # the least recently used shape makes room, once this one is in
            torch.cuda.synchronize()
            self._graphs.popitem(last=False)
        self._graphs[key] = graph
        self._reads = {k: entry for g in self._graphs.values() for k, entry in g.reads.items()}  # first read first
        self.num_captures += 1
        return graph


class _Graph:
    """One shape's captured forward and backward with their static tensors. ``reads``: the FP8 weight buffers they
    read (recorded_weight_reads). ``keep``: every other tensor made outside the capture that the graphs read (RoPE's
    cos/sin): held here, or its memory would be reused while the graphs still read it."""

    def __init__(self, fwd, bwd, x: Tensor, out: Tensor, grad_out: Tensor | None, grad_x: Tensor | None,
                 reads: dict, keep: tuple) -> None:
        self.fwd, self.bwd, self.x, self.out, self.grad_out, self.grad_x = fwd, bwd, x, out, grad_out, grad_x
        self.reads, self.keep = reads, keep


class _Eager(torch.autograd.Function):
    """A shape's eager use under autograd, its layers' autograd graph private to this micro-batch: built inside the
    forward and released by the backward. Were the layers' autograd nodes the caller's, they would outlive the
    backward for as long as the caller holds the loss (a training loop holds it into the next micro-batch's
    forward), and a capture there would find the parameters' gradient accumulators bound to the default stream, on
    which a capturing stream cannot wait (CUDA's cudaErrorStreamCaptureImplicit; run GX)."""

    @staticmethod
    def forward(ctx, x: Tensor, anchor: Tensor, owner: TrainingGraphs) -> Tensor:
        with torch.enable_grad():
            inner_x = x.detach().requires_grad_(ctx.needs_input_grad[0])
            out = owner._eager(inner_x)
        ctx.inner, ctx.owner = (inner_x, out), owner
        return out.detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        if ctx.inner is None:
            raise RuntimeError("CUDA-graphed training: an eager micro-batch's backward ran twice; its activations "
                               "went with the first (retain_graph is not supported here)")
        inner_x, out = ctx.inner
        ctx.inner = None  # the layers' autograd graph goes with this backward
        ctx.owner.bind_grads()  # accumulate into the tensors the graphs add into, if any are held
        if out.requires_grad:  # not when every layer parameter and the input are frozen
            torch.autograd.backward(out, grad)
        return inner_x.grad, None, None


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, anchor: Tensor, graph: _Graph, owner: TrainingGraphs) -> Tensor:
        owner._replay_forward(graph, x)
        ctx.graph, ctx.owner, ctx.generation = graph, owner, owner.generation
        return graph.out.detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        if ctx.generation != ctx.owner.generation:
            raise RuntimeError("CUDA-graphed training: this backward belongs to a forward whose activations a later "
                               "forward has overwritten; run each micro-batch's backward before the next forward "
                               "(or set grpo.train_cuda_graphs='off')")
        ctx.owner.bind_grads()
        ctx.graph.grad_out.copy_(grad)
        ctx.graph.bwd.replay()
        return (ctx.graph.grad_x if ctx.needs_input_grad[0] else None), None, None, None


def _moved(now, held) -> bool:
    return now.codes.data_ptr() != held.codes.data_ptr() or now.scales.data_ptr() != held.scales.data_ptr()


def _identity(params: list[nn.Parameter], stacks: list[Tensor]) -> tuple:
    """Which parameter objects and stacked copies the graphs read, and where."""
    return tuple((id(p), p.data_ptr()) for p in params), tuple(t.data_ptr() for t in stacks)


def _params(decoder: nn.Module) -> list[nn.Parameter]:
    """The graphed part's parameters: every decoder layer's and the final norm's."""
    return [p for module in (decoder.layers, decoder.norm) for p in module.parameters()]


def auto_enabled(model: nn.Module) -> bool:
    """``train_cuda_graphs='auto'``: on for a model of at most ``AUTO_MAX_PARAMETERS`` on CUDA, whatever the recipe.

    Where eager training is host-bound the graphs pay; where the GPU hides the host they do not, and their memory
    pool -- one micro-batch's activations, held between updates -- is better left to the rollout's KV cache (an 8B
    on one H200 needs it: bench (g) peaks at ~135 of 140 GiB). Measured at Qwen3 shapes on an H200, 16 x 1152
    tokens, both recipes graphed against both eager (runs EN, EO; docs/benchmarks.md (f)): the ``jet`` training
    phase 1.9-2.2x faster at 0.6B, 1.13-1.21x at 1.7B, 0.97-1.0x at 4B; ``bf16``'s 1.2-1.5x, ~1.0x, ~1.0x."""
    return unsupported_reason(model) is None and sum(p.numel() for p in model.parameters()) <= AUTO_MAX_PARAMETERS


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model``'s training forward cannot be graphed here, or None."""
    decoder = getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "run_layers"):
        return f"{type(model).__name__} is not a jetrl CausalLM (no model.run_layers)"
    try:
        device = next(model.parameters()).device
    except StopIteration:
        return "the model has no parameters"
    if device.type != "cuda":
        return f"the model is on {device}, and CUDA graphs need a CUDA device"
    if sharded_parameters(model):
        return "its FP8 weights are sharded (grpo.shard_weights): each layer's backward reduce-scatters its gradient"
    return None
