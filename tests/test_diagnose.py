"""The per-layer rollout-vs-trainer diagnosis (jetrl/rl/diagnose.py), the engine's teacher-forced ``score`` it rests
on, and ``jetrl diagnose``. CPU: the emulated FP8 is batch-invariant, so the on-policy recipes must agree bit for
bit at every site, and the off-policy ones must first diverge where only the rollout quantizes."""

import json

import pytest
import torch

from jetrl import fp8
from jetrl.engine import Engine, SamplingParams
from jetrl.rl.diagnose import KINDS, SITES, diagnose, format_report
from jetrl.rl.metrics import MISMATCH_KEYS
from tests.engine_helpers import random_prompts, tiny_model


def _sampled(recipe: str, max_len: int = 40):
    """An engine over a converted tiny Qwen3 and 6 completions it sampled (3 prompts x 2, 12 tokens, T = 1)."""
    model = tiny_model("qwen3")
    if recipe != "bf16":
        model = fp8.convert_to_float8(model, fp8.get_recipe(recipe))
    engine = Engine(model, max_slots=8, max_len=max_len)
    prompts = random_prompts([5, 9, 3])
    groups = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=3))
    pairs = [(p, c) for p, group in zip(prompts, groups) for c in group]
    return engine, [p for p, _ in pairs], [c.token_ids for _, c in pairs], [c.logprobs for _, c in pairs]


@pytest.mark.parametrize("recipe", ["bf16", "jet", "jet_kv"])
def test_score_reproduces_the_rollouts_logprobs_and_maps_every_position_once(recipe):
    engine, prompts, completions, sampled = _sampled(recipe)
    seen = []
    scored = engine.score(prompts, completions, after_forward=lambda rows, pos: seen.extend(
        (int(r), int(p)) for r, row in zip(rows, pos) for p in row if p >= 0))
    for s, lp, c in zip(scored, sampled, completions):
        assert s.shape == (len(c),) and s.dtype == torch.float32
        torch.testing.assert_close(s, torch.tensor(lp), atol=2e-6, rtol=0)  # the sampler's logprob to its rounding
    # the prefill's prompt positions and one decode step per completion token but the last, each once
    expected = sorted((b, t) for b, (p, c) in enumerate(zip(prompts, completions)) for t in range(len(p) + len(c) - 1))
    assert sorted(seen) == expected
    assert engine.score(prompts[:1], [completions[0][:1]])[0].shape == (1,)  # a one-token completion: prefill only


@pytest.mark.parametrize("recipe", ["jet", "jet_kv"])
def test_on_policy_recipes_agree_site_by_site(recipe):
    engine, prompts, completions, _ = _sampled(recipe)
    report = diagnose(engine, prompts, completions)
    assert report["first_divergence"] is None, format_report(report)
    assert len(report["layers"]) == 2 and report["num_pairs"] == 6 and report["num_completion_tokens"] == 72
    for row in report["layers"]:
        for kind in KINDS:
            for site in SITES:
                gap = row[kind][site]
                assert gap["equal"] and gap["rel"] == 0 and gap["max_abs"] == 0 and gap["positions"] > 0
    assert set(report["mismatch"]) == set(MISMATCH_KEYS)
    assert report["logprob_max_abs_diff"] < 1e-5  # the lm_head at another row count and log_softmax: fp32 rounding
    json.dumps(report)  # JSON-ready


@pytest.mark.parametrize("recipe", ["fp8kv_rollout", "fp8_rollout"])
def test_off_policy_recipes_diverge_first_where_only_the_rollout_quantizes(recipe):
    engine, prompts, completions, _ = _sampled(recipe)
    report = diagnose(engine, prompts, completions)
    # fp8kv_rollout: only the rollout's K/V are FP8, read back by the first attention; fp8_rollout: only the
    # rollout's projections are FP8, the first of them (q/k/v) feeding the first attention too
    assert report["first_divergence"] == {"layer": 0, "site": "attn_core", "kind": "prompt"}, format_report(report)
    first = report["layers"][0]
    assert first["prompt"]["attn_core"]["rel"] > 1e-3 and first["completion"]["attn_core"]["rel"] > 1e-3
    assert report["mismatch"]["training/rollout_probs_diff_max"] > 1e-3
    text = format_report(report)
    assert "first divergence: layer 0, attn_core, prompt positions" in text and "rollout_corr/kl" in text


def test_bf16_differs_only_by_attention_rounding_at_decode_positions():
    engine, prompts, completions, _ = _sampled("bf16")
    report = diagnose(engine, prompts, completions)
    for row in report["layers"]:
        assert all(row["prompt"][site]["equal"] for site in SITES)  # the prefill is the trainer's forward
        assert all(row["completion"][site]["rel"] < 1e-5 for site in SITES)  # cached decode attention: fp32 ulps


