"""`jetrl bench --smoke`: every section's code path on CPU, the JSON layout, and a loud failure contract."""

import contextlib
import io
import json
import os

import pytest
import torch
from torch import nn

from jetrl.bench import runner
from jetrl.bench.checks import FAILED
from jetrl.bench.models import decode_weight_bytes, random_model, set_recipe
from jetrl.bench.rollout import spread_lengths
from jetrl.bench.shapes import h200_config, smoke_config
from jetrl.cli import main
from jetrl.fp8 import Float8Linear

SECTIONS = "abcdefg"


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    stdout = io.StringIO()
    # the CLI gives the allocator its setting only where CUDA is not yet initialized (jetrl/rl/memory.py): not so
    # when earlier tests of this process used the GPU
    allocator_set = not torch.cuda.is_initialized() or "PYTORCH_CUDA_ALLOC_CONF" in os.environ
    with contextlib.redirect_stdout(stdout):
        code = main(["bench", "--smoke", "--out", str(out)])
    data = json.loads((out / "bench.json").read_text())
    return code, data, stdout.getvalue().strip().splitlines(), out, allocator_set


@pytest.mark.slow
def test_smoke_runs_every_section_and_every_check_passes(smoke_run):
    code, data, _, _, _ = smoke_run
    assert code == 0, data["summary"]
    assert data["summary"]["ok"] and not data["summary"]["failed_checks"] and not data["summary"]["errors"]
    assert list(data["sections"]) == list(SECTIONS)
    for key, section in data["sections"].items():
        assert section["error"] is None, (key, section["traceback"])
        assert section["rows"] and section["wall_s"] > 0, key
        for row in section["rows"]:
            assert "error" not in row, (key, row)
            assert row.get("check") in (None, "ok"), (key, row)
        # every section checks correctness in the same run as its timings
        assert any(row.get("check") == "ok" for row in section["rows"]), key


@pytest.mark.slow
def test_smoke_json_layout_and_targets(smoke_run):
    _, data, _, out, allocator_set = smoke_run
    meta = data["meta"]
    for key in ("device", "torch", "triton", "transformers", "date", "command", "config", "timing", "git_commit",
                "switches"):
        assert key in meta, key
    assert all(name.startswith("JETRL_") or name == "PYTORCH_CUDA_ALLOC_CONF" for name in meta["switches"])
    assert ("PYTORCH_CUDA_ALLOC_CONF" in meta["switches"]) == allocator_set  # what the CLI gives the allocator
    assert meta["device"] == "cpu" and meta["config"]["smoke"] and "MEANINGLESS" in meta["timing"]
    assert meta["command"].startswith("jetrl bench --sections a,b,c,d,e,f,g") and str(out) in meta["command"]
    targeted = {t["section"] for t in data["summary"]["targets"]}
    assert targeted == set(SECTIONS)  # every section puts a target next to a measured ratio
    assert all(t["met"] is None for t in data["summary"]["targets"])  # CPU timings are never judged
    rows = {key: section["rows"] for key, section in data["sections"].items()}
    assert any(r["name"].startswith("quant fused") for r in rows["a"])
    assert any("bf16 vs HF generate" in r["name"] for r in rows["e"])
    assert any("jet_kv/bf16" in r["name"] for r in rows["e"])  # the FP8-KV comparison, incl. long context
    small = [r for r in rows["f"] if r["name"].startswith("training phase, ")]  # a smaller model, no target
    assert len(small) == 1 and small[0]["ratio"] > 0 and small[0]["check"] == "ok" and "target" not in small[0]
    for row in rows["b"] + rows["c"] + rows["f"] + rows["g"]:
        if "ratio" in row and row.get("baseline_label") == "bf16":
            assert row["baseline"] > 0 and row["value"] > 0  # the BF16 baseline of the same run


@pytest.mark.slow
def test_smoke_prints_table_then_one_json_line(smoke_run):
    _, _, lines, out, _ = smoke_run
    summary = json.loads(lines[-1])
    assert summary["ok"] and summary["json"] == str(out / "bench.json")
    assert any(line.startswith("SMOKE RUN") for line in lines[:-1])
    assert any("Float8Linear fwd+bwd" in line and ">=1.45x" in line for line in lines[:-1])


def _fake_sections(monkeypatch, rows_a, fail_b):
    def section_a(cfg, device):
        return rows_a

    def section_b(cfg, device):
        if fail_b:
            raise RuntimeError("out of memory (simulated)")
        return [{"name": "fine", "check": "ok"}]

    monkeypatch.setattr(runner, "SECTIONS", {"a": ("fake a", section_a), "b": ("fake b", section_b)})


