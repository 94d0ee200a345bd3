"""Where the rollout and the trainer part ways: the two forward graphs compared layer by layer on the same tokens.

Why: the mismatch metrics (:mod:`jetrl.rl.metrics`) say how far the rollout's logprobs are from the trainer's. When
they are not at rounding level -- a new recipe, a new kernel, another GPU -- the next question is where the two
forwards first differ. Jet-RL's claim is structural: the rollout's quantized graph is a subgraph of the training
forward, so under ``jet`` and ``jet_kv`` the two agree site by site up to kernel rounding, while under an off-policy
recipe (``fp8_rollout``, ``fp8kv_rollout``) the first divergent site is the op that only the rollout quantizes.

Method (teacher forcing). The given completions are scored twice:

    trainer  one causal forward over prompt + completion in the train precision phase, without autograd: the GRPO
             trainer's old-logprob pass (:func:`jetrl.rl.logprobs.batch_trainer_logprobs`);
    rollout  :func:`jetrl.engine.scoring.score` (``Engine.score``): one prefill of the prompts, then one decode
             step per completion token, in the rollout phase, with the engine's KV cache (FP8 codes under
             ``jet_kv``) and decode kernels, as ``generate`` runs them (eagerly, so that the hooks fire: a CUDA-graph replay equals the
             eager step bit for bit).

Forward hooks read five sites of every layer, in forward order: ``attn_core`` (the attention's output, o_proj's
input), ``attn`` (o_proj's output), ``mlp_act`` (SwiGLU's output, down_proj's input), ``mlp`` (down_proj's output)
and ``residual`` (the stream after the layer, ``h + mlp_out`` rounded as the next norm adds them), at every position
the rollout computes: the prompt's (its prefill) and the completion's but the last (its decode steps). A gap that
appears at ``attn_core`` comes from the attention (its kernel, or K/V only the rollout quantizes); one that appears
at ``attn`` with ``attn_core`` equal comes from o_proj (its GEMM, or its input's FP8 codes). Per layer and site,
over the positions of each kind,

    rel   = ||a_r - a_t||_2 / ||a_t||_2     (fp64 sums)
    max   = max |a_r - a_t|
    equal = a_r and a_t bit-identical at every position

with a_r the rollout's value and a_t the trainer's. ``first_divergence`` is the first (layer, site, kind) in forward
order that is not bit-identical; the logprobs of both get the mismatch metrics under the anchors' names. The
trainer's activations are held on the CPU in the model dtype until the rollout's arrive (per layer and token, four
sites of the hidden width and mlp_act's, 3x wider: 8.5 GB for 36 layers of Qwen3-8B at 4096 tokens in BF16), so this
is a tool for a handful of sequences.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from jetrl.rl.logprobs import batch_trainer_logprobs
from jetrl.rl.metrics import mismatch_metrics

if TYPE_CHECKING:
    from jetrl.engine import Engine

SITES = ("attn_core", "attn", "mlp_act", "mlp", "residual")  # in forward order (module docstring)
KINDS = ("prompt", "completion")  # positions computed by the rollout's prefill / its decode steps


@dataclass
class SiteGap:
    """The rollout-vs-trainer gap at one site over the positions of one kind (module docstring)."""

    rel: float
    max_abs: float
    equal: bool
    positions: int

    def as_cell(self) -> str:
        if not self.positions:
            return "-"
        return "equal" if self.equal else f"{self.rel:.1e} (max {self.max_abs:.1e})"


class _Gap:
    """Running sums of one (layer, site, kind)."""

    def __init__(self) -> None:
        self.diff2 = self.ref2 = self.max_abs = 0.0
        self.equal, self.positions = True, 0

    def add(self, rollout: Tensor, trainer: Tensor) -> None:
        if not len(rollout):
            return
        d = rollout.double() - trainer.double()
        self.diff2 += float(d.pow(2).sum())
        self.ref2 += float(trainer.double().pow(2).sum())
        self.max_abs = max(self.max_abs, float(d.abs().max()))
        self.equal = self.equal and torch.equal(rollout, trainer)
        self.positions += len(rollout)

    def result(self) -> SiteGap:
        rel = (self.diff2 ** 0.5 / self.ref2 ** 0.5) if self.ref2 > 0 else float(self.diff2 > 0)
        return SiteGap(rel=rel, max_abs=self.max_abs, equal=self.equal, positions=self.positions)


def _layers(model: nn.Module) -> list[nn.Module]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"diagnose needs a jetrl.models.CausalLM (model.model.layers), got {type(model).__name__}")
    return list(layers)


@contextlib.contextmanager
def _recording(model: nn.Module) -> Iterator[list[tuple[int, str, Tensor]]]:
    """Forward hooks that append ``(layer, site, (rows, T, width) tensor on the CPU)`` per forward."""
    pending: list[tuple[int, str, Tensor]] = []

    def keep(i: int, site: str, value: Tensor) -> None:
        pending.append((i, site, value.detach().to("cpu", copy=True)))

    def output_hook(i: int, site: str) -> Callable:
        def record(module: nn.Module, args: tuple, output) -> None:
            keep(i, site, output[0] + output[1] if site == "residual" else output)  # a layer returns (h, mlp_out)
        return record

    def input_hook(i: int, site: str) -> Callable:
        def record(module: nn.Module, args: tuple) -> None:
            keep(i, site, args[0])
        return record

    handles = []
    try:
        for i, layer in enumerate(_layers(model)):
            handles += [layer.self_attn.o_proj.register_forward_pre_hook(input_hook(i, "attn_core")),
                        layer.self_attn.register_forward_hook(output_hook(i, "attn")),
                        layer.mlp.down_proj.register_forward_pre_hook(input_hook(i, "mlp_act")),
                        layer.mlp.register_forward_hook(output_hook(i, "mlp")),
                        layer.register_forward_hook(output_hook(i, "residual"))]
        yield pending
    finally:
        for h in handles:
            h.remove()


def diagnose(engine: Engine, prompts: list[list[int]], completions: list[list[int]], temperature: float = 1.0) -> dict:
    """The per-layer rollout-vs-trainer comparison of ``completions`` after ``prompts`` on ``engine.model`` (module
    docstring). Returns a JSON-ready dict: ``layers`` (per layer, per kind, per site: rel, max_abs, equal,
    positions), ``first_divergence`` (None, or its layer, site and kind), ``mismatch`` (the anchors' metrics of the
    rollout's logprobs against the trainer's), and the sizes."""
    model = engine.model
    num_layers = len(_layers(model))
    prompts = [list(map(int, p)) for p in prompts]
    completions = [list(map(int, c)) for c in completions]
    # the trainer's activations (batch_trainer_logprobs refuses mismatched or empty pairs first), per (layer, site): one (positions, hidden) tensor per pair
    with _recording(model) as pending, torch.no_grad():
        trainer_lp = batch_trainer_logprobs(model, prompts, completions, temperature)
    trainer: dict[tuple[int, str], list[Tensor]] = {}
    for i, site, value in pending:  # one forward: rows = pairs, columns = positions from 0
        trainer[(i, site)] = [value[b, : len(p) + len(c)] for b, (p, c) in enumerate(zip(prompts, completions))]
    gaps = {(i, site, kind): _Gap() for i in range(num_layers) for site in SITES for kind in KINDS}

    def compare(rows: Tensor, positions: Tensor) -> None:
        for i, site, value in pending:
            for r, (b, pos) in enumerate(zip(rows.tolist(), positions)):
                keep = pos >= 0
                cols, where = keep.nonzero()[:, 0], pos[keep]
                if not len(cols):
                    continue
                prompt = where < len(prompts[b])
                for kind, sel in (("prompt", prompt), ("completion", ~prompt)):
                    gaps[(i, site, kind)].add(value[r, cols[sel]], trainer[(i, site)][b][where[sel]])
        pending.clear()

    with _recording(model) as pending:
        rollout_lp = engine.score(prompts, completions, temperature, after_forward=compare)
    width = max(len(c) for c in completions)
    lp = torch.zeros(2, len(completions), width)
    mask = torch.zeros(len(completions), width)
    for b, (t, r) in enumerate(zip(trainer_lp, rollout_lp)):
        lp[0, b, : len(t)], lp[1, b, : len(r)], mask[b, : len(t)] = t.cpu(), r, 1.0
    layers = [{kind: {site: gaps[(i, site, kind)].result() for site in SITES} for kind in KINDS}
              for i in range(num_layers)]
    first = next(({"layer": i, "site": site, "kind": kind} for i in range(num_layers) for site in SITES
                  for kind in KINDS if not layers[i][kind][site].equal), None)
    return {
        "layers": [{"layer": i, **{kind: {site: asdict(g) for site, g in row[kind].items()} for kind in KINDS}}
                   for i, row in enumerate(layers)],
        "first_divergence": first,
        "mismatch": mismatch_metrics(lp[0], lp[1], mask),
        "logprob_max_abs_diff": float(((lp[0] - lp[1]).abs() * mask).max()),
        "num_pairs": len(prompts),
        "num_completion_tokens": int(mask.sum()),
    }


def format_report(report: dict) -> str:
    """The per-layer tables of :func:`diagnose`'s result, prompt positions then completion positions: one line per
    layer, the rel gap (max) or 'equal' per site."""
    width = len("1.0e-02 (max 1.0e-02)")
    lines = [("rel = ||rollout - trainer|| / ||trainer|| over the positions (max: largest |difference|); "
              "equal: bit-identical")]
    for kind in KINDS:
        head = f"{kind:<10} | " + " | ".join(f"{site:<{width}}" for site in SITES)
        lines += [head, "-" * len(head)]
        for row in report["layers"]:
            cells = [SiteGap(**row[kind][site]).as_cell() for site in SITES]
            lines.append(f"{'layer ' + str(row['layer']):<10} | " + " | ".join(f"{c:<{width}}" for c in cells))
    first = report["first_divergence"]
    lines.append("first divergence: " + ("none (every site bit-identical)" if first is None else
                                         f"layer {first['layer']}, {first['site']}, {first['kind']} positions"))
    lines.append(f"logprobs: max |rollout - trainer| {report['logprob_max_abs_diff']:.3g}; "
                 + ", ".join(f"{k} {v:.3g}" for k, v in report["mismatch"].items()))
    return "\n".join(lines)
