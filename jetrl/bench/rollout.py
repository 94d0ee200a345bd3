"""Sections (d) and (e): the decode step against its bytes floor, and rollout throughput.

Model: an 8B-shaped random Qwen3 (``--layers``, default 36), BF16 weights, built on the GPU.
Recipes are switched in place on the same weights (models.set_recipe): ``bf16``, ``jet`` (FP8
linear layers) and ``jet_kv`` (``jet`` + FP8 KV cache) where that recipe exists.

(d) ``decode_step``: the engine's decode state for B rows with cached context lengths spread
    uniformly over [ctx/5, 9 ctx/5] (mean ctx), K/V random, written through the cache's own
    prefill path (so an FP8 cache stores real codes and scales). One decode forward (embedding
    -> layers -> lm_head, the graph the engine replays; sampling excluded) is timed under CUDA-
    graph replay and compared with its bytes floor

        floor = (weight bytes read + valid KV bytes read) / 4.3e12 B/s,
        valid KV = sum over rows of (length + 1) positions (the cached prefix and the new token).

    Check: the replayed logits equal an eager forward's (relative error < 1e-2, finite).
    Target: BF16 step <= 1.4x its floor.
    One more row times the step's sampling (outside the graph): the fused kernel against the
    PyTorch spec (sampling.py).
(e) ``rollout_throughput``: ``Engine.generate`` of B random prompts, P prompt tokens, N new
    tokens each (temperature 1, ignore_eos, so every row runs N steps), after a warm-up generate
    of the same prompts (2 new tokens) on the same engine: the prefill shapes, graph capture and
    Triton compilation are all met before the timed call. tok/s = B * N / wall time,
    prefill included; ms/step = the decode part / (N - 1) (prefill timed separately). The floor
    of the same config averages the KV read over the generation (context P + N/2). Compared:
    jetrl FP8 vs jetrl BF16, next to the floor ratio (target: >= 90% of it), and the decode step
    of jetrl BF16 vs HF ``generate`` at the same mean context (hf_generate.py; target >= 12x).
    Optionally a long-context config
    (``jet_kv`` vs ``bf16``; by default batch 64, 3072 + 1024 tokens), where the KV cache is
    most of the bytes and an FP8 cache matters most.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn

from jetrl.bench.attention import decode_attention_rows
from jetrl.bench.checks import GEMM_REL_ERR_MAX, rel_err, status
from jetrl.bench.gpu_clocks import ClockLog
from jetrl.bench.hf_generate import hf_generate
from jetrl.bench.models import (
    decode_weight_bytes,
    free_device_memory,
    kv_bytes_per_position,
    random_model,
    set_recipe,
)
from jetrl.bench.report import error_row, guarded, set_target
from jetrl.bench.sampling import sampler_row
from jetrl.bench.shapes import BenchConfig
from jetrl.bench.synthetic import random_prompts
from jetrl.bench.timing import floor_ms, time_ms, wall_s
from jetrl.engine import Engine, SamplingParams
from jetrl.fp8.kernels import has_triton
from jetrl.fp8.recipe import precision_phase
from jetrl.models.fused import use_fused_ops

DECODE_FLOOR_TARGET = 1.4  # BF16 decode step <= 1.4x its bytes floor
FLOOR_RATIO_FRACTION = 0.9  # rollout FP8/BF16 >= 90% of the bytes-floor ratio
HF_TARGET = 12.0  # jetrl BF16 rollout >= 12x HF generate


def _fp8_recipes() -> list[str]:
    return ["jet", "jet_kv"]


# ------------------------------------------------------------------------------------------ (d)
def spread_lengths(batch: int, mean: int) -> list[int]:
    """``batch`` context lengths evenly spread over [mean/5, 9 mean/5]: their mean is ``mean``."""
    return torch.linspace(mean / 5, 9 * mean / 5, batch).round().long().tolist()


def fill_cache(cache: Any, config: Any, lengths: list[int], device: torch.device, dtype: torch.dtype,
               chunk: int = 32) -> None:
    """Random K/V in positions [0, lengths[s]) of every slot, through the cache's prefill path."""
    lengths_t = torch.tensor(lengths, device=device)
    hkv, hd = config.num_key_value_heads, config.head_dim
    for start in range(0, len(lengths), chunk):
        slots = torch.arange(start, min(start + chunk, len(lengths)), device=device)
        width = max(lengths[start:start + chunk])
        view = cache.prefill(slots, lengths_t[slots])
        for layer in range(config.num_hidden_layers):
            k = torch.randn(len(slots), hkv, width, hd, device=device, dtype=dtype)
            v = torch.randn(len(slots), hkv, width, hd, device=device, dtype=dtype)
            view.update(layer, k, v)


