#!/usr/bin/env bash
# The CUDA figures of docs/benchmarks.md for step time (issue 29), max-batch (issue 27), the Hugging Face peer
# and batches without padding (issue 26), in one short device session: a lent GPU machine has torch, torchvision and
# transformers but not remat's other dependencies, so they travel as wheels in .whl/ with remat's own wheel
# (`bash benchmarks/cuda_wheels.sh` fills it here; carry ".whl"), and every section has its own time limit so that
# one slow section cannot take the others' time. Run from the repository root:
#
#     OUT=out bash benchmarks/cuda_session.sh
#
# DEVICE=cpu with small sizes (R152=2x32 R50=2x32 SHAPE=3,32,32 SEQ=32 MEMORY=64MiB NO_WHEELS=1
# PY="uv run python") rehearses it on a CPU.
set -u
OUT=${OUT:-out}
DEVICE=${DEVICE:-cuda}
R152=${R152:-16x224}
R50=${R50:-32x224}
SHAPE=${SHAPE:-3,224,224}
SEQ=${SEQ:-256}
MEMORY=${MEMORY:-fit}
mkdir -p "$OUT" /tmp/remat-home
if [ -z "${NO_WHEELS:-}" ] && compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 HOME=/tmp/remat-home REMAT_DATABASE_URL=sqlite:////tmp/remat-home/plans.db
PY=${PY:-python3}
LOG="$OUT/log"

section() {  # section SECONDS NAME COMMAND...: run with a limit, keep its output (minus the profiler's chatter)
    local limit=$1 name=$2
    shift 2
    echo "=== $name ($(date +%T), limit ${limit} s)" | tee -a "$LOG"
    timeout --kill-after=5 "$limit" "$@" 2>&1 | grep --line-buffered -v '^USDT:' | tee -a "$LOG" > /dev/null
    echo "=== $name: exit ${PIPESTATUS[0]} ($(date +%T))" | tee -a "$LOG"
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>/dev/null
  $PY -c "import torch, torchvision, transformers; print(torch.__version__, torchvision.__version__, transformers.__version__)"
} 2>&1 | tee -a "$LOG"

STEP=(benchmarks/step_overhead.py --device "$DEVICE" --grads kept --dtype float32,autocast_bfloat16 --plans 0
      --budget-fractions 0.5 --skip-noisy --variants --torch-profile /tmp/where --compiled applied --rounds 7
      --budget 12 --json "$OUT/step_overhead.jsonl")
section 150 step-resnet152 $PY "${STEP[@]}" --models resnet152 --sizes "$R152"
section 100 step-resnet50 $PY "${STEP[@]}" --models resnet50 --sizes "$R50"
section 100 max-batch $PY -m remat.client.cli max-batch resnet152 --device "$DEVICE" --input-shape "$SHAPE" \
    --memory "$MEMORY" --grads kept --json
for dtype in float32 autocast_bfloat16; do
    section 90 "hf-peer-$dtype" $PY benchmarks/hf_peer.py --device "$DEVICE" --dtype "$dtype" --models gpt2,llama,bert,t5 \
        --batch-size 2 --seq-len "$SEQ" --rounds 5 --candidates 3
done
section 50 unpadded $PY benchmarks/unpadded_batches.py --device "$DEVICE" --models gpt2,llama --batch-size 2 \
    --seq-len "$SEQ" --rounds 5
tar czf "$OUT/where_time_goes.tgz" -C /tmp where 2>/dev/null
echo "=== done $(date +%T)" | tee -a "$LOG"
