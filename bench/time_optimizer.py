"""The trainer's optimizer step at Qwen3-8B size against its bytes floor (a question for the H200).

`GRPOTrainer._optimizer_step` runs ``clip_grad_norm_`` (foreach) and then torch's fused AdamW over 8.19B BF16
parameters with BF16 gradients and moments. Its bytes floor: the norm reads every gradient (2 B per
parameter), the clip scales them in place (4 B), and AdamW reads p, g, m, v and writes p, m, v (14 B) -- 20 B
per parameter, ~164 GB, ~38 ms at 4.3 TB/s. The profiles of (f) put "AdamW + clipping" at ~107 ms per update.
This times each part alone, CUDA-event timed, median of 5 after 2 warm-ups. GPU only:

    PYTHONPATH=. OUT=$OUT python3 bench/time_optimizer.py
"""

import json
import os

import torch

from jetrl.bench.shapes import h200_config
from jetrl.bench.timing import time_ms

DEV = torch.device("cuda")
HBM = 4.3e12


def params_8b() -> list[torch.nn.Parameter]:
    cfg = h200_config()
    h, i, q, kv = cfg.hidden, cfg.intermediate, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    shapes = [(cfg.vocab, h), (cfg.vocab, h), (h,)]
    for _ in range(cfg.train_layers):
        shapes += [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i), (h,), (h,), (cfg.head_dim,),
                   (cfg.head_dim,)]
    out = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, device=DEV, dtype=torch.bfloat16) * 0.02)
        p.grad = torch.randn_like(p) * 1e-3
        out.append(p)
    return out


def timed(fn) -> float:
    return time_ms(fn, DEV, iters=5, warmup=2)


def main() -> None:
    params = params_8b()
    n = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-6, betas=(0.9, 0.99), weight_decay=0.0, fused=True)
    rows = {"params": n, "tensors": len(params)}
    rows["clip_grad_norm_ms"] = timed(lambda: float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
    grads = [p.grad for p in params]
    rows["norm_only_ms"] = timed(lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
    rows["adamw_fused_ms"] = timed(opt.step)
    rows["adamw_floor_ms"] = n * 14 / HBM * 1e3
    rows["clip_floor_ms"] = n * 6 / HBM * 1e3
    copy_src = torch.empty(2**30, dtype=torch.bfloat16, device=DEV)
    copy_dst = torch.empty_like(copy_src)
    rows["copy_tb_s"] = 2 * copy_src.nbytes / timed(lambda: copy_dst.copy_(copy_src)) / 1e9
    print(rows)
    with open(f"{os.environ.get('OUT', '/tmp')}/optimizer.json", "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
