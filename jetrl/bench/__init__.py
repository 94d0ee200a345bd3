"""``jetrl bench``: every FP8 speed ratio against BF16, measured in one run on the GPU (each section in its own
child process there, its FP8 and BF16 rows in the same one).

Why one command: a ratio is only meaningful against a baseline from the same run on the same
machine, next to the correctness check of the kernel it times. Every row here carries its BF16
(or copy-ceiling, or bytes-floor) baseline, its check and the issue's target.

Files (one concept each):

    shapes.py      what is measured at which size (Qwen3-8B shapes; the tiny --smoke sizes)
    timing.py      CUDA events, CUDA-graph replay timing, wall clocks, the bytes floor
    checks.py      bit equality, relative error, SQNR: the correctness measures
    models.py      random 8B-shaped models on the device, switching recipes, decode bytes
    synthetic.py   token-id prompts, tokenizer and reward for timing the RL loop offline
    kernels.py     (a) quantizers, (b) Float8Linear, (c) decode GEMMs
    attention.py   (d) the decode-attention kernel's TB/s (BF16 and FP8 caches) against SDPA
    sampling.py    (d) the fused sampler against its PyTorch spec
    rollout.py     (d) decode step vs bytes floor, (e) rollout tok/s (+ hf_generate.py, the HF baseline)
    training.py    (f) training phase, (g) end-to-end RL step
    report.py      rows, targets, the table and the JSON
    runner.py      runs the sections, isolates failures, prints, writes <out>/bench.json
    cli.py         the ``jetrl bench`` options
    sass.py        (no GPU) SASS instruction mix of a kernel's loops, compiled for sm_90 like a launch
    torchao_baseline.py  (b, ``--torchao``) torchao's blockwise FP8 training linear as a second baseline

Nothing GPU-only is imported at module import (Triton and transformers load lazily).
"""
