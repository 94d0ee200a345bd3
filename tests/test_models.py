"""Parity of jetrl.models against HF transformers on tiny random checkpoints, plus loader I/O.

All comparisons run in fp32 on CPU. Tolerances: logits vs HF <= 1e-4 abs (same math,
different op order in SDPA vs eager softmax); incremental decode vs full forward
<= 1e-5 abs (same kernels, different attention shapes); save/load round trips are exact.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # noqa: E402 (a core dependency)
from safetensors.torch import load_file, save_file

from jetrl.models import CausalLM, ModelConfig, load_pretrained, save_pretrained  # noqa: E402
from jetrl.models.loader import CheckpointError  # noqa: E402

HF_ATOL = 1e-4
DECODE_ATOL = 1e-5
TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)
# original_max_position_embeddings=32 puts head_dim=16 frequencies in all three llama3 bands.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
CASES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama-tied-llama3": ("LlamaConfig", dict(tie_word_embeddings=True, rope_scaling=LLAMA3, rope_theta=10000.0)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen2-tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=16)),
    "qwen3-tied-wide-head": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=32)),  # heads*head_dim != hidden
}


def make_hf(case: str) -> torch.nn.Module:
    cls_name, kw = CASES[case]
    cfg = getattr(transformers, cls_name)(**TINY, **kw)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # HF zero-inits biases and one-inits norms; randomize so every term is exercised
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return hf.eval()


@pytest.fixture(scope="module", params=list(CASES))
def hf_dir(request, tmp_path_factory):
    hf = make_hf(request.param)
    d = tmp_path_factory.mktemp(request.param)
    # Shard the llama checkpoint so the index path is covered too.
    hf.save_pretrained(d, max_shard_size="40KB" if request.param == "llama" else "5GB")
    return request.param, hf, d


def valid_positions_close(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, atol: float) -> None:
    keep = mask.bool()
    torch.testing.assert_close(a[keep], b[keep], atol=atol, rtol=0)


def test_logits_match_hf(hf_dir):
    case, hf, d = hf_dir
    model, config = load_pretrained(d, dtype=torch.float32)
    assert set(model.state_dict()) == set(hf.state_dict())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == config.tie_word_embeddings
    if case == "llama":
        assert (d / "model.safetensors.index.json").is_file()

    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, ref = model(ids), hf(ids).logits
        torch.testing.assert_close(ours, ref, atol=HF_ATOL, rtol=0)
        torch.testing.assert_close(model.logits_from_hidden(model.hidden_states(ids)), ours, atol=0, rtol=0)

        # Left-padded batch: HF gets the same mask and the same cumsum position ids.
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        mask[1, :1] = 0
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        ours = model(ids, attention_mask=mask)
        assert torch.isfinite(ours).all()
        valid_positions_close(ours, hf(ids, attention_mask=mask, position_ids=pos).logits, mask, HF_ATOL)
        # ... and a padded row equals the same tokens run alone.
        torch.testing.assert_close(ours[0, 3:], model(ids[:1, 3:])[0], atol=DECODE_ATOL, rtol=0)


def test_right_padding_matches_unpadded():
    case_hf = make_hf("qwen3")
    config = ModelConfig.from_hf_dict(case_hf.config.to_dict())
    model = CausalLM(config).eval()
    model.load_state_dict(case_hf.state_dict())
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
        torch.testing.assert_close(out[1, :5], model(ids[1:, :5])[0], atol=DECODE_ATOL, rtol=0)
        torch.testing.assert_close(out[0], model(ids[:1])[0], atol=DECODE_ATOL, rtol=0)


def test_round_trip_and_hf_reads_our_checkpoint(hf_dir, tmp_path):
    case, hf, d = hf_dir
    model, config = load_pretrained(d, dtype=torch.float32)
    save_pretrained(model, config, tmp_path / "fp32", dtype=torch.float32, max_shard_bytes=30_000)
    assert (tmp_path / "fp32" / "model.safetensors.index.json").is_file()
    files = {k for f in (tmp_path / "fp32").glob("*.safetensors") for k in load_file(f)}
    assert ("lm_head.weight" in files) != config.tie_word_embeddings  # HF convention: tied head omitted

    again, config2 = load_pretrained(tmp_path / "fp32", dtype=torch.float32)
    assert config2 == config
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    hf2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32).eval()
    ids = torch.randint(0, TINY["vocab_size"], (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf2(ids).logits, hf(ids).logits, atol=HF_ATOL, rtol=0)

    # Default bf16 save: tensors are the exact bf16 casts; config records the dtype.
    save_pretrained(model, config, tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    bf, _ = load_pretrained(tmp_path / "bf16")
    assert all(torch.equal(v, a[k].to(torch.bfloat16)) for k, v in bf.state_dict().items())


def test_config_round_trip():
    for case in CASES:
        cfg = make_hf(case).config
        ours = ModelConfig.from_hf_dict(cfg.to_dict())  # transformers-5 layout (rope_parameters)
        assert ModelConfig.from_hf_dict(ours.to_hf_dict()) == ours  # legacy layout (rope_theta/rope_scaling)
        assert ours.head_dim == (getattr(cfg, "head_dim", None) or 16)
    assert ModelConfig.from_hf_dict(make_hf("llama-tied-llama3").config.to_dict()).rope_type == "llama3"


class ConcatCache:
    """Minimal KVCache: concatenates along the sequence axis."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    @property
    def offset(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx in self.k:
            k = torch.cat([self.k[layer_idx], k], dim=2)
            v = torch.cat([self.v[layer_idx], v], dim=2)
        self.k[layer_idx], self.v[layer_idx] = k, v
        return k, v


@pytest.mark.parametrize("case", ["llama-tied-llama3", "qwen3"])
def test_incremental_decode_matches_full_forward(case):
    hf = make_hf(case)
    model = CausalLM(ModelConfig.from_hf_dict(hf.config.to_dict())).eval()
    model.load_state_dict(hf.state_dict())
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(4))
    chunks = [(0, 4), (4, 7), *((t, t + 1) for t in range(7, 11))]  # prefill, chunked prefill, decode
    with torch.no_grad():
        full = model(ids)
        cache = ConcatCache()
        steps = [model(ids[:, a:b], kv_cache=cache) for a, b in chunks]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=DECODE_ATOL, rtol=0)

        # Left-padded batch: the mask covers past + current tokens at every step.
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        full = model(ids, attention_mask=mask)
        cache = ConcatCache()
        steps = [model(ids[:, a:b], attention_mask=mask[:, :b], kv_cache=cache) for a, b in chunks]
        valid_positions_close(torch.cat(steps, dim=1), full, mask, DECODE_ATOL)


