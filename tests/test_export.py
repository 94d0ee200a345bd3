"""Checkpoint export (BF16 and fine-grained FP8), FP8 loading with primed weight caches, tokenizers, CLI.

Tiny random Llama checkpoints written by transformers (BF16, with a byte-level BPE tokenizer and
a ChatML template) are the sources. Two shapes: ``aligned`` (every dim a multiple of 128 or a
single block, each of q/k/v and gate/up a multiple of 128 as vLLM merges them, untied head) and
``partial`` (hidden 192, intermediate 320: partial last blocks, tied head). "The codes the trainer
used" are recorded from the quantizer during a training forward after a few optimizer steps under
``jet``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
import transformers  # noqa: E402 (a core dependency)
from safetensors import safe_open

from jetrl.cli import main  # noqa: E402
from jetrl.fp8 import float8_modules, get_recipe, precision_phase, quantize, record_quantization  # noqa: E402
from jetrl.fp8.linear import Float8Linear  # noqa: E402
from jetrl.fp8.quant import Float8Blocks  # noqa: E402
from jetrl.fp8.weight_cache import WeightCache  # noqa: E402
from jetrl.models import CheckpointError, TokenizerError, load_pretrained, load_tokenizer, save_pretrained  # noqa: E402
from jetrl.models.export import export_checkpoint, export_model, resolve_checkpoint  # noqa: E402

from .subprocesses import run_jetrl

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SHAPES = {
    "aligned": {"vocab_size": 384, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 128, "tie_word_embeddings": False},
    "partial": {"vocab_size": 384, "hidden_size": 192, "intermediate_size": 320, "num_hidden_layers": 2,
                "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 64, "tie_word_embeddings": True},
}
TOKENIZER_OUT = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def i32(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.fixture(scope="module")
def hf_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["What is the capital of France? Paris is the capital of France."] * 20, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHATML,
    )


@pytest.fixture(scope="module")
def make_src(tmp_path_factory, hf_tokenizer):
    """shape -> (shape, HF model in bf16, checkpoint dir written by transformers with a tokenizer), cached."""
    made = {}

    def make(shape: str):
        if shape not in made:
            cfg = transformers.LlamaConfig(max_position_embeddings=256, eos_token_id=2, bos_token_id=1,
                                           pad_token_id=0, **SHAPES[shape])
            torch.manual_seed(0)
            hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
            with torch.no_grad():
                for name, p in hf.named_parameters():
                    p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
            hf = hf.to(torch.bfloat16).eval()
            d = tmp_path_factory.mktemp(f"src-{shape}")
            hf.save_pretrained(d)
            hf_tokenizer.save_pretrained(d)
            made[shape] = (shape, hf, d)
        return made[shape]

    return make


@pytest.fixture(params=list(SHAPES))
def src(request, make_src):
    return make_src(request.param)


@pytest.fixture
def aligned(make_src):
    return make_src("aligned")


@pytest.fixture
def partial(make_src):
    return make_src("partial")


def train_jet(d: Path, steps: int = 3):
    """Load ``d`` under ``jet``, take a few AdamW steps; return (model, config, trainer's weight codes)."""
    model, config = load_pretrained(d, dtype=torch.bfloat16, recipe="jet")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    with record_quantization() as log, torch.no_grad():
        model(ids)  # the trainer's next forward quantizes every (updated) weight once
    used = {name.removesuffix(".weight"): q for name, q in log if name.endswith(".weight")}
    assert set(used) == set(float8_modules(model)) and used
    return model, config, used, ids


# ------------------------------------------------------------------------------------------ BF16
def test_bf16_round_trip_is_exact(src, tmp_path):
    shape, hf, d = src
    model, config = load_pretrained(d, dtype=torch.bfloat16)
    summary = export_model(model, config, tmp_path / "bf16", "bf16", tokenizer_from=d)
    assert all(f in summary["tokenizer_files"] for f in TOKENIZER_OUT)
    back, config2 = load_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    ref = hf.state_dict()
    for name, t in back.state_dict().items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, ref[name]), name
    assert config2.to_hf_dict() == config.to_hf_dict()
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        stored = list(f.keys())
        assert ("lm_head.weight" in stored) == (shape == "aligned")  # tied heads are not stored
        assert {f.get_slice(k).get_dtype() for k in stored} == {"BF16"}
    for f in TOKENIZER_OUT:
        assert (tmp_path / "bf16" / f).is_file()
    # transformers reads it back unchanged too.
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    for name, t in again.state_dict().items():
        assert torch.equal(t, ref[name]), name


