#!/usr/bin/env bash
# One command for a GPU machine: gpu_speed.py's table, then the README's full run
# (`torchrun --nproc_per_node=1 ddp_resnet.py`) as it is and with the candidate CUDA flags, all into $OUT.
# About 4-5 minutes on one H100; at most 6.5 (each part has its own timeout).
#
# On a machine without internet, put Fashion-MNIST's four .gz files (30 MB) in data/gz/ first, e.g.
#     mkdir -p data/gz && cp /usr/share/datasets/fashion-mnist/*-ubyte.gz data/gz/   (Debian: dataset-fashion-mnist)
# and give the command 7 minutes.
# AFTER="--amp --channels-last --compile" changes the candidate flags; GPU_SPEED="--quick" is passed to gpu_speed.py.
set -u
shopt -s nullglob
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_speed_device}
PYTHON=${PYTHON:-python3}
AFTER=${AFTER:---amp --channels-last}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" data/FashionMNIST/raw

for gz in data/gz/*-ubyte.gz; do   # where ddp_resnet.py's --data-dir data reads them
    raw=data/FashionMNIST/raw/$(basename "$gz" .gz)
    [ -s "$raw" ] || gunzip -c "$gz" > "$raw"
done
if [ "$(ls data/FashionMNIST/raw | wc -l)" -lt 4 ]; then
    echo "no Fashion-MNIST in data/FashionMNIST/raw: carry data/gz (see the top of $0)"; exit 1
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.csv" 2>&1
cat "$OUT/gpu.csv"
timeout 240 "$PYTHON" benchmarks/gpu_speed.py ${GPU_SPEED:-} 2> "$OUT/gpu_speed.err" | tee "$OUT/gpu_speed.txt"

for run in before after; do
    flags=""
    if [ "$run" = after ]; then flags=$AFTER; fi
    start=$(date +%s%N)
    timeout 75 "$PYTHON" -m torch.distributed.run --nproc_per_node=1 ddp_resnet.py $flags --out "runs/full_$run" \
        > "$OUT/full_$run.log" 2>&1
    status=$?
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    echo "full run $run ($flags): exit $status, $ms ms from the command to its end" | tee -a "$OUT/full_$run.log"
    grep -E "^epoch|^done" "$OUT/full_$run.log"
    cp "runs/full_$run/metrics.json" "$OUT/full_$run.json" 2>/dev/null
done
