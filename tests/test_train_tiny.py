"""`jetrl train --preset tiny --recipe X` for every recipe, on the built-in tiny start (CI runs it).

Margins, from the runs in docs/benchmarks.md ("Embedded default and tiny preset"):
* learning: held-out greedy accuracy rises by >= 30 points under bf16, jet and jet_kv (measured
  about +80 points for bf16/jet), and by >= 20 points under the off-policy fp8_rollout; jet_kv (FP8
  KV cache, the trainer sees the same FP8 K/V) ends within 10 points of bf16 (measured on the 2-core
  CPU box, docs/benchmarks.md "CPU, all five recipes": bf16 0.02 -> 0.89, jet 0.12 -> 0.82, jet_kv
  0.28 -> 0.84; its start is higher because FP8 tips some near-ties of the start's greedy answers);
* mismatch: jet's rollout-vs-trainer k3 KL is no larger than bf16's + 1e-6 and its token
  multiplicative probability error no larger than bf16's + 1e-4 (both at rounding level on
  CPU, where the FP8 forward is batch-invariant); the same holds for jet_kv; fp8_rollout's k3 KL is
  >= 1e-5 and >= 100x jet's: the rollout samples from another graph.
"""

import json

import pytest

from jetrl.rl.metrics import MISMATCH_KEYS

from .subprocesses import run_jetrl

RECIPES = ("bf16", "fp8_rollout", "jet", "jet_kv")


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    runs = run_jetrl(*(["train", "--preset", "tiny", "--recipe", recipe, "--run-dir",
                        str(tmp_path_factory.mktemp(f"tiny_{recipe}")), "progress=false"] for recipe in RECIPES),
                     timeout=900)  # side by side, one core each
    results = {}
    for recipe, proc in zip(RECIPES, runs):
        assert proc.returncode == 0, f"{recipe}: {proc.stderr[-3000:]}"
        results[recipe] = json.loads(proc.stdout.strip().splitlines()[-1])
    return results


@pytest.mark.slow
def test_tiny_preset_json_line_and_learning(tiny_runs):
    for recipe, result in tiny_runs.items():
        for key in ("recipe", "steps", "eval_accuracy_initial", "eval_accuracy_final", "mismatch", "wall_s", "run_dir"):
            assert key in result, (recipe, key)
        assert result["recipe"] == recipe and set(result["mismatch"]) == set(MISMATCH_KEYS)
        assert result["wall_s"] < 180, f"{recipe}: the tiny preset must finish within 3 minutes"
        gain = result["eval_accuracy_final"] - result["eval_accuracy_initial"]
        assert gain >= (0.2 if recipe == "fp8_rollout" else 0.3), (recipe, result)
    bf16_final = tiny_runs["bf16"]["eval_accuracy_final"]
    assert tiny_runs["jet_kv"]["eval_accuracy_final"] >= bf16_final - 0.1, (tiny_runs["jet_kv"], bf16_final)


@pytest.mark.slow
def test_tiny_preset_mismatch_ordering(tiny_runs):
    bf16, off, jet, jet_kv = (tiny_runs[r]["mismatch"] for r in RECIPES)  # RECIPES order
    for on in (jet, jet_kv):
        assert on["rollout_corr/k3_kl"] <= bf16["rollout_corr/k3_kl"] + 1e-6
        assert on["token_mult_prob_error"] <= bf16["token_mult_prob_error"] + 1e-4
    assert off["rollout_corr/k3_kl"] >= max(1e-5, 100 * jet["rollout_corr/k3_kl"])
    assert tiny_runs["jet"]["on_policy"] and tiny_runs["jet_kv"]["on_policy"] and not tiny_runs["fp8_rollout"]["on_policy"]
