#!/usr/bin/env bash
# The prepared GPU check (one CUDA device, no network; under 8 minutes): the CUDA tests (plan,
# parallelize and train on one GPU, native eager and compiled, fp32 and bf16) and the runtime
# benchmark on CUDA, and the overlap check (functional collectives on NCCL issued ahead of matmuls,
# waited before their readers: same values, both orders timed), and flex_attention models trained
# against torch's own flex_attention (its CUDA backward; the CPU has none). Writes
# $OUT/cuda_tests.xml, $OUT/flex_tests.xml and $OUT/runtime_cuda.json (OUT defaults to .).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-.}"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
timeout 300 python -m pytest -q -s tests/test_cuda.py --junitxml="$OUT/cuda_tests.xml"
tests=$?
timeout 120 python -m pytest -q -s tests/test_flex_attention.py -k cuda --junitxml="$OUT/flex_tests.xml"
flex=$?
timeout 240 python benchmarks/runtime.py --device cuda --steps 20 --json "$OUT/runtime_cuda.json"
bench=$?
echo "tests exit $tests, flex exit $flex, benchmark exit $bench"
exit $(( tests != 0 || flex != 0 || bench != 0 ))
