"""Float8Linear: fprop/dgrad/wgrad against fp32 nn.Linear, what is saved, the weight cache, errors.

SQNR thresholds. E4M3 keeps 3 mantissa bits, so one operand's relative rounding error is
uniform in about [-2^-4, 2^-4]: noise power 2^-8/3 of the signal, ~28.9 dB. A GEMM of two
quantized operands adds the two noises: ~25.9 dB in the worst case of uncorrelated terms,
and about 28-29 dB measured (design.md §3 reports relative error 0.037 = 28.6 dB on the H200
for y, dx and dw). We require >= 25 dB for y, dx and dw (torchao's starting threshold): a
wrong scale, layout or block mapping lands far below 10 dB, while real FP8 noise stays above.
"""

import pytest
import torch
import torch.nn as nn

from jetrl.fp8 import (
    Float8Linear,
    NonFiniteError,
    convert_to_float8,
    get_recipe,
    precision_phase,
    quantize,
    record_quantization,
    refresh_weight_caches,
    track_optimizer,
)

from .conftest import sqnr_db

MIN_SQNR_DB = 25.0


def _pair(k, n, bias=True, dtype=torch.float32, recipe="jet", seed=0):
    torch.manual_seed(seed)
    ref = nn.Linear(k, n, bias=bias)
    fp8 = Float8Linear.from_float(nn.Linear(k, n, bias=bias).to(dtype), get_recipe(recipe), name="proj")
    with torch.no_grad():
        fp8.weight.copy_(ref.weight.to(dtype))
        if bias:
            fp8.bias.copy_(ref.bias.to(dtype))
    return ref, fp8