def decode_step(cfg: BenchConfig, device: torch.device) -> list[dict[str, Any]]:
    model = random_model(cfg.model_config(cfg.layers), device, torch.bfloat16).requires_grad_(False)
    batch, lengths = cfg.decode_batch, spread_lengths(cfg.decode_batch, cfg.decode_context)
    rows, bf16_ms, bf16_floor = [], None, None
    try:
        rows += decode_attention_rows(cfg, device, lengths)
    except Exception as exc:  # noqa: BLE001 -- recorded; the decode-step rows still run
        rows.append(error_row("decode attention kernel", exc))
    if device.type == "cuda" and has_triton():
        rows.append(guarded("sampling one step", lambda: sampler_row(cfg, device)))
    for recipe in ["bf16", *_fp8_recipes()]:
        name = f"decode step {recipe} B={batch} ctx {cfg.decode_context} L={cfg.layers}"
        row = _recipe_step_row(name, model, recipe, batch, lengths, cfg, device, fused=True)
        if "error" in row:
            rows.append(row)
            continue
        if recipe == "bf16":
            bf16_ms, bf16_floor = row["value"], row["baseline"]
            set_target(row, "<=", DECODE_FLOOR_TARGET, smoke=cfg.smoke)
        elif bf16_ms is not None:
            row["bf16_ms"] = bf16_ms
            row["speedup_vs_bf16"] = bf16_ms / row["value"]
            row["floor_speedup_vs_bf16"] = bf16_floor / row["baseline"]
            row["note"] = (f"ratio = x floor; {row['speedup_vs_bf16']:.2f}x bf16 step "
                           f"(floor ratio {row['floor_speedup_vs_bf16']:.2f}x)")
        rows.append(row)
    by_name = {r["name"]: r for r in rows if "value" in r}
    rows += _unfused_rows(model, batch, lengths, cfg, device, by_name)
    del model
    return rows


