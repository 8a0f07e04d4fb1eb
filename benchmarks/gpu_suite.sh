#!/usr/bin/env bash
# One command for whoever has a GPU (issue 28): from a fresh checkout on a GPU machine, run the `cuda` tests and
# benchmarks/bench_gpu.py with settings that finish in under 6 minutes, and write their logs to OUTDIR.
#
#     benchmarks/gpu_suite.sh OUTDIR
#
# Run it first when a GPU machine is lent: it is short, and everything after it can be read from OUTDIR.
# Environment:
#   PYTHON            the interpreter (default: python3; a venv's python if you have one)
#   GPU_SUITE_DEVICE  cuda (default) or cpu: cpu is a dry run of the same steps on this machine's CPU (the cuda
#                     tests then run their CPU twins, bench_gpu.py runs with --device cpu and tiny sizes)
#   GPU_SUITE_MBYTES  MB of fp32 per peer in bench_gpu part 1 (default: 256 on cuda, 4 on cpu)
# Exit code: 0 if every step passed; otherwise the number of failed steps. Logs: OUTDIR/*.log, OUTDIR/summary.txt,
# and bench_gpu's final JSON line in OUTDIR/bench_gpu.json.
set -u -o pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
OUT=$1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
PYTHON=${PYTHON:-python3}
DEVICE=${GPU_SUITE_DEVICE:-cuda}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
failed=0

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to OUTDIR/NAME.log, note the outcome
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    echo "== $name: $*" | tee -a "$OUT/summary.txt"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "   $name: exit $rc after $((SECONDS - started)) s (log: $OUT/$name.log)" | tee -a "$OUT/summary.txt"
    [ $rc -eq 0 ] || failed=$((failed + 1))
    return 0
}

: >"$OUT/summary.txt"
{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    git -C "$REPO" rev-parse HEAD 2>/dev/null || echo "(not a git checkout)"
    "$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"available", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
    echo "device: $DEVICE"
} >"$OUT/environment.log" 2>&1
cat "$OUT/environment.log" >>"$OUT/summary.txt"

if [ "$DEVICE" = cpu ]; then
    # Dry run: the cuda tests' CPU twins (the same test functions, device=cpu), the batching count, tiny bench.
    step cuda_tests 240 "$PYTHON" -m pytest -q -p no:cacheprovider tests/swarm/test_devices.py tests/unit/test_dataplane_devices.py \
        tests/unit/test_part_batching.py -k "cpu"
    MBYTES=${GPU_SUITE_MBYTES:-4}
    step bench_gpu 240 "$PYTHON" benchmarks/bench_gpu.py --device cpu --mbytes "$MBYTES" --rounds 2 \
        --codecs none,int8 --gpt-epochs 2 --gpt-arg context=16 --gpt-arg d_model=16 --gpt-arg layers=1 \
        --gpt-arg max_bytes=100000 --gpt-arg eval_windows=16 --gpt-arg batch_size=16 --gpt-arg target_batch_size=32
else
    # The first run builds the CUDA extension (nvcc, about a minute): the tests do, the bench finds it cached.
    step cuda_tests 150 "$PYTHON" -m pytest -q -rfE -p no:cacheprovider -m cuda tests/
    MBYTES=${GPU_SUITE_MBYTES:-256}
    # 2 peers x 256 MB: 3 rounds of none, int8, int4 (+ gloo anchor); GPT: 25.4M parameters, one process alone,
    # then 2 peers with gradient averaging and 2 with DiLoCo, 8 epochs each. Caps: 150 s + 250 s.
    step bench_gpu 250 "$PYTHON" benchmarks/bench_gpu.py --device "$DEVICE" --mbytes "$MBYTES" --rounds 3 \
        --codecs none,int8,int4 --gpt-epochs 8 --gpt-arg d_model=512 --gpt-arg layers=8 --gpt-arg context=128 \
        --timeout 90
fi
tail -n 1 "$OUT/bench_gpu.log" >"$OUT/bench_gpu.json" 2>/dev/null || true
echo "failed steps: $failed" | tee -a "$OUT/summary.txt"
exit $failed
