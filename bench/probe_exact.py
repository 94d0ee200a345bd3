"""Where exact mode's rollout and trainer still part ways: every attention call's inputs and output, compared row by row.

Runs a 1-layer random Qwen3 of Qwen3-8B's width (or ``LAYERS``) in exact mode (jetrl/exact.py) under ``RECIPE``
(default jet), teacher-forces a few completions through the engine's own path (``Engine.score``: prefill, then
one eager decode step per token) and through the trainer's forward, recording each ``exact_attention`` call. For
every decode step and row it compares the decode call's q, the cache's K/V up to the row's position and the
output with the trainer call's, and prints how many rows differ in each, then the logprob gap.

    PYTHONPATH=. OUT=$OUT [RECIPE=jet] [LAYERS=1] python3 bench/probe_exact.py
"""

import json
import os

import torch

from jetrl.bench.models import random_model, set_recipe
from jetrl.bench.shapes import h200_config
from jetrl.engine import Engine
from jetrl.exact import use_exact
from jetrl.models import exact_ops
from jetrl.rl.logprobs import batch_trainer_logprobs


def main() -> None:
    dev, recipe = torch.device("cuda"), os.environ.get("RECIPE", "jet")
    model = random_model(h200_config().model_config(int(os.environ.get("LAYERS", "1"))), dev, torch.bfloat16)
    model.requires_grad_(False)
    set_recipe(model, recipe)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 151936, (n,), generator=g).tolist() for n in (40, 57, 64, 71)]
    completions = [torch.randint(0, 151936, (12,), generator=g).tolist() for _ in prompts]
    calls: list[tuple] = []
    original = exact_ops.exact_attention

    def recorded(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        out = original(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        calls.append((q.clone(), k.clone(), v.clone(), is_causal, out.clone()))
        return out

    exact_ops.exact_attention = recorded
    with use_exact():
        engine = Engine(model, max_slots=8, max_len=160, use_cuda_graphs=False)
        rollout = engine.score(prompts, completions)
        engine_calls = list(calls)
        calls.clear()
        trainer = batch_trainer_logprobs(model, prompts, completions)
    exact_ops.exact_attention = original
    layers = model.config.num_hidden_layers
    tq, tk, tv, _, tout = calls[0]  # the trainer's layer-0 call: (B, H, L, D)
    decode = [c for c in engine_calls if not c[3]][::layers]  # layer 0's decode calls, in step order
    B, H, _, D = tq.shape
    counts = {"q": 0, "k": 0, "v": 0, "out": 0, "rows": 0}
    first = {}
    for step, (q, k, v, _, out) in enumerate(decode, start=1):
        for b in range(B):
            p = len(prompts[b]) + step - 1
            checks = {"q": torch.equal(q[b].reshape(H, D), tq[b, :, p]),
                      "k": torch.equal(k[b, :, : p + 1], tk[b, :, : p + 1]),
                      "v": torch.equal(v[b, :, : p + 1], tv[b, :, : p + 1]),
                      "out": torch.equal(out[b].reshape(H, D), tout[b, :, p])}
            counts["rows"] += 1
            for name, same in checks.items():
                if not same:
                    counts[name] += 1
                    if name == "out" and "out" not in first:
                        diff = (out[b].reshape(H, D).float() - tout[b, :, p].float()).abs()
                        first["out"] = {"step": step, "row": b, "pos": p, "elements": int((diff > 0).sum()),
                                        "max": float(diff.max())}
    # the attention kernel alone, on the trainer's own q/k/v: the causal call against (i) the same rows through a
    # tril mask (the mask binary, same S), (ii) decode-style calls over S = L keys, (iii) over a static S = 160
    L, Hkv = tk.shape[2], tk.shape[1]
    tril = torch.ones(L, L, dtype=torch.bool, device=dev).tril()[None, None]
    differs = (original(tq, tk, tv, tril, enable_gqa=True) != tout).any(-1)  # (B, H, L)
    kernel_rows = {"tril_mask_rows": int(differs.sum()),
                   "tril_mask_positions": sorted({int(t) for t in differs.nonzero()[:, 2].tolist()})[:20]}
    from jetrl.models.kernels.exact_attention_triton import exact_attention_triton

    base = exact_attention_triton(tq, tk, tv, None, True, D ** -0.5)
    kernel_rows["causal_again"] = int((exact_attention_triton(tq, tk, tv, None, True, D ** -0.5) != base).any(-1).sum())
    kernel_rows["causal_vs_recorded"] = int((base != tout).any(-1).sum())
    kernel_rows["causal_plus_tril"] = int((exact_attention_triton(tq, tk, tv, tril, True, D ** -0.5) != base)
                                          .any(-1).sum())
    kernel_rows["causal_plus_ones"] = int((exact_attention_triton(tq, tk, tv, torch.ones_like(tril), True, D ** -0.5)
                                           != base).any(-1).sum())
    pad_k, pad_v = torch.randn(B, Hkv, 160, D, device=dev, dtype=tk.dtype), torch.randn(B, Hkv, 160, D, device=dev,
                                                                                          dtype=tk.dtype)
    pad_k[:, :, :L], pad_v[:, :, :L] = tk, tv
    for name, (kk, vv) in {"decode_S_L": (tk, tv), "decode_S_160": (pad_k, pad_v)}.items():
        bad = 0
        for b in range(B):
            for p in range(len(prompts[b]), len(prompts[b]) + 11):
                mask = (torch.arange(kk.shape[2], device=dev) <= p)[None, None, None, :]
                step = original(tq[b:b + 1, :, p:p + 1].reshape(1, Hkv, H // Hkv, D), kk[b:b + 1], vv[b:b + 1], mask)
                bad += int(not torch.equal(step.reshape(H, D), tout[b, :, p]))
        kernel_rows[name] = bad
    gap = torch.cat([(r.to(dev) - t).abs() for r, t in zip(rollout, trainer)])
    result = {"recipe": recipe, "decode_rows_differing": counts, "first_out_diff": first,
              "kernel_alone_rows_differing": kernel_rows, "logprob_gap_max": float(gap.max()),
              "logprob_gap_mean": float(gap.mean())}
    print(json.dumps(result))
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"probe_exact_{recipe}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