def _unfused_rows(model: nn.Module, batch: int, lengths: list[int], cfg: BenchConfig, device: torch.device,
                  fused: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The decode step again with RMSNorm/RoPE/SwiGLU as PyTorch ops (``JETRL_FUSED_OPS=0``), per recipe.

    ``ratio`` is the speedup of the default (fused kernels, measured above) over this.
    """
    rows = []
    for recipe in ["bf16", *_fp8_recipes()]:
        default = f"decode step {recipe} B={batch} ctx {cfg.decode_context} L={cfg.layers}"
        row = _recipe_step_row(f"{default} PyTorch ops", model, recipe, batch, lengths, cfg, device, fused=False)
        if "error" in row:
            rows.append(row)
            continue
        floor_ms_, step_ms = row["baseline"], row["value"]
        if default in fused:
            row.update(baseline=step_ms, baseline_label="PyTorch ops", value=fused[default]["value"],
                       value_label="fused", ratio=step_ms / fused[default]["value"])
        row["note"] = (f"ratio = fused kernels' speedup; PyTorch ops {step_ms / floor_ms_:.2f}x the floor "
                       f"{floor_ms_:.3f} ms")
        rows.append(row)
    return rows


def _recipe_step_row(name: str, model: nn.Module, recipe: str, batch: int, lengths: list[int], cfg: BenchConfig,
                     device: torch.device, *, fused: bool) -> dict[str, Any]:
    """:func:`_decode_step_row` under ``recipe`` (fused RMSNorm/RoPE/SwiGLU kernels or PyTorch ops), or an error row."""
    try:
        set_recipe(model, recipe)
        with use_fused_ops(fused):
            return _decode_step_row(name, model, batch, lengths, cfg, device)
    except Exception as exc:  # noqa: BLE001 -- recorded in the row; the other recipes still run
        return error_row(name, exc)
    finally:
        free_device_memory()


def _decode_state(model: nn.Module, batch: int, lengths: list[int], device: torch.device) -> Engine:
    """An engine whose ``batch`` rows hold cached contexts of ``lengths`` (random K/V) and a random pending token."""
    engine = Engine(model, max_slots=batch, max_len=max(lengths) + 2)
    fill_cache(engine.cache, model.config, lengths, device, torch.bfloat16)
    engine.next_tokens.random_(0, model.config.vocab_size)
    return engine


ABBA = (False, True, True, False)  # an A/B's order: a drift over the measurement cancels to first order


def ab_decode_steps(model: nn.Module, cfg: BenchConfig, arm: Callable[[bool], Any], batches: list[int],
                    device: torch.device, build_order: tuple[bool, bool] = (False, True)) -> Iterator[dict[str, Any]]:
    """An A/B of the engine's decode step (the probes in bench/): per batch and recipe (``bf16``, ``jet``,
    ``jet_kv``), two engines over the same cached contexts (mean ``cfg.decode_context``), each built and its CUDA
    graph captured inside ``arm(False)`` resp. ``arm(True)``, then both replays timed off, on, on, off. Yields
    ``{"recipe", "batch", "off_ms", "on_ms", "logits": {False: .., True: ..}}`` (fp32 logits of the captured step;
    the two engines coexist while they are timed, so their order of construction is ``build_order``)."""
    for batch in batches:
        lengths = spread_lengths(batch, cfg.decode_context)
        for recipe in ("bf16", "jet", "jet_kv"):
            set_recipe(model, recipe)
            logits, engines = {}, {}
            with torch.no_grad(), precision_phase("rollout"):
                for on in build_order:
                    torch.manual_seed(0)
                    with arm(on):
                        engines[on] = _decode_state(model, batch, lengths, device)
                        logits[on] = engines[on].graphs(batch)[:batch].float()  # captured under this arm
                measured = {False: [], True: []}
                for on in ABBA:
                    measured[on].append(time_ms(partial(engines[on].graphs, batch), device, iters=20, warmup=2))
            yield {"recipe": recipe, "batch": batch, "off_ms": sum(measured[False]) / 2,
                   "on_ms": sum(measured[True]) / 2, "logits": logits}
            engines = logits = None
            free_device_memory()


def _decode_step_row(name: str, model: nn.Module, batch: int, lengths: list[int], cfg: BenchConfig,
                     device: torch.device) -> dict[str, Any]:
    engine = _decode_state(model, batch, lengths, device)
    try:
        with torch.no_grad(), precision_phase("rollout"):
            # The engine's own decode forward: graph-capturable, it rewrites each row's pending
            # token at position lengths[s] and does not advance lengths, so replays are idempotent.
            eager = engine._decode_forward(batch)
            if engine.use_cuda_graphs:
                replayed = engine.graphs(batch)[:batch]  # first call captures the graph
                err = rel_err(replayed, eager)
                step = partial(engine.graphs, batch)
            else:
                replayed, err, step = eager, None, partial(engine._decode_forward, batch)
            finite = bool(torch.isfinite(replayed).all())
            ms = time_ms(step, device, iters=cfg.iters, warmup=2)
        weight_bytes = decode_weight_bytes(model, batch)
        kv_bytes = kv_bytes_per_position(engine.cache) * sum(n + 1 for n in lengths)
    finally:
        engine = step = None
    floor = floor_ms(weight_bytes + kv_bytes)
    ok = finite and (err is None or err < GEMM_REL_ERR_MAX)
    detail = ("finite" if finite else "NON-FINITE logits") + ("" if err is None else f", graph vs eager {err:.1e}")
    return {"name": name, "unit": "ms", "baseline": floor, "baseline_label": "floor", "value": ms,
            "ratio": ms / floor, "weight_gb": weight_bytes / 1e9, "kv_gb": kv_bytes / 1e9,
            "cuda_graph": err is not None, "check": status(ok), "check_detail": detail, "note": "ratio = x floor"}


# ------------------------------------------------------------------------------------------ (e)
def engine_rollout(model: nn.Module, recipe: str, prompts: list[list[int]], new_tokens: int,
                   device: torch.device) -> dict[str, Any]:
    """Tokens/s, ms/step and the bytes floor of one ``Engine.generate`` under ``recipe`` (module docstring)."""
    set_recipe(model, recipe)
    batch, prompt_len = len(prompts), len(prompts[0])
    engine = Engine(model, max_slots=batch, max_len=prompt_len + new_tokens + 1)
    try:
        # warm-up on the very prompts: the timed prefill then meets no first-call cost (cuBLAS heuristics,
        # cuDNN attention plans, Triton compilation for its shapes); a shorter warm-up had left those to
        # the first recipe timed
        engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=1))
        prefill_s = _time_prefills(engine, device)
        params = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=0)
        with ClockLog(device) as clocks:  # a sustained decode can meet the board's power limit (gpu_clocks.py)
            seconds, groups = wall_s(partial(engine.generate, prompts, params), device)
        completions = [group[0] for group in groups]
        full = all(len(c.token_ids) == new_tokens for c in completions)
        finite = all(torch.isfinite(torch.tensor(c.logprobs)).all() for c in completions)
        kv_per_position = kv_bytes_per_position(engine.cache)
    finally:
        engine = None
        free_device_memory()
    step_floor = floor_ms(decode_weight_bytes(model, batch) + kv_per_position * batch * (prompt_len + new_tokens / 2))
    decode_s = seconds - prefill_s[0]
    return {"recipe": recipe, "tok_s": batch * new_tokens / seconds, "wall_s": seconds, "prefill_s": prefill_s[0],
            "ms_per_step": decode_s / max(new_tokens - 1, 1) * 1e3, "floor_ms_per_step": step_floor,
            "gpu": clocks.summary(), "ok": full and finite,
            "check_detail": ("all rows full length" if full else "SHORT completions")
            + ("" if finite else ", NON-FINITE logprobs")}


def _time_prefills(engine: Engine, device: torch.device) -> list[float]:
    """Accumulate the wall time of the engine's prefills (synchronized), to split prefill from decode."""
    total = [0.0]
    inner = engine._prefill

    def timed(*args: Any, **kwargs: Any) -> Any:
        seconds, out = wall_s(lambda: inner(*args, **kwargs), device)
        total[0] += seconds
        return out

    engine._prefill = timed
    return total