# ----------------------------------------------------------------------------- errors
@pytest.fixture()
def llama_dir(tmp_path):
    make_hf("llama").save_pretrained(tmp_path)
    return tmp_path


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_pretrained(tmp_path)


def test_config_json_without_a_required_key_names_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64}))
    with pytest.raises(CheckpointError, match="config.json has no 'vocab_size', which an HF config"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(CheckpointError, match="must hold a JSON object"):
        load_pretrained(tmp_path)


def test_missing_weights(llama_dir):
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_pretrained(llama_dir)


def test_unknown_architecture(llama_dir):
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel.*LlamaForCausalLM, Qwen2ForCausalLM"):
        load_pretrained(llama_dir)


def test_missing_tensor(llama_dir):
    f = llama_dir / "model.safetensors"
    sd = load_file(f)
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_pretrained(llama_dir)


def test_shape_mismatch(llama_dir):
    f = llama_dir / "model.safetensors"
    sd = load_file(f)
    sd["model.norm.weight"] = torch.ones(63)
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"shape mismatch for 'model\.norm\.weight'.*\(63,\).*\(64,\)"):
        load_pretrained(llama_dir)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (dict(num_attention_heads=5), "does not divide hidden_size"),
        (dict(num_key_value_heads=3), "num_key_value_heads=3"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "'yarn' is not supported"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "missing"),
        (dict(architecture="MistralForCausalLM"), "MistralForCausalLM"),
    ],
)
def test_config_validation(override, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**TINY, **override})


def test_an_unwritable_tiny_cache_is_one_error_before_any_build(tmp_path):
    """JETRL_CACHE at a file (or a directory that cannot be written): one OSError naming the variable, before the
    tiny start's SFT runs (seed 1: the shipped start is seed 0's, which needs no cache)."""
    from jetrl.models.tiny.cache import tiny_start_checkpoint

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(OSError, match=r"tiny start's cache .*a_file.* cannot be written \(.*a_file is a file\): "
                                      r"point JETRL_CACHE"):
        tiny_start_checkpoint(blocker / "cache", seed=1)