# ------------------------------------------------------------------------------------------ FP8
@pytest.mark.filterwarnings("ignore:.*end in partial 128x128 blocks")  # expected: the warnings are tested
@pytest.mark.filterwarnings("ignore:.*vLLM loads merged with their siblings")
def test_fp8_export_format(src, tmp_path):
    shape, _, d = src
    model, config, used, _ = train_jet(d)
    out = tmp_path / "fp8"
    export_model(model, config, out, "fp8", tokenizer_from=d)
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"], "ignored_layers": ["lm_head"],
                  "jetrl_recipe": "jet"}
    assert cfg["torch_dtype"] == "bfloat16"
    # transformers' own config class accepts it as is.
    fg = transformers.FineGrainedFP8Config.from_dict(dict(qc))
    assert fg.quant_method == "fp8" and fg.activation_scheme == "dynamic"
    assert list(fg.weight_block_size) == [128, 128] and fg.modules_to_not_convert == ["lm_head"]
    assert fg.scale_fmt == "float" and not fg.dequantize

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        fp8_layers = set(float8_modules(model))
        expected = {n for n in model.state_dict() if not (shape == "partial" and n == "lm_head.weight")}
        expected |= {f"{fqn}.weight_scale_inv" for fqn in fp8_layers}
        assert names == expected
        for name in names:
            t = f.get_tensor(name)
            fqn = name.rsplit(".", 1)[0]
            if fqn in fp8_layers and name.endswith(".weight"):
                assert t.dtype == torch.float8_e4m3fn and torch.equal(u8(t), u8(used[fqn].codes)), name
            elif name.endswith(".weight_scale_inv"):
                rows, cols = model.get_submodule(fqn).weight.shape
                assert t.dtype == torch.float32 and t.shape == ((rows + 127) // 128, (cols + 127) // 128)
                assert torch.equal(i32(t), i32(used[fqn].scales)), name
            else:
                assert t.dtype == torch.bfloat16, name  # embeddings, norms, lm_head
    for f in TOKENIZER_OUT:
        assert (out / f).is_file()


@pytest.mark.filterwarnings("ignore:.*end in partial 128x128 blocks")  # expected: the warnings are tested
@pytest.mark.filterwarnings("ignore:.*vLLM loads merged with their siblings")
def test_fp8_round_trip_is_bit_identical(src, tmp_path):
    """FP8 export -> load: the caches hold the trainer's codes and scales, without re-quantizing."""
    _, _, d = src
    model, config, used, ids = train_jet(d)
    out = tmp_path / "fp8"
    n_before = {fqn: m.weight_cache.num_quantizations for fqn, m in float8_modules(model).items()}
    export_model(model, config, out, "fp8", tokenizer_from=d)
    # The export read the caches: nothing was quantized again.
    assert n_before == {fqn: m.weight_cache.num_quantizations for fqn, m in float8_modules(model).items()}

    loaded, _ = load_pretrained(out, dtype=torch.bfloat16)  # recipe from the file: jet
    layers = float8_modules(loaded)
    assert set(layers) == set(used)
    for fqn, module in layers.items():
        assert module.recipe == get_recipe("jet")
        q = module.quantized_weight()
        assert torch.equal(u8(q.codes), u8(used[fqn].codes)), fqn
        assert torch.equal(i32(q.scales), i32(used[fqn].scales)), fqn
        assert module.weight_cache.num_quantizations == 0, f"{fqn} was re-quantized instead of primed"
        torch.testing.assert_close(module.weight.float(), used[fqn].dequantize().bfloat16().float(), rtol=0, atol=0)

    # Same codes, same BF16 embeddings and norms: the FP8 forwards agree bit for bit.
    with torch.no_grad():
        for phase in ("train", "rollout"):
            with precision_phase(phase):
                assert torch.equal(loaded(ids), model(ids)), phase
    assert all(m.weight_cache.num_quantizations == 0 for m in layers.values())

    # Re-export of the loaded model writes the same tensors (FP8 -> load -> FP8 is a fixed point).
    export_model(loaded, _, tmp_path / "again", "fp8")
    with safe_open(str(out / "model.safetensors"), "pt") as a, safe_open(str(tmp_path / "again" / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():  # noqa: SIM118 (safe_open has no __iter__)
            ta, tb = a.get_tensor(k), b.get_tensor(k)
            assert ta.dtype == tb.dtype and torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)), k

    # The primed entry is keyed on the parameter version: an optimizer step makes it stale.
    module = next(iter(layers.values()))
    with torch.no_grad():
        module.weight.add_(1e-2)
    module.quantized_weight()
    assert module.weight_cache.num_quantizations == 1


def test_fp8_export_loads_in_transformers(aligned, tmp_path):
    """transformers reads our FP8 export: no missing/unexpected keys, same weights -- dequantized where no GPU is
    visible (and then the same fp32 forward), the very codes and scales where one is (transformers keeps FP8 there).

    Only the ``aligned`` shape: on CPU transformers derives the block size as ``dim // n_blocks``,
    which is wrong for partial last blocks (192 rows / 2 blocks -> 96) or raises (576 / 5).
    """
    _, _, d = aligned
    model, config, used, ids = train_jet(d)
    out = tmp_path / "fp8"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # aligned shapes: no partial-block warning, nothing vLLM could not merge
        summary = export_model(model, config, out, "fp8")
        assert summary["partial_block_layers"] == summary["vllm_unmergeable_layers"] == 0
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ours, _ = load_pretrained(out, dtype=torch.float32)
    ours_sd = ours.state_dict()
    kept_fp8 = False
    for name, t in hf.state_dict().items():
        fqn = name.rsplit(".", 1)[0]
        if t.dtype == torch.float8_e4m3fn:  # a machine with a GPU: transformers keeps the FP8 layers as they are
            kept_fp8 = True
            assert torch.equal(u8(t), u8(used[fqn].codes)), name
        elif name.endswith(".weight_scale_inv"):
            assert torch.equal(t, used[fqn].scales), name
        else:
            expected = used[fqn].dequantize() if fqn in used and name.endswith(".weight") else ours_sd[name]
            assert torch.equal(t, expected), name
    if kept_fp8:  # its forward is then its GPU kernel's, not comparable at 1e-4; the CPU-only machine checks it
        return
    # transformers' fp32 forward on the dequantized weights vs our fp32 model from the same file (bf16 recipe).
    plain, _ = load_pretrained(out, dtype=torch.float32, recipe="bf16")
    assert not float8_modules(plain)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids), hf(ids).logits, atol=1e-4, rtol=0)


