"""The tiny adder start policy: its character tokenizer and chat template, the FP8-friendly
config, the SFT data, the atomic cache, a real (shortened) build, and the shipped start's held-out accuracies.

Bounds of the slow test on the shipped start, from measurements (package docstring of jetrl.models.tiny): seed 0
gave greedy 0-3% and sampled 28-32% in three builds; 8 seeds gave greedy <= 10.5%, sampled
25-32%, >= 85% of samples in {S, S + 10}. The test allows greedy <= 15%, sampled in [18%, 42%]
(p = 0.3 plus sampling noise and seed spread), >= 80% of samples in {S, S + 10}, >= 95%
well-formed.
"""

import dataclasses
import json
import random
import time

import pytest
import torch

from jetrl.data import BOXED_INSTRUCTION
from jetrl.fp8.convert import default_module_filter
from jetrl.models import CausalLM, load_pretrained, load_tokenizer, tiny
from jetrl.models.tiny import (
    CHAT_TEMPLATE,
    TinySFTConfig,
    build_tiny_tokenizer,
    evaluate_tiny,
    tiny_model_config,
    tiny_start_checkpoint,
    tiny_start_dir,
    tiny_task_split,
)

TEXTS = [
    "What is 23 + 58?",
    "What is 0 + 99?\n" + BOXED_INSTRUCTION,
    "\\boxed{81}",
    "  two  spaces, tabs-free; (punct) [x] {y} <z> 'q' \"d\" ~!@#$%^&*_=|/`:",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz 0123456789",
]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_one_token_per_character(tok):
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == len(text)
        assert tok.decode(ids) == text
        assert tok.unk_token_id not in ids
    for special in ("<|user|>", "<|assistant|>", "<|end|>", "<pad>"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1
    assert tok.eos_token == "<|end|>" and tok.pad_token == "<pad>"


def test_chat_template_prompt(tok):
    messages = [{"role": "user", "content": "What is 23 + 58?"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|user|>What is 23 + 58?<|end|><|assistant|>"
    )
    full = messages + [{"role": "assistant", "content": "\\boxed{81}"}]
    assert tok.apply_chat_template(full, tokenize=False) == (
        "<|user|>What is 23 + 58?<|end|><|assistant|>\\boxed{81}<|end|>"
    )
    system = [{"role": "system", "content": "Add."}, *messages]
    prompt = tok.apply_chat_template(system, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|system|>Add.<|end|><|user|>What is 23 + 58?<|end|><|assistant|>"
    with pytest.raises(Exception, match="roles"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_tokenizer_saves_and_loads_offline(tok, tmp_path):
    tok.save_pretrained(str(tmp_path))
    loaded = load_tokenizer(tmp_path)
    assert loaded.chat_template == CHAT_TEMPLATE
    prompt = loaded.chat_prompt([{"role": "user", "content": "What is 1 + 2?"}])
    assert prompt == "<|user|>What is 1 + 2?<|end|><|assistant|>"
    for text in TEXTS:
        assert loaded.encode(text) == tok.encode(text, add_special_tokens=False)
        assert loaded.decode(loaded.encode(text)) == text
    assert loaded.stop_token_ids == [tok.eos_token_id] and not loaded.pad_is_eos
    assert loaded.pad_token_id == tok.pad_token_id


# ---------------------------------------------------------------- model config and data


def test_config_is_fp8_friendly(tok):
    cfg = tiny_model_config(len(tok))
    assert cfg.vocab_size % 16 == 0 and cfg.vocab_size >= len(tok)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads) == (128, 4, 32, 2)
    assert cfg.eos_token_id == tok.eos_token_id and cfg.pad_token_id == tok.pad_token_id
    model = CausalLM(cfg)
    linears = {fqn for fqn, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    converted = {fqn for fqn, m in model.named_modules() if default_module_filter(m, fqn)}
    assert converted == linears - {"lm_head"}  # every projection becomes FP8; the head stays high precision
    assert len(converted) == 7 * cfg.num_hidden_layers
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


def test_split_is_disjoint_up_to_swaps():
    train, held_out = tiny_task_split()
    assert len(train) + len(held_out) == 5050 and len(held_out) == tiny.NUM_EVAL

    def key(r):
        a, b = tiny.task._operands(r)
        return min(a, b), max(a, b)

    assert not {key(r) for r in train} & {key(r) for r in held_out}
    assert tiny_task_split() == (train, held_out)
    assert tiny_task_split(200)[1] == held_out[:200]  # a smaller eval set is a prefix


def test_sft_examples_put_the_loss_on_the_answer_only(tok):
    train, _ = tiny_task_split()
    cfg = TinySFTConfig()
    data = tiny.sft._SFTData(tok, train[:50], cfg)
    ids, tgt, alt, w = data.batch(random.Random(0), 64)
    for row in range(64):
        mask = tgt[row] != -100
        answer = tok.decode(tgt[row][mask].tolist(), skip_special_tokens=False)
        prompt = tok.decode(ids[row][: int(mask.nonzero()[0]) + 1].tolist(), skip_special_tokens=False)
        a, b = map(int, prompt.removeprefix("<|user|>What is ").removesuffix("?<|end|><|assistant|>").split(" + "))
        assert answer in (f"\\boxed{{{a + b}}}<|end|>", f"\\boxed{{{a + b + 10}}}<|end|>")
        # exactly one position carries the other answer's token, with the other answer's probability
        (pos,) = (alt[row] != tgt[row]).nonzero()[:, 0].tolist()
        right = answer == f"\\boxed{{{a + b}}}<|end|>"
        assert w[row, pos].item() == pytest.approx(1 - cfg.p_correct if right else cfg.p_correct)
        assert w[row][mask].sum().item() == w[row].sum().item()


# ---------------------------------------------------------------- cache (fake build)


def _fake_build(calls):
    def build(out_dir, *, seed, sft, **_):
        calls.append(seed)
        model = CausalLM(tiny_model_config())
        from jetrl.models import save_pretrained

        save_pretrained(model, model.config, out_dir, dtype=torch.float32)
        build_tiny_tokenizer().save_pretrained(str(out_dir))
        meta = {"kind": tiny.TINY_KIND, "version": tiny.TINY_VERSION, "seed": seed,
                "sft": json.loads(json.dumps(dataclasses.asdict(sft))), "greedy": {"accuracy": 0.0},
                "sampled": {"accuracy": 0.3}}
        (out_dir / tiny.META_NAME).write_text(json.dumps(meta))
        return meta

    return build


def test_cache_is_reused_rebuilt_when_incomplete_and_never_half_written(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(tiny.cache, "train_tiny_start", _fake_build(calls))  # where tiny_start_checkpoint reads it
    path = tiny_start_checkpoint(tmp_path, seed=3)
    assert path == tiny_start_dir(tmp_path, seed=3) == tmp_path / "tiny-adder-v1-seed3"
    assert calls == [3] and load_pretrained(path)[1].vocab_size == 112
    assert tiny_start_checkpoint(tmp_path, seed=3) == path and calls == [3]  # cached
    tiny_start_checkpoint(tmp_path, seed=3, force=True)
    assert calls == [3, 3]
    (path / "model.safetensors").unlink()  # damaged cache -> rebuilt
    tiny_start_checkpoint(tmp_path, seed=3)
    assert calls == [3, 3, 3] and (path / "model.safetensors").is_file()
    other = tiny_start_checkpoint(tmp_path, seed=3, sft=TinySFTConfig(p_correct=0.2))
    assert other != path and other.name.startswith("tiny-adder-v1-seed3-")

    def killed(out_dir, **_):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny.cache, "train_tiny_start", killed)
    with pytest.raises(KeyboardInterrupt):
        tiny_start_checkpoint(tmp_path, seed=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, other.name])  # no half-written dir


# ---------------------------------------------------------------- the shipped start and a real build


def test_the_shipped_start_is_the_default_build_and_is_used_as_is(tmp_path):
    # the cache's own validity check (kind, version, seed, SFT config), asked first: a stale copy would start a build
    assert tiny.cache._is_complete(tiny.cache.SHIPPED_DIR, 0, TinySFTConfig()), (
        "the shipped tiny start no longer matches the default build: rebuild it with `python -c 'from "
        "jetrl.models.tiny import tiny_start_checkpoint as t; print(t(force=True))'` and copy that directory over "
        "jetrl/models/tiny/start/")
    path = tiny_start_checkpoint(tmp_path / "cache")
    assert path == tiny.cache.SHIPPED_DIR and not (tmp_path / "cache").exists()  # nothing built, nothing written
    assert json.loads((path / "tiny_start.json").read_text())["split"]["num_eval"] == tiny.NUM_EVAL
    _, config = load_pretrained(path, dtype=torch.float32)
    assert config.vocab_size == 112 and config.eos_token_id == load_tokenizer(path).eos_token_id
    assert load_tokenizer(path).chat_template == build_tiny_tokenizer().chat_template


def test_a_real_build_of_another_config_is_cached_and_loads(tmp_path):
    """The SFT itself, shortened: another config builds into the cache once, and ``force`` builds it again to the same
    bits, whichever thread count the tuner picked for each step."""
    sft = TinySFTConfig(steps=6, batch_size=32, warmup_steps=2, eval_problems=4, eval_samples=1)  # threads tuned
    threads = torch.get_num_threads()
    path = tiny_start_checkpoint(tmp_path, sft=sft)
    assert torch.get_num_threads() == threads
    assert path.parent == tmp_path and path.name.startswith("tiny-adder-v1-seed0-")
    weights = (path / "model.safetensors").read_bytes()
    stamps = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    t0 = time.perf_counter()
    assert tiny_start_checkpoint(tmp_path, sft=sft) == path
    assert time.perf_counter() - t0 < 2.0 and {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == stamps
    meta = json.loads((path / "tiny_start.json").read_text())
    assert meta["sft"]["steps"] == 6 and meta["greedy"]["n"] == 4
    assert sum(meta["sft_steps_per_thread_count"].values()) == 6  # the tuner timed its candidates on real steps
    _, config = load_pretrained(path, dtype=torch.float32)
    assert config.num_hidden_layers == sft.num_hidden_layers
    assert tiny_start_checkpoint(tmp_path, sft=sft, force=True) == path
    assert (path / "model.safetensors").read_bytes() == weights  # deterministic on one machine


@pytest.mark.slow
def test_tiny_start_is_wrong_greedily_and_right_when_sampling():
    path = tiny_start_checkpoint()  # the shipped start
    model, _ = load_pretrained(path, dtype=torch.float32)
    tokenizer = load_tokenizer(path)
    held_out = tiny_task_split()[1][:200]
    greedy = evaluate_tiny(model, tokenizer, held_out, temperature=0.0)
    sampled = evaluate_tiny(model, tokenizer, held_out, temperature=1.0, samples=4, seed=1)
    print(f"tiny start: greedy {greedy}, sampled {sampled}")
    assert greedy["accuracy"] <= 0.15
    assert greedy["mistake"] >= 0.6  # the greedy answer is the systematic mistake
    assert 0.18 <= sampled["accuracy"] <= 0.42
    assert sampled["accuracy"] + sampled["mistake"] >= 0.80  # it can add: samples are S or S + 10
    assert sampled["well_formed"] >= 0.95 and greedy["well_formed"] >= 0.95
