"""The FP8 weight buffers the training CUDA graphs read, and their refresh after an optimizer step
(jetrl/fp8/weight_cache.py ``recorded_weight_reads``, jetrl/fp8/refresh_graph.py).

On the CPU: a training pass logs every buffer it reads and a reread writes the new version into the same buffers;
``settle()`` leaves each cache as its reread would. On the GPU: the refresh replayed from a graph writes the eager
bits, the layers' graphs then skip their rereads, and a NaN weight, a frozen weight or another model's caches are
handled.
"""

import pytest
import torch

from jetrl.fp8 import convert_to_float8, get_recipe
from jetrl.fp8.convert import float8_modules
from jetrl.fp8.refresh_graph import WeightRefresh
from jetrl.models import CausalLM
from jetrl.rl.train_graphs import TrainingGraphs

from .test_train_graphs import CFG, _models, cuda


def test_recorded_weight_reads_and_the_cache_epochs():
    """What a replay relies on, on the CPU: every FP8 weight buffer a training forward+backward reads is logged
    (W by fprop, W^T by dgrad, a group's stacked W and W^T where siblings train as one Function), and a reread
    after an optimizer step writes the new version into the very same buffers; a cache's change moves its epoch
    and no other cache's."""
    from jetrl.fp8.quant import quantize
    from jetrl.fp8.weight_cache import recorded_weight_reads

    torch.manual_seed(0)
    model = convert_to_float8(CausalLM(CFG), get_recipe("jet"))
    group = model.model.layers[0].self_attn.q_proj.projection_group
    group.devices = ("cpu",)  # the stacked Function, CUDA-only by default
    ids = torch.randint(0, CFG.vocab_size, (2, 8))
    with recorded_weight_reads() as reads:
        model.hidden_states(ids).float().sum().backward()
    kinds = {}
    for entry in reads.values():
        kinds.setdefault(type(entry.owner).__name__, 0)
        kinds[type(entry.owner).__name__] += 1
    # every linear's W and W^T (7 per layer), but layer 0's q/k/v read their W^T as the group's W_s^T (and its W_s)
    assert kinds == {"WeightCache": 2 * 7 * CFG.num_hidden_layers - 3, "ProjectionGroup": 2}, kinds
    held = {key: (e.blocks.codes.data_ptr(), e.blocks.scales.data_ptr()) for key, e in reads.items()}
    caches = [m.weight_cache for m in float8_modules(model).values()]
    epochs = [c.epoch for c in caches]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    for key, entry in reads.items():
        now = entry.redo()
        assert (now.codes.data_ptr(), now.scales.data_ptr()) == held[key]  # in place
    assert all(c.epoch > e for c, e in zip(caches, epochs))  # every weight changed: every cache re-quantized
    o_proj = model.model.layers[1].self_attn.o_proj
    fresh = quantize(o_proj.weight.detach(), (128, 128))
    assert torch.equal(o_proj.weight_cache.get(o_proj.weight, get_recipe("jet").train.weight).codes.view(torch.uint8),
                       fresh.codes.view(torch.uint8))
    epochs = [c.epoch for c in caches]
    o_proj.weight_cache.invalidate()
    assert [c.epoch - e for c, e in zip(caches, epochs)] == [c is o_proj.weight_cache for c in caches]


def test_settle_is_the_host_side_of_a_reread():
    """What a refresh graph's replay relies on (jetrl/fp8/refresh_graph.py), on the CPU: once the kernels of every
    logged reread have rewritten the buffers (here called one by one, as a replay runs them), ``settle()`` leaves each
    cache as its reread would -- no later read quantizes or transposes again, and the bits are the eager ones."""
    from jetrl.fp8.quant import quantize, transpose_codes
    from jetrl.fp8.weight_cache import batched_finite_check, recorded_weight_reads

    def build():
        torch.manual_seed(0)
        model = convert_to_float8(CausalLM(CFG), get_recipe("jet"))
        model.model.layers[0].self_attn.q_proj.projection_group.devices = ("cpu",)
        with recorded_weight_reads() as reads:
            model.hidden_states(torch.randint(0, CFG.vocab_size, (2, 8))).float().sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
        return model, reads

    eager, eager_reads = build()
    for entry in eager_reads.values():
        entry.redo()
    model, reads = build()
    counts = {key: e.owner.num_quantizations for key, e in reads.items() if e.kind == "W"}
    with torch.no_grad(), batched_finite_check():
        for entry in reads.values():  # the kernels a replay runs, into the held buffers
            if entry.kind == "W":
                weight, spec = entry.args
                quantize(weight.detach(), spec.block, pow2_scale=spec.pow2_scale, out=entry.blocks)
            elif entry.kind in ("W^T", "W_s^T"):
                source = reads[(id(entry.owner), "W_s" if entry.kind == "W_s^T" else "W")].blocks
                transpose_codes(source.codes, out=entry.blocks.codes)
                entry.blocks.scales.copy_(source.scales.t())
        assert not any(e.owner.is_current(*e.args) for e in reads.values() if e.kind == "W")
        for entry in reads.values():
            entry.settle()
    epochs = [c.epoch for c in (m.weight_cache for m in float8_modules(model).values())]
    for key, entry in reads.items():
        again = entry.redo()  # nothing stale: no kernel, no new buffer
        assert again is entry.blocks, key
        same = eager_reads[(id(_twin(entry.owner, model, eager)), entry.kind)].blocks
        assert torch.equal(again.codes.view(torch.uint8), same.codes.view(torch.uint8)), key
        assert torch.equal(again.scales, same.scales), key
    assert [m.weight_cache.epoch for m in float8_modules(model).values()] == epochs
    assert all(reads[key].owner.num_quantizations == n + 1 for key, n in counts.items())