def test_requantizing_dequantized_weights_is_not_exact():
    """Why load primes the cache instead of re-quantizing the dequantized master (WeightCache.prime)."""
    torch.manual_seed(0)
    # 1. fp32 master -> FP8 -> BF16 master: the block amax 448*s is not a BF16 value, so the scale moves.
    q = quantize(torch.randn(128, 128), (128, 128))
    again = quantize(q.dequantize(torch.bfloat16), (128, 128))
    assert not torch.equal(i32(again.scales), i32(q.scales))
    # 2. power-of-two scales: amax rounds down to code 224 -> re-quantization halves the scale, doubles codes.
    w = (0.1 * torch.randn(128, 128)).clamp(-0.5, 0.5)
    w[0, 0] = 225 / 256
    q = quantize(w, (128, 128), pow2_scale=True)
    again = quantize(q.dequantize(), (128, 128), pow2_scale=True)
    assert torch.equal(q.dequantize(), again.dequantize())
    assert not torch.equal(u8(again.codes), u8(q.codes)) and not torch.equal(i32(again.scales), i32(q.scales))
    # Priming keeps the exact bits.
    recipe = get_recipe("jet", pow2_scale=True)
    layer = Float8Linear.from_float(torch.nn.Linear(128, 128, bias=False), recipe, name="l")
    with torch.no_grad():
        layer.weight.copy_(q.dequantize())
    layer.weight_cache.prime(layer.weight, recipe.rollout.weight, q)
    assert torch.equal(u8(layer.quantized_weight().codes), u8(q.codes))
    assert layer.weight_cache.num_quantizations == 0


def test_prime_rejects_mismatches():
    spec = get_recipe("jet").rollout.weight
    pow2_spec = get_recipe("jet", pow2_scale=True).rollout.weight
    w = torch.randn(256, 192)
    q = quantize(w, (128, 128))
    cache = WeightCache("x.weight")
    cache.prime(w, spec, q)
    assert cache.get(w, spec) is q and cache.num_quantizations == 0
    with pytest.raises(ValueError, match="x.weight: cannot prime.*codes shape"):
        cache.prime(torch.randn(128, 192), spec, q)
    with pytest.raises(ValueError, match="block"):
        cache.prime(w, spec, Float8Blocks(q.codes, q.scales, (1, 128)))
    with pytest.raises(ValueError, match="scales"):
        cache.prime(w, spec, Float8Blocks(q.codes, q.scales[:1], (128, 128)))
    with pytest.raises(ValueError, match="power-of-two"):
        cache.prime(w, pow2_spec, q)
    bad = q.scales.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        cache.prime(w, spec, Float8Blocks(q.codes, bad, (128, 128)))