def test_failed_check_is_loud(monkeypatch, tmp_path, capsys):
    _fake_sections(monkeypatch, [{"name": "kernel", "check": FAILED, "check_detail": "codes differ"}], fail_b=True)
    code = main(["bench", "--smoke", "--sections", "a,b", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1  # a correctness failure fails the run, even with an errored section alongside
    assert "FAILED (codes differ)" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["failed_checks"] == ["a: kernel"] and summary["errors"] == ["b: RuntimeError: out of memory (simulated)"]
    data = json.loads((tmp_path / "bench.json").read_text())
    assert "simulated" in data["sections"]["b"]["traceback"]


def test_section_error_does_not_stop_the_others(monkeypatch, tmp_path, capsys):
    _fake_sections(monkeypatch, [{"name": "kernel", "check": "ok"}], fail_b=True)
    assert main(["bench", "--smoke", "--sections", "b,a", "--out", str(tmp_path)]) == 3  # incomplete, not failed
    data = json.loads((tmp_path / "bench.json").read_text())
    assert list(data["sections"]) == ["a", "b"] and data["sections"]["a"]["rows"][0]["check"] == "ok"


@pytest.mark.parametrize("flag", [[], ["--deterministic"]])
def test_deterministic_runs_every_section_under_it_and_says_so(flag, monkeypatch, tmp_path):
    seen = []
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (else the run sets it, and it would outlive the test)
    monkeypatch.setattr(runner, "SECTIONS", {
        "a": ("fake a", lambda cfg, device: seen.append(torch.are_deterministic_algorithms_enabled()) or [])})
    before = torch.are_deterministic_algorithms_enabled()
    assert main(["bench", "--smoke", "--sections", "a", "--out", str(tmp_path), *flag]) == 0
    assert seen == [bool(flag) or before] and torch.are_deterministic_algorithms_enabled() == before  # the run only
    assert ("--deterministic" in json.loads((tmp_path / "bench.json").read_text())["meta"]["command"]) == bool(flag)


def test_bad_sections_is_a_user_error(capsys, tmp_path):
    assert main(["bench", "--smoke", "--sections", "a,x"]) == 2
    assert "--sections" in capsys.readouterr().err
    assert main(["bench", "--smoke", "--sections", "a", "--device", "foo"]) == 2
    assert "--device 'foo' is not a device" in capsys.readouterr().err
    (tmp_path / "f").write_text("")
    assert main(["bench", "--smoke", "--sections", "a", "--out", str(tmp_path / "f")]) == 2  # before any section runs
    assert "is a file" in capsys.readouterr().err


@pytest.mark.parametrize("flags, words", [(["--micro-batch", "3"], "--micro-batch=3 must divide"),
                                          (["--micro-batch", "0"], "--micro-batch=0 must be >= 1"),
                                          (["--train-layers", "0"], "--train-layers=0 must be >= 1")])
def test_bad_sizes_are_user_errors(flags, words, tmp_path, capsys):
    assert main(["bench", "--smoke", "--sections", "f", "--out", str(tmp_path), *flags]) == 2
    assert words in capsys.readouterr().err


def test_micro_batch_reaches_the_config():
    import argparse

    from jetrl.bench.cli import add_arguments, command_line

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--sections", "f,g", "--train-layers", "36", "--micro-batch", "4"])
    assert "--train-layers 36 --micro-batch 4" in command_line(args, "fg")  # the children's argv
    assert h200_config(train_layers=36, micro_batch=4).micro_batch == 4


@pytest.mark.parametrize("flag", [[], ["--torchao"]])
def test_torchao_baseline_is_optional_and_never_breaks_the_run(flag, tmp_path, capsys):
    # no torchao here (or no SM90): the rows say why instead of a figure, and the run still passes
    assert main(["bench", "--smoke", "--sections", "b", "--out", str(tmp_path), *flag]) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["sections"]["b"]["rows"]
    fwd_bwd = [r for r in rows if r["name"].startswith("Float8Linear fwd+bwd")]
    assert len(fwd_bwd) == 4
    # each row says how long the host takes to issue a call (an eager row is host-bound where that is its time)
    assert all(r["host_ms_fp8"] > 0 and r["host_ms_bf16"] > 0 and "ms per FP8 call" in r["note"] for r in fwd_bwd)
    for row in fwd_bwd:
        if flag:
            assert row["torchao"].startswith("torchao ") and "off" not in row["torchao"], row["torchao"]
            assert ("torchao_ms" in row) == ("unavailable" not in row["torchao"] and "failed" not in row["torchao"])
        else:
            assert row["torchao"] == "torchao baseline off (--torchao)" and "torchao_ms" not in row
    assert ("--torchao" in json.loads((tmp_path / "bench.json").read_text())["meta"]["command"]) == bool(flag)


@pytest.mark.parametrize("breaks", [False, True])
def test_torchao_fields_time_a_working_baseline_and_record_a_broken_one(monkeypatch, breaks):
    import sys
    import types

    from jetrl.bench.torchao_baseline import torchao_fields

    class Stand(nn.Module):  # stands in for torchao's Float8BlockwiseLinear: the same weight, plain BF16 math
        def __init__(self, mod):
            super().__init__()
            self.weight = mod.weight

        def forward(self, x):
            if breaks:
                raise RuntimeError("scaled_mm: no such kernel")
            return x @ self.weight.t()

    linear = types.ModuleType("torchao.prototype.blockwise_fp8_training.linear")
    linear.Float8BlockwiseLinear = types.SimpleNamespace(from_float=Stand)
    for name in ("torchao", "torchao.prototype", "torchao.prototype.blockwise_fp8_training"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["torchao"].__version__ = "0.0-stand-in"
    monkeypatch.setitem(sys.modules, linear.__name__, linear)

    torch.manual_seed(0)
    bf16 = nn.Linear(256, 128, bias=False, dtype=torch.bfloat16)
    x, dy = torch.randn(32, 256, dtype=torch.bfloat16), torch.randn(32, 128, dtype=torch.bfloat16)
    x32 = x.float().requires_grad_()
    w32 = bf16.weight.detach().float().requires_grad_()
    y32 = x32 @ w32.t()
    y32.backward(dy.float())
    timer = {"device": torch.device("cpu"), "iters": 1, "warmup": 0}
    fields = torchao_fields(bf16, x, dy, {"y": y32, "dx": x32.grad, "dw": w32.grad}, timer)
    assert bf16.weight.grad is None  # the shared weight is left as found
    if breaks:  # recorded, not raised: the row's jetrl and BF16 figures stand
        assert fields == {"torchao": "torchao 0.0-stand-in failed (RuntimeError: scaled_mm: no such kernel)"}
    else:
        assert fields["torchao"] == "torchao 0.0-stand-in" and fields["torchao_ms"] > 0
        assert all(v > 30 for v in fields["torchao_sqnr_db"].values())  # BF16 math against fp32: high SQNR


def test_recipes_switch_in_place_on_shared_parameters():
    cfg = smoke_config()
    model = random_model(cfg.model_config(1), torch.device("cpu"), torch.bfloat16)
    params = {name: p for name, p in model.named_parameters()}
    bf16_bytes = decode_weight_bytes(model, batch=4)
    set_recipe(model, "jet_kv")
    assert any(isinstance(m, Float8Linear) for m in model.modules())
    assert all(m.kv_quant is not None for m in model.modules() if hasattr(m, "kv_quant"))
    fp8_bytes = decode_weight_bytes(model, batch=4)
    set_recipe(model, "bf16")  # undoes both transforms: the engine then allocates a BF16 cache
    assert not any(isinstance(m, Float8Linear) for m in model.modules())
    assert all(type(m) is nn.Linear for n, m in model.named_modules() if n.endswith("_proj"))
    assert all(m.kv_quant is None for m in model.modules() if hasattr(m, "kv_quant"))
    assert all(p is params[name] for name, p in model.named_parameters())  # no copy, no new Parameter
    # the 7 linear layers drop from 2 to ~1 byte per weight; embedding rows, norms and lm_head stay BF16
    linear = sum(m.weight.numel() for n, m in model.named_modules() if n.endswith("_proj"))
    assert abs((bf16_bytes - fp8_bytes) - linear) < 0.01 * linear


def test_float8_linear_rows_time_a_fresh_input_quantization_every_call(monkeypatch):
    """(b) feeds one x again and again; Float8Linear keeps the last input's quantization for siblings, so the bench
    must forget it before each timed call, or the FP8 rows skip x's quantization that training pays every step."""
    from jetrl.bench import kernels
    from jetrl.fp8 import linear

    calls = {"n": 0}
    real_both, real_one = linear._quantize_both, linear.quantize

    def counting(t, rows, tokens, name):
        calls["n"] += name.endswith(".input")
        return real_both(t, rows, tokens, name)

    def counting_one(t, block, **kw):
        calls["n"] += kw.get("name", "").endswith(".input")
        return real_one(t, block, **kw)

    per_timing = []  # input quantizations in each timed region

    def time_ms(fn, **timer):
        before = calls["n"]
        for _ in range(3):
            fn()
        per_timing.append(calls["n"] - before)
        return 1.0

    monkeypatch.setattr(linear, "_quantize_both", counting)
    monkeypatch.setattr(linear, "quantize", counting_one)
    monkeypatch.setattr(kernels, "time_ms", time_ms)
    kernels._linear_rows(smoke_config(), torch.device("cpu"), "o", 32, 256, 256)
    # timed in order: fwd bf16, fwd fp8, fwd+bwd bf16, fwd+bwd fp8, then the GEMMs and the quantization alone:
    # each FP8 call quantizes x once (three calls per timing here)
    assert per_timing[:4] == [0, 3, 0, 3] and sum(per_timing) == 6


def test_h200_shapes_are_qwen3_8b():
    cfg = h200_config()
    assert cfg.layer_gemms() == [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 24576),
                                 ("down", 12288, 4096)]
    model_cfg = cfg.model_config(cfg.layers)
    assert (model_cfg.num_hidden_layers, model_cfg.vocab_size, model_cfg.qk_norm) == (36, 151936, True)
    lengths = spread_lengths(256, 640)
    assert sum(lengths) / len(lengths) == pytest.approx(640, abs=0.5) and max(lengths) == 1152


def test_gpu_sweep_scripts_compile():
    """bench/*.py (GPU-only sweeps and the decode-step profile behind docs/benchmarks.md) stay valid Python."""
    import py_compile
    from pathlib import Path

    scripts = sorted((Path(__file__).resolve().parents[1] / "bench").glob("*.py"))
    assert len(scripts) >= 3
    for script in scripts:
        py_compile.compile(str(script), doraise=True)


def test_decode_step_ab_builds_each_arm_in_its_context_and_times_abba(monkeypatch):
    """bench/probe_*.py's A/B helper (GPU-only in use): each engine is built and captured inside its arm, and the
    two are timed off, on, on, off, per batch and recipe. Checked here with stand-in engines."""
    from jetrl.bench import rollout

    state, built, timed = {"arm": None}, [], []

    class Engine:
        def __init__(self, arm):
            self.arm = arm

        def graphs(self, batch):
            return torch.full((batch, 3), float(self.arm))

    def arm(on):
        @contextlib.contextmanager
        def inside():
            state["arm"] = on
            yield
            state["arm"] = None
        return inside()

    monkeypatch.setattr(rollout, "_decode_state", lambda model, batch, lengths, device: built.append(state["arm"])
                        or Engine(state["arm"]))
    monkeypatch.setattr(rollout, "time_ms", lambda fn, device, **kw: timed.append(fn.func.__self__.arm) or
                        (2.0 if fn.func.__self__.arm else 3.0))
    model = random_model(smoke_config().model_config(1), torch.device("cpu"), torch.float32)
    rows = list(rollout.ab_decode_steps(model, smoke_config(), arm, [2, 4], torch.device("cpu"), (True, False)))
    assert [(r["batch"], r["recipe"]) for r in rows] == [(b, r) for b in (2, 4) for r in ("bf16", "jet", "jet_kv")]
    assert built == [True, False] * 6 and timed == [False, True, True, False] * 6
    assert all(r["off_ms"] == 3.0 and r["on_ms"] == 2.0 and r["logits"][True].eq(1).all() for r in rows)


def test_clock_log_keeps_its_gpus_samples_and_is_empty_without_a_gpu(monkeypatch):
    """jetrl/bench/gpu_clocks.py: nvidia-smi's CSV lines of the GPU torch runs on (by UUID) summarized, unparsable
    lines skipped; on CPU, or with no nvidia-smi, an empty summary and no error."""
    from jetrl.bench import gpu_clocks

    text = ("GPU-aaaa-1, 1980, 120.5, 0x0000000000000000\n"
            "GPU-bbbb-2, 1200, 650.0, 0x0000000000000004\n"  # another GPU: not counted
            "GPU-aaaa-1, 1620, 693.0, 0x0000000000000004\n"
            "GPU-aaaa-1, [N/A], 690.0, 0x4\n"
            "GPU-aaaa-1, 1650, 69")  # cut off by terminate()
    assert gpu_clocks.parse_samples(text, "AAAA-1") == [(1980.0, 120.5, 0), (1620.0, 693.0, 4)]
    summary = gpu_clocks.summarize(gpu_clocks.parse_samples(text, "aaaa-1"))
    assert summary == {"sm_mhz_mean": 1800, "sm_mhz_min": 1620, "power_w_mean": 407, "power_capped": 0.5,
                       "samples": 2}
    assert gpu_clocks.summarize([]) == {}
    with gpu_clocks.ClockLog(torch.device("cpu")) as log:
        pass
    assert log.summary() == {}
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: None)
    with gpu_clocks.ClockLog(torch.device("cuda")) as log:  # no nvidia-smi: never touches the (absent) GPU
        pass
    assert log.summary() == {}
