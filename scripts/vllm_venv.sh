#!/usr/bin/env bash
# Build a side virtualenv with vLLM 0.33 (CPU) and kvtier, for tests/integrations/ and
# benchmarks/vllm_adapter.py. Usage: bash scripts/vllm_venv.sh [DIR]   (default: .vllm-venv)
#
# vLLM's wheel is installed without its dependencies (it pins torch 2.14 and CUDA-only packages):
# its offloading code runs on CPU with the ~20 packages below. pip prints conflicts about vLLM's
# unmet pins; they are expected (do not run `pip check`). About 2 minutes and 2.5 GiB.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.vllm-venv}
python3 -m venv "$dir"
# shellcheck disable=SC1091
. "$dir/bin/activate"
pip install -q torch==2.13.0 numpy
pip install -q --no-deps vllm==0.33.0
pip install -q packaging msgspec regex requests psutil 'pyzmq>=25' 'transformers>=5.16.1,<5.21.0' cbor2 \
  'aiohttp>=3.14.4' 'oss-harmony>=0.0.11' 'openai>=2.25.0' 'pillow>=13' pybase64 cachetools \
  cloudpickle uvloop py-cpuinfo prometheus_client 'fastapi<0.137.0,>=0.133.0' partial-json-parser \
  'llguidance<1.8.0,>=1.7.0' pydantic
pip install -q --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.11
# kvtier and its test dependencies. pip then lists vLLM's unmet pins (torch 2.14, CUDA packages):
# expected, so those lines are filtered out; a failed install still stops the script.
log=$(mktemp)
if ! pip install -q -e ".[test]" >"$log" 2>&1; then cat "$log"; rm -f "$log"; exit 1; fi
grep -v -e '^vllm .* requires' -e 'dependency resolver' -e 'Location .* is ignored' "$log" || true
rm -f "$log"
python -c "import vllm, kvtier.integrations.vllm; print('vLLM', vllm.__version__, 'with kvtier', kvtier.__version__)"