def _twin(owner, model, other):
    """The object of ``other`` (a copy of ``model``) in ``owner``'s place: a weight cache or a projection group."""
    for (name, module), twin in zip(model.named_modules(), other.modules()):
        if getattr(module, "weight_cache", None) is owner:
            return twin.weight_cache
        if getattr(module, "projection_group", None) is owner:
            return twin.projection_group
    raise AssertionError(f"{owner!r} is not in the model")


@cuda
def test_the_refresh_graph_writes_the_eager_bits_checks_and_steps_aside():
    """WeightRefresh (jetrl/fp8/refresh_graph.py): captured at the first full refresh, replayed at the next, every
    buffer the graphs read -- W, W^T, the stacked W_s^T -- holds the eager quantization's bits, and the graphs skip
    their rereads; a NaN weight raises naming it, and the next refresh captures again; with a frozen weight (not every
    buffer stale) the refresh is eager; a second model's caches changing makes the graphs reread nothing."""
    from jetrl.fp8.quant import NonFiniteError, quantize

    _, model = _models("jet")
    graphs, refresh = TrainingGraphs(model, length_multiple=64, capture_on_use=1), WeightRefresh(model)
    ids = torch.randint(0, CFG.vocab_size, (2, 40), device="cuda")
    graphs.hidden_states(ids).float().sum().backward()
    layers = list(model.model.layers.parameters())

    def refreshed():
        if refresh.refresh():
            graphs.assume_current(refresh.keys)

    def step(scale=1.01):
        with torch.no_grad():
            for p in layers:
                p.mul_(scale)

    def check_bits():  # after a replay's check, which rereads whatever an eager refresh left stale (the W^T)
        padded = torch.nn.functional.pad(ids, (0, 24))
        with torch.no_grad():
            assert torch.equal(graphs.hidden_states(ids), model.hidden_states(padded)[:, :40])
        for entry in graphs._reads.values():
            weights = [m.weight for m in entry.owner.members] if entry.kind.startswith("W_s") else [entry.args[0]]
            spec = entry.args[-1]
            fresh = [quantize(w.detach(), spec.block, pow2_scale=spec.pow2_scale) for w in weights]
            codes, scales = torch.cat([q.codes.view(torch.uint8) for q in fresh]), torch.cat([q.scales for q in fresh])
            if entry.kind.endswith("^T"):
                codes, scales = codes.t(), scales.t()
            assert torch.equal(entry.blocks.codes.view(torch.uint8), codes), entry.kind
            assert torch.equal(entry.blocks.scales, scales), entry.kind

    check_bits()  # also captures the no-grad graph
    for expected in ((1, 0), (1, 1), (1, 2)):
        step()
        refreshed()
        assert (refresh.num_captures, refresh.num_replays) == expected
        checked = graphs._checked
        check_bits()
        assert checked is not None and graphs._checked is checked  # the next replay found nothing to reread
    assert {e.kind for e in graphs._reads.values()} == {"W", "W^T", "W_s", "W_s^T"}  # every kind was checked
    other = convert_to_float8(CausalLM(CFG).to("cuda", torch.bfloat16), get_recipe("jet"))  # a second model
    with torch.no_grad():
        other.hidden_states(ids)  # quantizes its own caches
    for module in float8_modules(other).values():
        module.weight_cache.invalidate()
    checked = graphs._checked
    check_bits()
    assert graphs._checked is checked  # another model's caches changing asks this one's graphs for no reread
    o_proj = model.model.layers[1].self_attn.o_proj
    good = o_proj.weight.detach().clone()
    step()
    with torch.no_grad():
        o_proj.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="layers.1.self_attn.o_proj.weight"):
        refreshed()
    with torch.no_grad():
        o_proj.weight.copy_(good)
    step()
    refreshed()  # the failed check (of a replay) invalidated a cache: captured again
    assert (refresh.num_captures, refresh.num_replays) == (2, 3)
    check_bits()
    o_proj.weight.requires_grad_(False)  # (the trained set changed: the layers' graphs are captured again)
    with torch.no_grad():
        for p in layers:
            if p is not o_proj.weight:
                p.mul_(1.01)
    refreshed()  # one weight did not change: eager
    assert (refresh.num_captures, refresh.num_replays) == (2, 3)
    check_bits()
