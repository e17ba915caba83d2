#!/usr/bin/env bash
# The checks that need a CUDA GPU, on a machine that has one: the GPU tests (marked `gpu`,
# skipped elsewhere) and the kernel and placement benchmarks. Runs with that machine's own
# python3 (its CUDA build of torch and its Triton; nothing is downloaded) and writes the
# logs and figures into the folder given (default: gpu-results).
#
#   scripts/gpu-check.sh [OUTDIR]          # GPU_TEST_WORKERS=8 by default
set -u
out=${1:-gpu-results}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$out/gpu.txt"
# cgx from this checkout (its C extension built for this python); no dependency is touched
if ! "$py" -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$out/install.log" 2>&1
then
    cat "$out/install.log"
    exit 1
fi
mapfile -t files < <(grep -rlE "pytest.mark.gpu|NEEDS_CUDA" tests --include="test_*.py" | sort)
"$py" -m pytest -m gpu -n "${GPU_TEST_WORKERS:-8}" -q -p no:cacheprovider "${files[@]}" 2>&1 \
    | tee "$out/gpu-tests.log"
tests=${PIPESTATUS[0]}
# the rotation tests run on the GPU where there is one (not marked: they run everywhere)
"$py" -m pytest -q -p no:cacheprovider tests/test_rotation.py 2>&1 | tee "$out/rotation-tests.log"
[ "${PIPESTATUS[0]}" = 0 ] || tests=1
"$py" benchmarks/kernels.py --device cuda --size-mb 256 --json "$out/kernels.json" 2>&1 \
    | tee "$out/kernels.log"
"$py" benchmarks/placement.py --json "$out/placement.json" 2>&1 | tee "$out/placement.log"
exit "$tests"