def test_bad_input_is_refused_with_what_to_change():
    engine, prompts, completions, _ = _sampled("jet", max_len=24)
    with pytest.raises(ValueError, match="one completion per prompt"):
        engine.score(prompts, completions[:2])
    with pytest.raises(ValueError, match="pair 0: prompt .* must be non-empty"):
        engine.score([prompts[0]], [[]])
    with pytest.raises(ValueError, match=r"exceed the engine's max_len=24; build the Engine with max_len >= 25"):
        engine.score([prompts[0][:5] * 3], [completions[0][:10]])
    with pytest.raises(ValueError, match="temperature > 0"):
        engine.score(prompts, completions, temperature=0.0)
    with pytest.raises(ValueError, match="exceeds max_slots=8"):
        engine.score(prompts * 2, completions * 2)
    with pytest.raises(ValueError, match=r"pair 0 holds token ids outside \[0, "):
        engine.score([prompts[0]], [[engine.config.vocab_size]])
    context = engine.config.max_position_embeddings
    engine.config.max_position_embeddings = len(prompts[0])  # as generate: past the context RoPE gives garbage
    try:
        with pytest.raises(ValueError, match=rf"need {len(prompts[0]) + 1} positions, more than the model's context"):
            engine.score([prompts[0]], [completions[0][:2]])
    finally:
        engine.config.max_position_embeddings = context
    with pytest.raises(ValueError, match="one completion per prompt"):
        diagnose(engine, prompts, completions[:1])
    with pytest.raises(TypeError, match="needs a jetrl.models.CausalLM"):
        diagnose(type("E", (), {"model": torch.nn.Linear(2, 2)})(), prompts, completions)


def test_cli_prints_the_table_and_a_json_line(tmp_path, capsys):
    from jetrl.cli import main
    from jetrl.models import save_pretrained
    from jetrl.models.llama import CausalLM
    from jetrl.models.tiny import build_tiny_tokenizer, tiny_model_config

    torch.manual_seed(0)
    save_pretrained(CausalLM(tiny_model_config()), tiny_model_config(), tmp_path, dtype=torch.float32)
    build_tiny_tokenizer().save_pretrained(str(tmp_path))
    argv = ["diagnose", "--model", str(tmp_path), "--prompt", "12+30=", "--raw", "--n", "2", "--max-tokens", "4",
            "--device", "cpu"]  # the CPU's bit-exact claim holds on a GPU machine too
    assert main([*argv, "--recipe", "fp8kv_rollout"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["recipe"] == "fp8kv_rollout" and result["first_divergence"]["site"] == "attn_core"
    assert any(line.startswith("first divergence: layer 0") for line in out)
    assert main([*argv, "--recipe", "jet_kv"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["first_divergence"] is None
    assert main([*argv, "--recipe", "jet_kv", "--exact"]) == 0  # exact mode: the sampler reports the trainer's bits
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["exact"] is True and result["logprob_max_abs_diff"] == 0.0
    assert main([*argv, "--temperature", "0"]) == 2  # a one-line error, no traceback
    assert "must be > 0" in capsys.readouterr().err
    assert main([*argv[:-2], "--device", "tpu"]) == 2
    assert "use 'cpu' or 'cuda'" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_engines_kernels_and_graphs_keep_the_comparison_sound():
    """BF16 on CUDA: the decode kernels, the FP8 KV cache and eager decode steps (with hooks) against the trainer's
    forward. The kernels differ from the trainer's, so sites need not be bit-identical; every gap must be finite,
    every position compared, and the off-policy K/V gap larger than ``jet``'s."""
    from jetrl.bench.models import random_model, set_recipe
    from tests.engine_helpers import LOGPROB_CONFIG

    model = random_model(LOGPROB_CONFIG, torch.device("cuda"), torch.bfloat16).requires_grad_(False)
    prompts = random_prompts([7, 20, 33], vocab=LOGPROB_CONFIG.vocab_size)
    reports = {}
    for recipe in ("jet", "jet_kv", "fp8kv_rollout"):
        set_recipe(model, recipe)
        engine = Engine(model, max_slots=8, max_len=64)
        groups = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=5))
        completions = [c.token_ids for group in groups for c in group]
        reports[recipe] = report = diagnose(engine, [p for p in prompts for _ in range(2)], completions)
        print(f"\n== {recipe}\n{format_report(report)}")
        assert report["num_completion_tokens"] == 6 * 16
        for row in report["layers"]:
            for kind in KINDS:
                for site in SITES:
                    gap = row[kind][site]
                    assert gap["positions"] > 0 and gap["rel"] == gap["rel"] and gap["rel"] < 1, (recipe, row)
    assert (reports["fp8kv_rollout"]["mismatch"]["training/rollout_probs_diff_mean"]
            > reports["jet"]["mismatch"]["training/rollout_probs_diff_mean"])