def _recipe_row(label: str, r: dict[str, Any]) -> dict[str, Any]:
    return {"name": f"{label} {r['recipe']}", "unit": "ms", "baseline": r["floor_ms_per_step"],
            "baseline_label": "floor", "value": r["ms_per_step"], "value_label": "step",
            "ratio": r["ms_per_step"] / r["floor_ms_per_step"], **r, "check": status(r["ok"]),
            "note": f"ratio = x floor; {r['tok_s']:,.0f} tok/s, prefill {r['prefill_s']:.2f} s" + _clock_note(r["gpu"])}


def _clock_note(gpu: dict[str, Any]) -> str:
    """The SM clock and power while the rollout ran, where nvidia-smi could say (gpu_clocks.py)."""
    if not gpu:
        return ""
    return (f"; SM {gpu['sm_mhz_mean']} MHz mean ({gpu['sm_mhz_min']} min), {gpu['power_w_mean']} W, "
            f"power-capped {gpu['power_capped']:.0%} of samples")


def _compare_row(label: str, base: dict[str, Any], fp8: dict[str, Any], smoke: bool) -> dict[str, Any]:
    floor_ratio = base["floor_ms_per_step"] / fp8["floor_ms_per_step"]
    row = {"name": f"{label} {fp8['recipe']}/{base['recipe']} tok/s", "unit": "tok/s", "baseline": base["tok_s"],
           "baseline_label": base["recipe"], "value": fp8["tok_s"], "value_label": fp8["recipe"],
           "ratio": fp8["tok_s"] / base["tok_s"], "floor_ratio": floor_ratio,
           "decode_step_ratio": base["ms_per_step"] / fp8["ms_per_step"],
           "note": f"floor ratio {floor_ratio:.2f}x; target = {FLOOR_RATIO_FRACTION:.0%} of it"}
    row["fraction_of_floor_ratio"] = row["ratio"] / floor_ratio
    return set_target(row, ">=", round(FLOOR_RATIO_FRACTION * floor_ratio, 3), smoke=smoke)


