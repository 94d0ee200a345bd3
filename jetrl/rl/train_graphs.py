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
old-logprob pass) a forward graph alone. Shapes are (rows, length rounded up to ``length_multiple``, and the
precision phase): the input is padded
on the right with token 0, which changes no real token's hidden state (causal attention; padding only
follows), and the padded positions get no gradient (the loss never gathers them).

    forward   copy x into the graph's input; replay; the output is the graph's static (B, L', H) buffer
    backward  copy dh into the graph's static gradient; replay: dx for the embedding's backward, and every
              layer parameter's gradient *added in place into its .grad* (captured accumulation), so gradient
              accumulation over micro-batches is the eager one, with no extra kernel per parameter

What a replay cannot do, and how this file covers it:
* **Weights.** The graph reads the FP8 weight caches' buffers (codes and scales of W, W^T, the stacked W_s
  and W_s^T), which the host logic refreshes lazily -- and no host logic runs on a replay. Capture records
  every buffer read (:func:`~jetrl.fp8.weight_cache.recorded_weight_reads`); before a replay, if any weight's
  version or any cache changed since the last look (:func:`~jetrl.fp8.weight_cache.cache_epoch`), every one
  is brought up to date for the weights' current version, in place. The BF16 parameters are read where they
  are, as the optimizer writes them in place. If a buffer or a parameter moved to a new address, or the set
  of trained parameters changed, the graphs are dropped and captured again.
* **Gradients.** The graph accumulates into the ``.grad`` tensors that existed at capture. Before each
  replay a parameter whose ``.grad`` is None (``zero_grad(set_to_none=True)``) gets that tensor back,
  zeroed; one whose ``.grad`` was replaced has it folded in. So the trainer's own zeroing, clipping and
  optimizer work unchanged. Those gradient tensors stay allocated between steps (a parameter's worth of
  memory), as does the graphs' memory pool (one micro-batch's activations, shared by every shape).
* **One micro-batch at a time.** Every shape shares one memory pool, so a replay overwrites what an
  earlier forward left for its backward: the hidden states of a call are valid until the next call, and a
  backward after a later forward raises instead of reading overwritten activations.

Numerics: a replay runs exactly the kernels an eager call at the padded shape runs, so results are
bit-identical to the eager model at that shape (tests/test_train_graphs.py). (The trainer's ``auto`` still runs
eagerly in exact mode, jetrl/exact.py: its zero rollout-vs-trainer mismatch with the graphs has not been measured on
a GPU yet.) Against the eager model at the
unpadded length, the FP8 wgrad's 1x128 groups along tokens take in the padding rows' activations, as they
already take in the padding of a micro-batch's shorter sequences.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from jetrl.engine.cuda_graph import capturing
from jetrl.fp8.linear import clear_shared_input
from jetrl.fp8.recipe import current_phase
from jetrl.fp8.weight_cache import cache_epoch, recorded_weight_reads

DEFAULT_LENGTH_MULTIPLE = 128
AUTO_MAX_PARAMETERS = 3.5e9  # auto_enabled