def test_fp8_checkpoint_loading_options_and_errors(partial, tmp_path):
    _, _, d = partial
    model, config, used, _ = train_jet(d, steps=1)
    out = tmp_path / "fp8"
    # partial 128x128 blocks: exported (and read back below) exactly, with a warning about transformers' CPU reader
    with pytest.warns(UserWarning, match="end in partial 128x128 blocks.*transformers' CPU dequantization"), \
            pytest.warns(UserWarning, match="vLLM loads merged with their siblings .* not a multiple of 128"):
        summary = export_model(model, config, out, "fp8")
    assert summary["partial_block_layers"] > 0
    assert summary["vllm_unmergeable_layers"] == 10  # per layer q (192), k, v (64), gate, up (320)
    # recipe="bf16": plain dequantized weights.
    plain, cfg = load_pretrained(out, dtype=torch.float32, recipe="bf16")
    assert not float8_modules(plain)
    for fqn, q in used.items():
        assert torch.equal(plain.get_submodule(fqn).weight, q.dequantize())
    # A BF16 save of an FP8-loaded model is a plain BF16 checkpoint.
    save_pretrained(plain, cfg, tmp_path / "plain")
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    # fp8_rollout: the FP8 weights are primed for the rollout, training stays BF16.
    roll, _ = load_pretrained(out, recipe="fp8_rollout")
    for fqn, m in float8_modules(roll).items():
        assert torch.equal(u8(m.quantized_weight().codes), u8(used[fqn].codes))
    # Broken files fail with the name of what is wrong.
    from safetensors.torch import load_file, save_file

    state = load_file(str(out / "model.safetensors"))
    victim = next(k for k in state if k.endswith("weight_scale_inv"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((out / "config.json").read_text())
    save_file({k: v for k, v in state.items() if k != victim}, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match="without weight_scale_inv"):
        load_pretrained(broken)
    # bf16 / fp16 scales (Qwen3's FP8 hub checkpoints store bf16 ones) load as the exact fp32 they widen to
    for dtype in (torch.bfloat16, torch.float16):
        narrow = {k: v.to(dtype) if k.endswith("weight_scale_inv") else v for k, v in state.items()}
        save_file(narrow, str(broken / "model.safetensors"))
        (broken / "config.json").write_text((out / "config.json").read_text())
        loaded, _ = load_pretrained(broken, dtype=torch.float32, recipe="bf16")
        for fqn, q in used.items():
            scales = q.scales.to(dtype).float()
            assert torch.equal(loaded.get_submodule(fqn).weight, Float8Blocks(q.codes, scales, (128, 128)).dequantize(
                torch.float32)), (dtype, fqn)
    save_file({k: v.to(torch.float64) if k == victim else v for k, v in state.items()},
              str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match="needs float32 \\(or bfloat16 / float16\\)"):
        load_pretrained(broken)
    cfg_json = json.loads((out / "config.json").read_text())
    cfg_json["quantization_config"]["weight_block_size"] = [1, 128]
    (broken / "config.json").write_text(json.dumps(cfg_json))
    with pytest.raises(CheckpointError, match="weight_block_size"):
        load_pretrained(broken)
    cfg_json["quantization_config"] = {"quant_method": "awq"}
    (broken / "config.json").write_text(json.dumps(cfg_json))
    with pytest.raises(CheckpointError, match="'awq' is not supported"):
        load_pretrained(broken)


# ------------------------------------------------------------------------------------------ tokenizer
def test_tokenizer(src, tmp_path, hf_tokenizer):
    _, _, d = src
    tok = load_tokenizer(d)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages)
    text = tok.chat_prompt(messages)
    assert text.endswith("<|im_start|>assistant\n") and ids == tok.encode(text)
    # transformers' call shape works too (code written for an HF tokenizer takes ours).
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text
    assert tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"] == ids
    assert tok.chat_template == CHATML
    assert ids == hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                   return_dict=False)
    assert tok.decode(tok.encode("Paris is nice")) == "Paris is nice"
    assert tok.eos_token_id == hf_tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert tok.pad_token_id == 0 and not tok.pad_is_eos
    assert tok.stop_token_ids == [2] and tok.is_stop(2) and not tok.is_stop(0)
    assert tok.decode([*tok.encode("hi"), tok.eos_token_id]) == "hi"
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="no tokenizer in .*tokenizer.json"):
        load_tokenizer(tmp_path / "empty")
    # generation_config.json's eos ids are stop tokens; a saved tokenizer (a training checkpoint's) keeps them
    multi = tmp_path / "multi"
    shutil.copytree(d, multi)
    (multi / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    tok = load_tokenizer(multi)
    assert tok.stop_token_ids == [2, 7]
    tok.save(tmp_path / "saved")
    assert load_tokenizer(tmp_path / "saved").stop_token_ids == [2, 7]
    with pytest.raises(TokenizerError, match="not a directory"):
        load_tokenizer(tmp_path / "nope")


# ------------------------------------------------------------------------------------------ --run
def test_resolve_checkpoint_layouts(aligned, tmp_path):
    _, _, d = aligned
    assert resolve_checkpoint(d) == d
    run = tmp_path / "run"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "checkpoints" / "step_10").mkdir()
    for step in ("step_2", "step_10"):
        (run / "checkpoints" / step / "config.json").write_text("{}")
    assert resolve_checkpoint(run) == run / "checkpoints" / "step_10"  # numeric, not lexical
    (run / "checkpoints" / "latest").write_text("step_2\n")
    assert resolve_checkpoint(run) == run / "checkpoints" / "step_2"
    (run / "checkpoints" / "latest").unlink()
    os.symlink("step_2", run / "checkpoints" / "latest")
    assert resolve_checkpoint(run) == (run / "checkpoints" / "step_2").resolve()
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither a checkpoint directory"):
        resolve_checkpoint(tmp_path / "empty")