def rollout_throughput(cfg: BenchConfig, device: torch.device) -> list[dict[str, Any]]:
    model = random_model(cfg.model_config(cfg.layers), device, torch.bfloat16).requires_grad_(False)
    prompts = random_prompts(cfg.rollout_batch, cfg.rollout_prompt, cfg.vocab, seed=0)
    label = f"rollout B={cfg.rollout_batch} {cfg.rollout_prompt}+{cfg.rollout_new}"
    rows, results = [], {}
    for recipe in ["bf16", "hf", *_fp8_recipes()]:
        try:
            if recipe == "hf":
                set_recipe(model, "bf16")
                rows.append(_hf_row(label, model, prompts, cfg, results.get("bf16"), device))
                continue
            results[recipe] = engine_rollout(model, recipe, prompts, cfg.rollout_new, device)
            rows.append(_recipe_row(label, results[recipe]))
            if recipe != "bf16" and "bf16" in results:
                rows.append(_compare_row(label, results["bf16"], results[recipe], cfg.smoke))
        except Exception as exc:  # noqa: BLE001 -- recorded in the row; the other configs still run
            rows.append(error_row(f"{label} {recipe}", exc))
        finally:
            free_device_memory()
    if cfg.long_context:
        rows += _long_context(cfg, model, device)
    del model
    return rows


def _hf_row(label: str, model: nn.Module, prompts: list[list[int]], cfg: BenchConfig,
            bf16: dict[str, Any] | None, device: torch.device) -> dict[str, Any]:
    # HF's prompts end where its hf_new tokens centre on the rollout's mean context (hf_generate.py)
    hf_prompt = max(1, cfg.rollout_prompt + cfg.rollout_new // 2 - cfg.hf_new // 2)
    hf_prompts = random_prompts(len(prompts), hf_prompt, cfg.vocab, seed=2)
    hf = hf_generate(model, hf_prompts, cfg.hf_new, device)
    row = {"name": f"{label} bf16 vs HF generate, decode step", "unit": "ms/step", "baseline": hf["ms_per_step"],
           "baseline_label": "HF", "value": bf16["ms_per_step"] if bf16 else None, "value_label": "jetrl", "hf": hf,
           "check": status(hf["ok"]), "check_detail": f"HF {hf['new_tokens']} new tokens",
           "note": (f"same mean context {hf_prompt + cfg.hf_new // 2}: HF decodes {hf['new_tokens']} tokens after a "
                    f"{hf_prompt}-token prompt, jetrl the whole rollout; prefill excluded on both sides")}
    row["ratio"] = hf["ms_per_step"] / row["value"] if bf16 else None
    return set_target(row, ">=", HF_TARGET, smoke=cfg.smoke)


def _long_context(cfg: BenchConfig, model: nn.Module, device: torch.device) -> list[dict[str, Any]]:
    label = f"rollout B={cfg.long_batch} {cfg.long_prompt}+{cfg.long_new}"
    prompts = random_prompts(cfg.long_batch, cfg.long_prompt, cfg.vocab, seed=1)
    rows, results = [], {}
    for recipe in ("jet_kv", "bf16"):  # jet_kv first: the model is under it after the short runs
        try:
            results[recipe] = engine_rollout(model, recipe, prompts, cfg.long_new, device)
            rows.append(_recipe_row(label, results[recipe]))
        except Exception as exc:  # noqa: BLE001 -- recorded in the row; the other configs still run
            rows.append(error_row(f"{label} {recipe}", exc))
        finally:
            free_device_memory()
    if len(results) == 2:
        rows.append(_compare_row(label, results["bf16"], results["jet_kv"], cfg.smoke))
    return rows
