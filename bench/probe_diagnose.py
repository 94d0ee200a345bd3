"""``jetrl.rl.diagnose`` on the H200: where the rollout's forward and the trainer's part ways, layer by layer, for
every recipe, on a 4-layer random Qwen3 of Qwen3-8B's width (hidden 4096, 32 / 8 heads of 128, SwiGLU 12288,
vocabulary 151936) in BF16: 8 random prompts of 32-96 tokens, 2 completions each of 32 tokens sampled at T = 1.

On CPU the on-policy recipes agree bit for bit at every site (tests/test_diagnose.py). On a GPU the rollout and the
trainer run the same formulas through different kernels and row counts (decode GEMMs at 16 rows against the
trainer's ~2000; the decode attention kernel against SDPA), so this measures how large those kernel gaps are next to
the off-policy recipes' quantization gaps. ``EXACT=1`` runs it in exact mode (jetrl/exact.py), where the on-policy
recipes must read "equal" at every site. Prints each recipe's table and the wall time of its ``generate`` (graphs
captured by a first call); writes $OUT/probe_diagnose[_exact].json.

    PYTHONPATH=. OUT=$OUT [EXACT=1] python3 bench/probe_diagnose.py
"""

import json
import os
import time

import torch

from jetrl.bench.models import random_model, set_recipe
from jetrl.bench.shapes import h200_config
from jetrl.engine import Engine, SamplingParams
from jetrl.exact import use_exact
from jetrl.rl.diagnose import diagnose, format_report


def main() -> None:
    with use_exact(os.environ.get("EXACT") == "1"):
        _main()


def _main() -> None:
    dev = torch.device("cuda")
    model = random_model(h200_config().model_config(4), dev, torch.bfloat16).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 151936, (int(n),), generator=g).tolist() for n in torch.linspace(32, 96, 8)]
    results = {}
    for recipe in ("bf16", "jet", "jet_kv", "fp8kv_rollout", "fp8_rollout"):
        set_recipe(model, recipe)
        engine = Engine(model, max_slots=16, max_len=160)
        params = SamplingParams(n=2, temperature=1.0, max_tokens=32, seed=1)
        engine.generate(prompts, params)  # captures the graphs
        torch.cuda.synchronize()
        start = time.perf_counter()
        groups = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        pairs = [(p, c.token_ids) for p, group in zip(prompts, groups) for c in group]
        report = diagnose(engine, [p for p, _ in pairs], [c for _, c in pairs])
        results[recipe] = {**report, "generate_s": seconds}
        print(f"== {recipe} (generate {seconds * 1e3:.1f} ms)\n{format_report(report)}\n", flush=True)
        del engine
    name = "probe_diagnose_exact.json" if os.environ.get("EXACT") == "1" else "probe_diagnose.json"
    with open(os.path.join(os.environ.get("OUT", "/tmp"), name), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