def test_export_checkpoint_from_run_dir(aligned, tmp_path):
    """A run dir whose checkpoints/latest points at an HF dir exports like the dir itself."""
    _, _, d = aligned
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    os.symlink(d, run / "checkpoints" / "latest")
    summary = export_checkpoint(run, tmp_path / "out", "fp8")
    assert Path(summary["source"]) == Path(d).resolve() and summary["fp8_layers"] == 14
    with pytest.raises(CheckpointError, match="is the source checkpoint"):
        export_checkpoint(d, d, "bf16")
    busy = tmp_path / "busy"  # a training checkpoint, a run dir, an earlier export: never overwritten
    busy.mkdir()
    (busy / "model.safetensors").write_text("not ours")
    with pytest.raises(CheckpointError, match="is not empty; export into a new or empty directory"):
        export_checkpoint(d, busy, "bf16")
    assert (busy / "model.safetensors").read_text() == "not ours"


# ------------------------------------------------------------------------------------------ CLI
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_cli_export(aligned, tmp_path, capsys, fmt):
    _, hf, d = aligned
    out = tmp_path / fmt
    assert main(["export", "--run", str(d), "--format", fmt, "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["format"] == fmt and summary["out"] == str(out)
    cfg = json.loads((out / "config.json").read_text())
    assert ("quantization_config" in cfg) == (fmt == "fp8")
    for f in TOKENIZER_OUT:
        assert (out / f).is_file()
    model, _ = load_pretrained(out)
    assert bool(float8_modules(model)) == (fmt == "fp8")
    if fmt == "fp8":
        # From a BF16 checkpoint the codes are q(master), the trainer's weight cache at step 0.
        for fqn, m in float8_modules(model).items():
            ref = quantize(hf.get_submodule(fqn).weight, (128, 128))
            assert torch.equal(u8(m.quantized_weight().codes), u8(ref.codes))
            assert torch.equal(i32(m.quantized_weight().scales), i32(ref.scales))


EXPORT_ERRORS = [
    (["--run", "{tmp}/missing", "--format", "bf16"], "does not exist"),
    (["--run", "{src}", "--format", "fp4"], "unknown --format 'fp4'; choose one of bf16, fp8"),
    (["--run", "{src}", "--format", "fp8", "--recipe", "fp4"], "unknown recipe 'fp4'"),
    (["--run", "{src}", "--format", "fp8", "--recipe", "bf16"], "has no FP8 weights; export with --format bf16"),
]


@pytest.fixture(scope="module")
def export_errors(make_src, tmp_path_factory) -> list[subprocess.CompletedProcess]:
    """Every command of EXPORT_ERRORS, side by side (tests/subprocesses.py)."""
    src, tmp = make_src("aligned")[2], tmp_path_factory.mktemp("export-errors")
    return run_jetrl(*(["export", *(a.format(tmp=tmp, src=src) for a in args), "--out", str(tmp / f"out{i}")]
                       for i, (args, _) in enumerate(EXPORT_ERRORS)))


@pytest.mark.parametrize("case", range(len(EXPORT_ERRORS)), ids=[message for _, message in EXPORT_ERRORS])
def test_cli_export_errors_are_one_line(export_errors, case):
    message, proc = EXPORT_ERRORS[case][1], export_errors[case]
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jetrl export: error: ") and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
