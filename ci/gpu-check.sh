#!/usr/bin/env bash
# The GPU session's one call: the GPU-only tests, then the whole `jetrl bench`, on a CUDA machine with
# torch, triton and transformers but possibly no pip index (the H200 device of this project).
#
#   bash ci/gpu-check.sh OUT_DIR [WHEEL_DIR]
#
# BENCH_SECTIONS=c,d (optional) runs only those bench sections (default: all), so that the check can
# be split over calls that each fit a time limit (on an H200 the tests take ~4 min, the whole bench ~7:
# f and g train the whole 36-layer 8B).
# WHEEL_DIR (optional) holds pure-Python wheels to make importable without pip -- pytest and its
# dependencies when the machine lacks them (`pip download pytest pluggy iniconfig packaging --no-deps -d DIR`
# on a machine with an index), and math-verify with its two pure-Python dependencies for the trainer's tests,
# which run `jetrl train` (`pip download math-verify==0.9.0 latex2sympy2_extended antlr4-python3-runtime==4.13.2
# --no-deps -d DIR`; sympy comes with torch). Writes OUT_DIR/gpu-tests.log, OUT_DIR/bench.log and OUT_DIR/bench/bench.json;
# exits non-zero if the tests or the bench failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: ci/gpu-check.sh OUT_DIR [WHEEL_DIR]}"
mkdir -p "$out"
extra=""
if [ -n "${2:-}" ]; then
  extra="$(mktemp -d)"
  for w in "$2"/*.whl; do python3 -m zipfile -e "$w" "$extra"; done
fi
export PYTHONPATH=".${extra:+:$extra}"
python3 -m pytest -q -p no:cacheprovider -rs -s tests/test_engine_graphs.py tests/test_gemm.py tests/test_fused_ops.py \
  tests/test_fused_backward.py tests/test_sampler_kernel.py tests/test_projection_group.py tests/test_token_logprobs.py \
  tests/test_decode_attention.py tests/test_kernels.py tests/test_linear.py tests/test_quant.py \
  tests/test_gemm_gluon.py tests/test_engine.py tests/test_scheduler.py tests/test_kv_quant.py \
  tests/test_stacked_projections.py tests/test_producer_quant.py tests/test_diagnose.py tests/test_kv_store.py tests/test_exact.py \
  tests/test_train_graphs.py \
  tests/test_trainer.py::test_fp8_weight_caches_follow_a_fused_optimizer \
  tests/test_trainer.py::test_kill_dash_9_then_resume_is_bitwise_identical > "$out/gpu-tests.log" 2>&1
tests_rc=$?
tail -n 30 "$out/gpu-tests.log"
python3 -m jetrl bench --sections "${BENCH_SECTIONS:-a,b,c,d,e,f,g}" --out "$out/bench" > "$out/bench.log" 2>&1
bench_rc=$?
grep -A200 "^   measure" "$out/bench.log" | grep -v '^{"jetrl_bench"' | head -120
echo "gpu tests rc=$tests_rc, bench rc=$bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
