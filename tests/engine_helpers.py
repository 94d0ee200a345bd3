"""Tiny random models, prompts and the full-forward greedy spec shared by the engine tests."""

from __future__ import annotations

import torch

from jetrl.models import CausalLM, ModelConfig

LOGPROB_ATOL = 1e-4  # fp32 rounding of different GEMM/attention shapes, sharp tiny models (see docstring)
TRAINER_ATOL = 1e-5  # the same, for the standard-init model of test 2
VOCAB = 97
CONFIGS = {
    "llama": {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "qwen3": {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "qk_norm": True,
        "attention_bias": True,
        "attention_out_bias": True,
        "architecture": "Qwen3ForCausalLM",
        "tie_word_embeddings": True,
    },
}


def tiny_model(arch: str = "llama", seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig(**CONFIGS[arch]))
    with torch.no_grad():  # sharper than the 0.02 init, so greedy has no near-ties and samples vary
        for p in model.parameters():
            p.copy_(0.3 * torch.randn_like(p) if p.dim() > 1 else 1 + 0.1 * torch.randn_like(p))
    return model


def random_prompts(lengths: list[int], seed: int = 1, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def greedy_by_full_forward(model, prompt, max_tokens, stop_ids=(), max_len=10**9) -> list[int]:
    """The spec: re-run the whole sequence every step, no cache, argmax."""
    ids, out, device = list(prompt), [], model.lm_head.weight.device
    while True:
        token = int(model(torch.tensor([ids], device=device))[0, -1].argmax())
        out.append(token)
        ids.append(token)
        if token in stop_ids or len(out) >= max_tokens or len(ids) >= max_len:
            return out


# 256-wide (full FP8 blocks), 2 layers: the model of the engine-vs-trainer logprob tests
LOGPROB_CONFIG = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)


def engine_vs_trainer_gap(base: CausalLM, recipe: str, prompts: list[list[int]], params, prepare=None) -> torch.Tensor:
    """|engine - trainer| logprob of every sampled token of ``prompts`` under ``recipe``, on a converted copy of
    ``base``: the engine generates twice (the first call captures its graphs; ``prepare(engine)`` runs between
    the two), the trainer's forward scores the second call's tokens. Shared by tests/test_engine_graphs.py and
    bench/sweep_attention_p_terms.py."""
    import copy

    from jetrl import fp8
    from jetrl.engine import Engine
    from jetrl.rl.logprobs import batch_trainer_logprobs

    model = fp8.convert_to_float8(copy.deepcopy(base), fp8.get_recipe(recipe))
    engine = Engine(model, max_slots=16, max_len=128)
    engine.generate(prompts, params)
    if prepare is not None:
        prepare(engine)
    out = engine.generate(prompts, params)
    pairs = [(p, c) for p, group in zip(prompts, out) for c in group]
    with torch.no_grad():
        trainer = batch_trainer_logprobs(model, [p for p, _ in pairs], [c.token_ids for _, c in pairs])
    device = next(model.parameters()).device
    return torch.cat([(torch.tensor(c.logprobs, device=device) - t).abs() for (_, c), t in zip(pairs, trainer)])
