"""P as one fp16 term or as hi + lo in the FP8 (pow2-scale) decode attention: speed, error, and the
engine-vs-trainer logprob gap (a question for the H200).

The pow2 path's P V product takes ``p s / s_max`` in fp16 as hi + lo (two tensor-core products, ~22 bits)
or as one fp16 (11 bits; ``POW2_P_TERMS`` in jetrl/engine/kernels/decode_attention_triton.py). The trainer's
own attention (cuDNN flash) multiplies V by a BF16 P (8 bits). This measures, in one process:

1. the kernel at (d)'s B = 256 / lengths 128-1152 and (e)'s B = 64 / lengths 3072-4096, both settings, under
   CUDA-graph replay, with the max error of each against ``decode_attention_reference``;
2. the mean |engine - trainer| logprob of ``jet_kv`` (and ``jet`` for scale) with each setting, on
   tests/test_engine_graphs.py's model and prompts over several seeds (the test's own procedure).

GPU only:

    PYTHONPATH=. OUT=$OUT python3 bench/sweep_attention_p_terms.py
"""

import json
import os
import statistics

import torch

from jetrl.bench.timing import graph_time_us
from jetrl.engine import SamplingParams
from jetrl.engine.decode_attention import decode_attention_reference, longest_first
from jetrl.engine.kernels import decode_attention_triton as kernels
from jetrl.models import CausalLM
from tests.engine_helpers import LOGPROB_CONFIG, engine_vs_trainer_gap, random_prompts

DEV = torch.device("cuda")


def kernel_rows() -> list[dict]:
    rows = []
    for B, S, lo, hi in [(256, 1152, 128, 1152), (64, 4096, 3072, 4096)]:
        H, Hkv, D = 32, 8, 128
        g = torch.Generator(device="cpu").manual_seed(0)
        lengths = torch.randint(lo, hi, (B,), generator=g).to(DEV)
        q = torch.randn(B, H, D, device=DEV, dtype=torch.bfloat16)
        k8 = (torch.randn(B, Hkv, S, D, device=DEV) * 4).to(torch.float8_e4m3fn)
        v8 = (torch.randn(B, Hkv, S, D, device=DEV) * 4).to(torch.float8_e4m3fn)
        ks = torch.exp2(torch.ceil(torch.log2(torch.rand(B, Hkv, S, device=DEV) * 0.25 + 0.01)))
        vs = torch.exp2(torch.ceil(torch.log2(torch.rand(B, Hkv, S, device=DEV) * 0.25 + 0.01)))
        order = longest_first(lengths)
        ref = decode_attention_reference(q, k8, v8, lengths, k_scales=ks, v_scales=vs).float()
        n_valid = int((lengths + 1).sum())
        nbytes = n_valid * Hkv * (D * 2 + 8)
        args = (q, k8, v8, lengths)
        kw = {"k_scales": ks, "v_scales": vs, "pow2_scales": True, "row_order": order}
        for p_terms in (2, 1, 2, 1):  # alternated twice: the machine's drift shows
            def fn(p=p_terms, args=args, kw=kw):
                return kernels.decode_attention_triton(*args, **kw, p_terms=p)
            err = float((fn().float() - ref).abs().max())
            us = graph_time_us(fn, DEV, calls=10, replays=10)
            rows.append({"B": B, "avg_ctx": n_valid / B, "p_terms": p_terms, "us": us, "tb_s": nbytes / us / 1e6,
                         "max_err": err})
            print(rows[-1], flush=True)
    return rows


def gap(base: CausalLM, name: str, seed: int) -> float:
    prompts = random_prompts([5, 17, 33, 9], seed=seed, vocab=512)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=48, seed=seed)
    return float(engine_vs_trainer_gap(base, name, prompts, params).mean())


def gap_rows() -> list[dict]:
    rows = []
    for seed in range(1, 6):
        torch.manual_seed(seed)
        base = CausalLM(LOGPROB_CONFIG).to(DEV, torch.bfloat16)
        row = {"seed": seed, "jet": gap(base, "jet", seed)}
        for p_terms in (2, 1):
            kernels.POW2_P_TERMS = p_terms
            row[f"jet_kv_p{p_terms}"] = gap(base, "jet_kv", seed)
        kernels.POW2_P_TERMS = 2
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> None:
    out = os.environ.get("OUT", "/tmp")
    kernel, gaps = kernel_rows(), gap_rows()
    with open(f"{out}/attn_p_terms.json", "w") as f:
        json.dump({"kernel": kernel, "gaps": gaps}, f, indent=1)
    print("\n   B   ctx  p_terms      us   TB/s   max err")
    for r in kernel:
        print(f"{r['B']:4d} {r['avg_ctx']:5.0f} {r['p_terms']:8d} {r['us']:7.1f} {r['tb_s']:6.2f}  {r['max_err']:.2e}")
    for key in ("jet", "jet_kv_p2", "jet_kv_p1"):
        vals = [g[key] for g in gaps]
        print(f"gap {key:10s} mean over seeds {statistics.mean(vals):.3e}  per seed "
              + " ".join(f"{v:.2e}" for v in vals))


if __name__ == "__main__":
    main()