class TrainingGraphs:
    """``hidden_states(input_ids)`` of a :class:`~jetrl.models.llama.CausalLM` for training micro-batches, with
    its decoder layers replayed from CUDA graphs (module docstring): forward and backward under autograd, the
    forward alone without it (an old-logprob pass)."""

    def __init__(self, model: nn.Module, length_multiple: int = DEFAULT_LENGTH_MULTIPLE, num_warmup: int = 2) -> None:
        problem = unsupported_reason(model)
        if problem:
            raise ValueError(f"CUDA graphs for training: {problem}")
        if not isinstance(length_multiple, int) or length_multiple < 1:
            raise ValueError(f"length_multiple={length_multiple!r} must be an int >= 1")
        self.model, self.decoder = model, model.model
        self.length_multiple, self.num_warmup = length_multiple, num_warmup
        self._graphs: dict[tuple[int, int, bool, str], _Graph] = {}
        self._pool = None
        self._reads: dict = {}  # every FP8 weight buffer the graphs read (recorded_weight_reads)
        self._grads: list[tuple[nn.Parameter, Tensor]] = []  # (parameter, the .grad tensor the graphs add into)
        self._watched = [p for module in (self.decoder.layers, self.decoder.norm) for p in module.parameters()]
        self._checked: tuple | None = None  # _weights_state() when the buffers were last brought up to date
        self._addresses: tuple | None = None  # the parameters' addresses at the last capture
        self.generation = 0  # forward replays so far: a backward must belong to the latest
        # an input of every replay that requires grad, so the layers train even when x does not (a frozen embedding)
        self._anchor = torch.zeros((), device=next(model.parameters()).device, requires_grad=True)
        self.num_captures = 0
        self.num_replays = 0

    def padded_length(self, length: int) -> int:
        return -(-length // self.length_multiple) * self.length_multiple

    def hidden_states(self, input_ids: Tensor) -> Tensor:
        """Final normed hidden states (B, L, H) of right-padded ``input_ids`` (B, L), as ``model.hidden_states``:
        valid until the next call (they live in the graph's static buffer)."""
        rows, length = input_ids.shape
        padded = self.padded_length(length)
        if padded != length:
            input_ids = nn.functional.pad(input_ids, (0, padded - length))
        x = self.decoder.embed_tokens(input_ids)
        self._prepare()
        train = torch.is_grad_enabled()
        graph = self._graphs.get((rows, padded, train, current_phase())) or self._capture(x, train)
        if train:
            return _Replay.apply(x, self._anchor, graph, self)[:, :length]
        graph.x.copy_(x)
        self._replay_forward(graph)
        return graph.out[:, :length]

    def _replay_forward(self, graph: _Graph) -> None:
        graph.fwd.replay()
        self.generation += 1
        self.num_replays += 1

    # ------------------------------------------------------------------ before a replay
    def _prepare(self) -> None:
        """Bring every weight buffer the graphs read up to date, in place, and hand the graphs' gradient tensors
        back to their parameters (module docstring); drop the graphs if a buffer or the trained set moved."""
        if not self._graphs:
            return
        state = self._weights_state()
        if state != self._checked:  # a weight or a cache changed since the last check: bring every buffer up to date
            with torch.no_grad():
                moved = any(_moved(reread(), held) for _, reread, held in self._reads.values())
            trained = _trained(self.decoder)
            if moved or self._addresses != _addresses(self._watched) or (self._grads and (
                    len(trained) != len(self._grads) or any(p is not q for p, (q, _) in zip(trained, self._grads)))):
                self.reset()
                return
            self._checked = self._weights_state()  # after the rereads, which re-quantize what was stale
        zero = []
        for p, buf in self._grads:
            if p.grad is buf:
                continue
            if p.grad is None:
                zero.append(buf)
            else:  # replaced by someone: keep what it holds
                buf.copy_(p.grad)
            p.grad = buf
        if zero:
            torch._foreach_zero_(zero)

    def _weights_state(self) -> tuple:
        """Every decoder parameter's version and address and the weight caches' epoch: while it holds, no buffer the
        graphs read can have gone stale, and the rereads (~10 µs each, a dozen per layer) are skipped."""
        return cache_epoch(), tuple((p._version, p.data_ptr(), p.requires_grad) for p in self._watched)

    def reset(self) -> None:
        """Drop every graph (the next call captures again); the parameters keep their gradients."""
        if self._graphs:
            torch.cuda.synchronize()  # no replay may still be in flight when its graph is freed
        self._graphs.clear()
        self._reads, self._grads, self._pool, self._checked = {}, [], None, None

    # ------------------------------------------------------------------ capture
    def _capture(self, x: Tensor, train: bool) -> _Graph:
        """Capture the layers' forward (and, with ``train``, their backward) at ``x``'s shape."""
        rows, length, _ = x.shape
        params = _trained(self.decoder)
        if train and not self._grads:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._grads = [(p, p.grad) for p in params]
        static_x = x.detach().clone().requires_grad_(train)
        positions = torch.arange(length, device=x.device).expand(rows, length)
        cos, sin = self.decoder.rotary_emb(positions, x.dtype)
        grad_out = torch.randn_like(static_x) * 1e-3 if train else None  # warm-up gradient (random, never zeros)

        def body() -> Tensor:
            return self.decoder.run_layers(static_x, cos, sin)

        # warm up on a side stream (Triton compilation and autotuning, cuBLAS handles, every lazy cache filled,
        # W^T included), as CUDA graph capture requires; autograd.grad leaves every .grad untouched
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.num_warmup):  # no warm-up graph may stay alive into the capture (its autograd
                if train:                     # nodes would carry the side stream into it)
                    torch.autograd.grad(body(), [static_x], grad_out)
                else:
                    body()
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        fwd, bwd = torch.cuda.CUDAGraph(), (torch.cuda.CUDAGraph() if train else None)
        clear_shared_input()
        with recorded_weight_reads() as reads:
            with capturing(fwd, self._pool):
                out = body()
            if train:
                with capturing(bwd, self._pool):
                    torch.autograd.backward(out, grad_out, inputs=[static_x, *params])
        clear_shared_input()  # hold nothing the capture quantized
        self._reads.update(reads)
        self._addresses = _addresses(self._watched)  # the graphs read the BF16 parameters where they are now
        self._checked = None  # check on the next call (a capture's reads may have filled a lazy cache)
        graph = _Graph(fwd, bwd, static_x, out.detach(), grad_out, static_x.grad, keep=(cos, sin))
        static_x.grad = None  # the graph keeps writing into it; nothing may accumulate there
        self._graphs[(rows, length, train, current_phase())] = graph
        self.num_captures += 1
        return graph


