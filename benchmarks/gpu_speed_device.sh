#!/usr/bin/env bash
# One command for a machine with one GPU: where the README's full run spends its time, the same for a large-batch
# candidate, a profile of the step with a few rows of gpu_speed.py's table, then the recipe sweep. Every part has its
# own timeout, 473 s in all: unpacking the data 4 x 2, nvidia-smi 10, the README's run timed by phase 75, the
# candidate's 50, gpu_speed.py 70, the sweep 245, the archive 15. About 5 minutes on one H200 (estimated).
#
# On a machine without internet, put Fashion-MNIST's four .gz files (30 MB) in data/gz/ first, e.g.
#     mkdir -p data/gz && cp /usr/share/datasets/fashion-mnist/*-ubyte.gz data/gz/   (Debian: dataset-fashion-mnist)
# Everything goes to runs/gpu_speed_device/: each part's log, the phases' and the sweep's JSON, the profile's traces
# and summaries, the sweep's runs' own lines. Where $OUT is set, the four logs and an archive of the whole folder
# are copied there too (a few files, for a machine whose results are collected from one folder), and the end of
# the output repeats the tables. AFTER changes the candidate's flags; ROWS gpu_speed.py's rows; SWEEP adds flags to
# recipe_sweep.py.
set -u
shopt -s nullglob
cd "$(dirname "$0")/.."
RESULTS=runs/gpu_speed_device
PYTHON=${PYTHON:-python3}
AFTER=${AFTER:---batch-size 1024 --amp --channels-last --warmup-epochs 1 --nesterov --zero-init-residual --label-smoothing 0.1}
ROWS=${ROWS:-default,bf16+cl@1024,bf16+cl+fused@1024,bf16+cl+cudnn@1024}
export PYTHONUNBUFFERED=1
rm -rf "$RESULTS"
mkdir -p "$RESULTS" data/FashionMNIST/raw

for gz in data/gz/*-ubyte.gz; do   # where ddp_resnet.py's default ./data has them
    raw=data/FashionMNIST/raw/$(basename "$gz" .gz)
    [ -s "$raw" ] || { timeout 2 gunzip -c "$gz" > "$raw.tmp" && mv "$raw.tmp" "$raw"; }   # never a truncated one
done
if [ "$(ls data/FashionMNIST/raw | wc -l)" -lt 4 ]; then
    echo "no Fashion-MNIST in data/FashionMNIST/raw: carry data/gz (see the top of $0)"; exit 1
fi
timeout 10 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$RESULTS/gpu.csv"

part() {   # part NAME SECONDS COMMAND...: its output kept in $RESULTS/NAME.log and shown (less the profiler's
    local name=$1 seconds=$2   # own log lines), then its exit status
    shift 2
    echo "== $name (timeout $seconds s): $*"
    timeout "$seconds" "$@" 2>&1 | tee "$RESULTS/$name.log" | grep --line-buffered -v -E "^(USDT|ERROR|WARNING):[0-9]"
    echo "== $name: exit status ${PIPESTATUS[0]}" | tee -a "$RESULTS/$name.log"
}

part phases_readme 75 "$PYTHON" benchmarks/phases.py --json "$RESULTS/phases_readme.json"   # the README's command
# shellcheck disable=SC2086  # AFTER and SWEEP are lists of flags
part phases_after 50 "$PYTHON" benchmarks/phases.py --json "$RESULTS/phases_after.json" -- $AFTER --out runs/phases_after
part gpu_speed 70 "$PYTHON" benchmarks/gpu_speed.py --rows "$ROWS" --repeats 3 --budget 40 --profile "$RESULTS/profile"
# shellcheck disable=SC2086
part recipe_sweep 245 "$PYTHON" benchmarks/recipe_sweep.py --budget 195 --json "$RESULTS/recipe_sweep.json" \
    --logs "$RESULTS/recipe_sweep_logs" ${SWEEP:-}

if [ -n "${OUT:-}" ]; then
    timeout 15 tar czf "$OUT/gpu_speed_device.tar.gz" -C runs gpu_speed_device
    cp "$RESULTS"/{phases_readme,phases_after,gpu_speed,recipe_sweep}.log "$OUT/"
    echo; echo "== the tables again (all of it: \$OUT/gpu_speed_device.tar.gz)"
    sed -n '/^phases of/,$p' "$RESULTS/phases_readme.log" "$RESULTS/phases_after.log"
    grep -E "^profile |^row |^[a-z0-9+]+(@[0-9]+)? +[0-9,]+ +[0-9.]+ " "$RESULTS/gpu_speed.log"
    sed -n '/^setting /,$p' "$RESULTS/recipe_sweep.log"
fi
