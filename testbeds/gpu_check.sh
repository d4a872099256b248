#!/bin/bash
# The GPU checks in one run: the parity tests with every stage on cuda, then the GPT-2 small
# step benchmark (testbeds/results/gpu/gpu-h200.md has the last figures).
#   testbeds/gpu_check.sh [WHEEL_DIR] [OUT_DIR]
# WHEEL_DIR: wheels to install first into /tmp/site (for a machine without a registry);
# OUT_DIR: where the logs go (default: ./gpu-check-out).
set -u
wheels=${1:-}
out=${2:-gpu-check-out}
mkdir -p "$out"
if [ -n "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl || exit 3
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, grpc, google.protobuf; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'grpc', grpc.__version__, 'protobuf', google.protobuf.__version__)" | tee -a "$out/gpu.txt"
start=$(date +%s)
timeout 270 python3 -m pytest -q -p no:cacheprovider --maxfail=5 --timeout 120 \
    tests/unit/test_devices.py tests/integration/test_parity.py --device cuda 2>&1 | tee "$out/parity.log" | tail -25
parity=${PIPESTATUS[0]}
echo "parity rc=$parity in $(( $(date +%s) - start )) s" | tee -a "$out/parity.log"
start=$(date +%s)
timeout 240 python3 -m testbeds.bench_core --device cuda --preset small --workers 2,4 --steps 6 --repeats 5 \
    > "$out/bench_gpu.txt" 2> "$out/bench_gpu.err"
bench=$?
echo "bench rc=$bench in $(( $(date +%s) - start )) s"
cat "$out/bench_gpu.txt"; tail -5 "$out/bench_gpu.err"
[ "$parity" -eq 0 ] && [ "$bench" -eq 0 ]