class _Graph:
    """One shape's captured forward and backward with their static tensors. ``keep``: every other tensor made outside
    the capture that the graphs read (RoPE's cos/sin): held here, or its memory would be reused while the graphs
    still read it."""

    def __init__(self, fwd, bwd, x: Tensor, out: Tensor, grad_out: Tensor | None, grad_x: Tensor | None,
                 keep: tuple) -> None:
        self.fwd, self.bwd, self.x, self.out, self.grad_out, self.grad_x = fwd, bwd, x, out, grad_out, grad_x
        self.keep = keep


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, anchor: Tensor, graph: _Graph, owner: TrainingGraphs) -> Tensor:
        with torch.no_grad():
            graph.x.copy_(x)
        owner._replay_forward(graph)
        ctx.graph, ctx.owner, ctx.generation = graph, owner, owner.generation
        return graph.out.detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        if ctx.generation != ctx.owner.generation:
            raise RuntimeError("CUDA-graphed training: this backward belongs to a forward whose activations a later "
                               "forward has overwritten; run each micro-batch's backward before the next forward "
                               "(or set grpo.train_cuda_graphs='off')")
        ctx.graph.grad_out.copy_(grad)
        ctx.graph.bwd.replay()
        return (ctx.graph.grad_x if ctx.needs_input_grad[0] else None), None, None, None


def _moved(now, held) -> bool:
    return now.codes.data_ptr() != held.codes.data_ptr() or now.scales.data_ptr() != held.scales.data_ptr()


def _addresses(params: list[nn.Parameter]) -> tuple:
    return tuple(p.data_ptr() for p in params)


def _trained(decoder: nn.Module) -> list[nn.Parameter]:
    """The graphed part's parameters that train: every decoder layer's and the final norm's."""
    return [p for module in (decoder.layers, decoder.norm) for p in module.parameters() if p.requires_grad]


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
    return None