@pytest.mark.parametrize("shape", [(4, 96, 256, 384), (2, 33, 576, 1536), (1, 1, 128, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_both_gradients_vs_fp32_linear(shape, dtype):
    b, t, k, n = shape
    ref, fp8 = _pair(k, n, dtype=dtype)
    x = torch.randn(b, t, k)
    grad = torch.randn(b, t, n)
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    y_ref.backward(grad)
    x_fp8 = x.to(dtype).requires_grad_()
    y = fp8(x_fp8)
    y.backward(grad.to(dtype))
    assert y.dtype == dtype and x_fp8.grad.dtype == dtype and fp8.weight.grad.dtype == dtype
    if b * t >= 32:  # SQNR is a statistic; skip it on a single token
        assert sqnr_db(y, y_ref) >= MIN_SQNR_DB
        assert sqnr_db(x_fp8.grad, x_ref.grad) >= MIN_SQNR_DB
        assert sqnr_db(fp8.weight.grad, ref.weight.grad) >= MIN_SQNR_DB
    assert torch.allclose(fp8.bias.grad.float(), ref.bias.grad, rtol=2e-2, atol=1e-3 * b * t)


def test_input_saved_for_backward_in_fp8_only():
    _, fp8 = _pair(256, 128)
    x = torch.randn(64, 256, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fp8(x)
    float8 = [t for t in saved if t.dtype == torch.float8_e4m3fn]
    assert len(float8) == 1 and float8[0].shape == (256, 64)  # X^T codes, the wgrad layout
    assert not any(t.shape == x.shape and t.dtype == x.dtype for t in saved), "the high-precision input was saved"
    y.sum().backward()


def test_all_three_gemms_quantize_what_the_recipe_says():
    _, fp8 = _pair(256, 128)
    x = torch.randn(130, 256, requires_grad=True)
    with record_quantization() as log:
        fp8(x).sum().backward()
    names = {name: q for name, q in log}
    assert set(names) == {"proj.weight", "proj.input", "proj.input_t", "proj.grad_output", "proj.grad_output_t"}
    assert names["proj.weight"].block == (128, 128)
    assert names["proj.input"].shape == (130, 256) and names["proj.input_t"].shape == (256, 130)
    assert names["proj.grad_output"].shape == (130, 128) and names["proj.grad_output_t"].shape == (128, 130)


def test_training_siblings_share_one_input_quantization_and_one_saved_input():
    """q/k/v-style siblings on one input: one pass over it, one saved X^T, and the very gradients of
    unshared layers (a clone of the input defeats the sharing: the memo keys on the tensor object)."""
    torch.manual_seed(0)
    layers = [_pair(256, n, seed=i)[1] for i, n in enumerate((256, 128, 128))]
    x = torch.randn(2, 70, 256, dtype=torch.float32)
    grads = [torch.randn(2, 70, layer.out_features) for layer in layers]

    def run(share: bool):
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        xs = x.clone().requires_grad_()
        saved = []
        with record_quantization() as log, torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t) or t, lambda t: t):
            ys = [layer(xs if share else xs.clone()) for layer in layers]
        torch.autograd.backward(ys, grads)
        inputs = [name for name, _ in log if name.endswith(".input")]
        codes = {t.data_ptr() for t in saved if t.dtype == torch.float8_e4m3fn}
        return ys, xs.grad, [layer.weight.grad.clone() for layer in layers], inputs, codes

    ys, dx, dws, inputs, codes = run(share=True)
    ys0, dx0, dws0, inputs0, codes0 = run(share=False)
    assert len(inputs) == 1 and len(inputs0) == 3  # one quantization of the shared input
    assert len(codes) == 1 and len(codes0) == 3  # one saved X^T (the same tensor in three contexts)
    assert all(torch.equal(a, b) for a, b in zip(ys, ys0))
    assert torch.equal(dx, dx0) and all(torch.equal(a, b) for a, b in zip(dws, dws0))
    # an in-place change of the input is a new version: the next sibling quantizes afresh
    xs = x.clone().requires_grad_()
    h = xs * 1.0
    with record_quantization() as log:
        layers[0](h)
        with torch.no_grad():
            h.mul_(2.0)
        layers[1](h)
    assert [name for name, _ in log if name.endswith(".input")] == ["proj.input", "proj.input"]


def test_weight_quantized_once_per_version():
    _, fp8 = _pair(256, 256)
    opt = torch.optim.AdamW(fp8.parameters(), lr=1e-3)
    x = torch.randn(16, 256)
    for _ in range(3):
        fp8(x).sum().backward()  # forward + dgrad read the cache
        with torch.no_grad(), precision_phase("rollout"):
            fp8(x)
    assert fp8.weight_cache.num_quantizations == 1
    cached = fp8.quantized_weight()
    before, address = cached.codes.clone(), cached.codes.data_ptr()
    transposed = fp8.weight_cache.get_transposed(fp8.weight, get_recipe("jet").train.weight)
    opt.step()
    after = fp8.quantized_weight().codes
    assert fp8.weight_cache.num_quantizations == 2
    assert not torch.equal(before.view(torch.uint8), after.view(torch.uint8))
    # written in place: a CUDA graph holding the old buffers reads the new version
    assert fp8.quantized_weight() is cached and after.data_ptr() == address
    new_t = fp8.weight_cache.get_transposed(fp8.weight, get_recipe("jet").train.weight)
    assert new_t is transposed and torch.equal(new_t.codes.view(torch.uint8), after.t().contiguous().view(torch.uint8))
    refresh_weight_caches(fp8)  # the version did not change since: no second quantization
    assert fp8.weight_cache.num_quantizations == 2
    assert torch.equal(after.view(torch.uint8), fp8.quantized_weight().codes.view(torch.uint8))


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
                                  lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
                                  lambda ps: torch.optim.SGD(ps, lr=0.5)], ids=["fused", "foreach", "sgd"])
def test_tracked_optimizer_steps_reach_the_cache(make):
    """Fused optimizers write parameters without bumping their versions; track_optimizer bumps them."""
    _, fp8 = _pair(256, 256)
    opt = make(list(fp8.parameters()))
    handle = track_optimizer(opt)
    spec = get_recipe("jet").train.weight
    for _ in range(2):
        fp8(torch.randn(16, 256)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        fresh = quantize(fp8.weight.detach(), spec.block)
        assert torch.equal(fp8.quantized_weight().codes.view(torch.uint8), fresh.codes.view(torch.uint8))
    assert fp8.weight_cache.num_quantizations == 3
    handle.remove()


def test_one_training_step_changes_parameters_and_fp32_master_weights_work():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.SiLU(), nn.Linear(256, 128))
    convert_to_float8(model, get_recipe("jet"))
    assert all(isinstance(m, Float8Linear) for m in (model[0], model[2]))
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(32, 128)).pow(2).mean().backward()
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_nan_weight_raises_naming_the_parameter():
    _, fp8 = _pair(256, 128)
    with torch.no_grad():
        fp8.weight[3, 7] = float("nan")
    with pytest.raises(NonFiniteError, match=r"proj\.weight.*NaN"):
        fp8(torch.randn(4, 256))


