#!/usr/bin/env bash
# The prepared GPU measurements, in one go (docs/gpu.md): every step under `timeout`, within a total budget,
# its output in $OUT/<step>.log and its Markdown table in $OUT/<step>.md.
#
#   bash benchmarks/gpu_session.sh               # on a CUDA machine, from the repository root
#   bash benchmarks/gpu_session.sh --cpu-smoke   # the same steps at a tiny size on the CPU (tests the script)
#
# Wheels carried in .whl/ (MONAI, nibabel, ... for a machine without them) are installed into /tmp/site
# first; the working tree's src/ is put on PYTHONPATH.  BUDGET (seconds, default 540) bounds the whole
# script: a step gets at most what is left, and is skipped with less than 20 s left.  Steps run in the order
# of their worth: timings with GPU busy share and kernels, operators by role, engine overhead, the
# non-deterministic run, 3D.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-out}
WORK=${WORK:-/tmp/fedseg-gpu-work}
BUDGET=${BUDGET:-540}
PY=${PYTHON:-python3}
SMOKE=0
[ "${1:-}" = "--cpu-smoke" ] && SMOKE=1
mkdir -p "$OUT" "$WORK"
START=$(date +%s)

if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
    $PY -m pip install --quiet --no-index --no-deps --target /tmp/site "$ROOT"/.whl/*.whl > "$OUT/wheels.log" 2>&1
    export PYTHONPATH=/tmp/site:$ROOT/src
else
    export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: run COMMAND in benchmarks/ under min(SECONDS, what is left)
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - ($(date +%s) - START)))
    if [ "$left" -lt 20 ]; then
        echo "$name: skipped, ${left} s of the budget left" | tee -a "$OUT/summary.txt"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local t0=$(date +%s)
    (cd "$ROOT/benchmarks" && timeout "$limit" "$@") > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc after $(($(date +%s) - t0)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
}

{
    echo "started $(date -u +%FT%TZ), budget $BUDGET s, smoke $SMOKE"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2> /dev/null || echo "no nvidia-smi"
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"
    git -C "$ROOT" rev-parse --short HEAD 2> /dev/null || true
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"

if [ "$SMOKE" = 1 ]; then
    DEV=cpu
    G="--device cpu --scale 0.03 --sizes 32 --channels 8,16,32 --no-warmup"
    SIZE=32
    SYNTH="--scale 0.03 --size 32"
    OVER="--device cpu --rounds 2 --repeats 1 --scale 0.03 --size 32"
    G3D="--device cpu --size 64 --roi 32,32,8 --steps 2 --rounds 2 --precisions fp32"
else
    DEV=cuda
    G="--device cuda --sizes 256 --no-warmup"
    SIZE=256
    SYNTH="--scale 1 --size 256"
    OVER="--device cuda --rounds 20 --checkpoint-every 10 --repeats 1"
    G3D="--device cuda --size 256 --rounds 3 --steps 4"
fi
DATA=$WORK/gpu/data$SIZE  # gpu.py --out $WORK/gpu reuses this federation

# 1. the fundus preset (full scale at 256² on the GPU: 45–70 s with the default writer processes)
step synth 120 $PY -m fedseg.cli synth --preset fundus $SYNTH --out "$DATA"
# 2. s/round, peak memory, GPU busy share and kernels of round 2 (torch.profiler) per method
step timings 200 $PY gpu.py $G --rounds 4 --profile --out "$WORK/gpu" --md "$OUT/timings.md" \
    --runs centralized:fp32:auto,fedavg:fp32:auto,fedsm:fp32:auto,local:fp32:auto
# 3. operators per round by role (global, personalized, selector, routing) and phase, FedAvg and FedSM
step operators 110 $PY gpu.py $G --count-operators --count-only --out "$WORK/gpu" --md "$OUT/operators.md" \
    --runs fedavg:fp32:auto,fedsm:fp32:auto
# 4. engine overhead against a bare PyTorch loop (goal <= 1.10 on the GPU)
step engine_overhead 70 $PY engine_overhead.py $OVER
# 5. what determinism costs: FedAvg with the cuDNN autotuner and TF32 (compare with step 2's FedAvg row)
step nondeterministic 70 $PY gpu.py $G --rounds 4 --nondeterministic --out "$WORK/gpu" \
    --md "$OUT/nondeterministic.md" --runs fedavg:fp32:auto
# 6. 3D: Auto-FedAvg on ct-lesion at the paper's patch, fp32 and bf16
step gpu3d 110 $PY gpu3d.py $G3D --out "$WORK/gpu3d" --md "$OUT/gpu3d.md"

echo "finished $(date -u +%FT%TZ) after $(($(date +%s) - START)) s" | tee -a "$OUT/summary.txt"
for f in "$OUT"/*.md; do
    [ -f "$f" ] && { echo; echo "== $(basename "$f")"; cat "$f"; }
done