def test_quantize_into_given_buffers():
    x = torch.randn(200, 384)
    ref = quantize(x, (128, 128))
    out = quantize(torch.zeros(200, 384), (128, 128))
    assert quantize(x, (128, 128), out=out) is out
    assert torch.equal(out.codes.view(torch.uint8), ref.codes.view(torch.uint8)) and torch.equal(out.scales, ref.scales)
    with pytest.raises(ValueError, match=r"out=.*shape \(2, 3\)"):
        quantize(x, (128, 128), out=quantize(torch.zeros(256, 384), (128, 128)))


def test_refresh_checks_every_weight_with_one_sync_and_names_the_bad_ones(monkeypatch):
    import jetrl.fp8.quant as quant_module
    import jetrl.fp8.weight_cache as wc

    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 128), nn.Linear(128, 256))
    convert_to_float8(model, get_recipe("jet"))
    caches = [m.weight_cache for m in model]
    refresh_weight_caches(model)
    held = [m.quantized_weight() for m in model]
    checks = []  # per-weight checks (each one a device sync)
    for module in (quant_module, wc):
        real = module.nonfinite_problem
        monkeypatch.setattr(module, "nonfinite_problem", lambda q, name, real=real: (checks.append(name), real(q, name))[1])
    with torch.no_grad():
        for m in model:
            m.weight.mul_(2)
    refresh_weight_caches(model)
    assert checks == [] and [c.num_quantizations for c in caches] == [2, 2, 2]  # one batched check, no per-weight one
    with torch.no_grad():
        for m in model:
            m.weight.mul_(2)
        model[1].weight[0, 0] = float("nan")
        model[2].weight[5, 5] = float("inf")
    with pytest.raises(NonFiniteError, match=r"2 weight\(s\) hold NaN/Inf: 1\.weight, 2\.weight"):
        refresh_weight_caches(model)
    # the healthy weight was refreshed in place (same buffers), the bad ones stay stale and raise again
    assert model[0].quantized_weight() is held[0]
    assert torch.equal(held[0].codes.view(torch.uint8), quantize(model[0].weight.detach(), (128, 128)).codes.view(torch.uint8))
    assert [c.num_quantizations for c in caches] == [3, 3, 3]
    with pytest.raises(NonFiniteError, match=r"1\.weight"):
        model[1].quantized_weight()


def test_nan_activation_propagates_to_output():
    _, fp8 = _pair(256, 128)
    x = torch.randn(4, 256)
    x[1, 5] = float("inf")
    y = fp8(x)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2, 3]]).all()


@pytest.mark.parametrize(
    "x, err, match",
    [
        (torch.randn(4, 100), ValueError, "proj: input's last dim is 100, expected in_features=256"),
        (torch.randint(0, 5, (4, 256)), TypeError, "proj: Float8Linear input must be float"),
        (torch.randn(0, 256), ValueError, "proj: empty input"),
    ],
)
def test_bad_input_gets_clear_error(x, err, match):
    _, fp8 = _pair(256, 128)
    with pytest.raises(err, match=match):
        fp8(x)


def test_fp8_rollout_trains_in_bf16_and_rolls_out_in_fp8():
    ref, fp8 = _pair(256, 128, recipe="fp8_rollout")
    x = torch.randn(8, 256)
    with torch.no_grad():
        assert torch.equal(fp8(x), ref(x))  # training phase: plain high-precision linear
        with precision_phase("rollout"):
            y_rollout = fp8(x)
    assert not torch.equal(y_rollout, ref(x).detach()) and sqnr_db(y_rollout, ref(x).detach()) > MIN_SQNR_DB


def test_quantized_input_holds_no_autograd_graph():
    """The FP8 codes of an activation carry no ``grad_fn``: linear.py memoizes the last one for sibling layers,
    and on CPU a graph hanging off it kept every Float8Linear's weight cache alive after its model was converted
    back (found by bench/probe_memory.py's census; on CUDA the Triton kernels never built that graph)."""
    import gc
    import weakref

    from jetrl.fp8 import linear as linear_module

    fp8 = Float8Linear.from_float(nn.Linear(256, 256, bias=False), get_recipe("jet"), name="proj")
    x = torch.randn(8, 256, requires_grad=True)
    (fp8(x * 2) ** 2).sum().backward()
    held = linear_module._last_input._value
    assert held is not None and all(q.codes.grad_fn is None and q.scales.grad_fn is None for q in held)
    cache = weakref.ref(fp8.weight_cache)
    del fp8, held
    gc.collect()
    assert cache() is None, "a Float8Linear's weight cache outlived the module"
