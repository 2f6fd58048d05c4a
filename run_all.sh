#!/usr/bin/env bash
# bash run_all.sh         set up what is missing, then a short run of every script and a table
# bash run_all.sh test    set up what is missing, then the whole test suite (test_scripts.py and tests/)
# bash run_all.sh test quick   the same set-up, then test_scripts.py alone: every script's proofs
# bash run_all.sh bench   set up what is missing, then the side-by-side benchmark (10-15 min, 2 cores)
set -euo pipefail
cd "$(dirname "$0")"
mode=${1:-smoke}
tier=${2:-}
case "$mode $tier" in "smoke "|"test "|"test quick"|"bench ") ;; *) echo "usage: bash run_all.sh [test [quick]|bench]" >&2; exit 2;; esac

# --- Python: this one if it has what we need, else .venv from requirements.txt (and tests/requirements.txt)
modules="torch, torchvision, matplotlib"
[ "$mode" = test ] && modules="$modules, pytest, xdist"
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && .venv/bin/python -c "import $modules" 2>/dev/null; then
  PY=.venv/bin/python
elif ! "$PY" -c "import $modules" 2>/dev/null; then
  echo "== installing into .venv from requirements.txt (torch is a large download)"
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements.txt
  [ "$mode" = test ] && .venv/bin/python -m pip install -q -r tests/requirements.txt
  PY=.venv/bin/python
fi
echo "== python: $PY ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"

# --- Fashion-MNIST in ./data/FashionMNIST/raw, where torchvision reads it: Debian's package unpacked there, or
# torchvision's download (the scripts download only into ./data: a --data-dir you name must hold it already)
raw=data/FashionMNIST/raw debian=/usr/share/datasets/fashion-mnist
files="train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte"
if ! (cd "$raw" 2>/dev/null && ls $files >/dev/null 2>&1); then
  if [ ! -d "$debian" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== installing Debian's dataset-fashion-mnist"
    apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null && apt-get install -y -q dataset-fashion-mnist >/dev/null; } || true
  fi
  if [ -d "$debian" ]; then
    echo "== unpacking $debian into $raw"
    mkdir -p "$raw"
    for f in $files; do gunzip -c "$debian/$f.gz" > "$raw/$f.tmp" && mv "$raw/$f.tmp" "$raw/$f"; done
  fi
  "$PY" -c 'import common; common.fashion_mnist()' >/dev/null   # downloads it, or says what to do
fi

# --- the several-machines tests need a real SLURM (slurm-wlm, munge) and the simulated cluster's tools
if [ "$mode $tier" = "test " ]; then
  missing=$(for p in slurm-wlm munge ethtool iproute2; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
  if [ -n "$missing" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== installing $(echo $missing) (for the SLURM and simulated-cluster tests)"
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing; } >/dev/null
  elif [ -n "$missing" ] || [ "$(id -u)" != 0 ]; then
    echo "== note: the SLURM and simulated-cluster tests (tests/test_cluster.py) will be skipped: they need root and" \
         "slurm-wlm, munge, ethtool, iproute2 (missing: ${missing:-none})"
  fi
fi

export PYTHONUNBUFFERED=1
if [ "$mode" = test ]; then
  # Two tests at a time (pytest-xdist): a third of a test's time its processes wait on each other
  # (rendezvous, timeouts, SLURM); the tests of several machines take turns on one worker. A test's
  # temporary folder is kept only if it failed: the whole suite writes 11 GB (checkpoints, image
  # folders), and pytest would keep its last three runs.
  flags=(-q -n 2 --dist loadgroup --durations=10 -o tmp_path_retention_policy=failed)
  if [ "$tier" = quick ]; then exec "$PY" -m pytest "${flags[@]}" test_scripts.py; fi
  exec "$PY" -m pytest "${flags[@]}" test_scripts.py tests
elif [ "$mode" = bench ]; then
  exec "$PY" benchmarks/bench.py
fi

# --- smoke run: every script briefly, then one table
started=$SECONDS
lenet="--epochs 1 --max-steps 20 --train-samples 2560 --test-samples 1000"   # LeNet and the toy: 20 steps
resnet="--epochs 1 --max-steps 4 --batch-size 32 --train-samples 256 --test-samples 500"   # ResNet-18: 4 steps
runs=()
smoke() {   # name, then the command
  local name=$1; shift
  echo "== $name: $*"
  "$@" --out "runs/smoke/$name" | tail -n 1
  runs+=("runs/smoke/$name")
}
smoke scratch_lenet "$PY" scratch_lenet.py $lenet
smoke scratch_ring "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 scratch_ring.py $lenet
smoke scratch_ring_overlap "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 scratch_ring.py --devices 2 --overlap $lenet
smoke scratch_ring_zero "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 scratch_ring.py --zero $lenet
smoke ddp_toy "$PY" ddp_toy.py $lenet
smoke ddp_toy_torchrun "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 ddp_toy.py $lenet
smoke ddp_resnet "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 ddp_resnet.py $resnet
smoke fsdp_resnet "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 fsdp_resnet.py $resnet
smoke diloco_resnet "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 diloco_resnet.py $resnet --local-steps 2
smoke dp_resnet "$PY" dp_resnet.py $resnet
port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')   # ft_ddp_resnet.py: a coordinator and two members
"$PY" ft_ddp_resnet.py --serve "127.0.0.1:$port" >/dev/null &
"$PY" ft_ddp_resnet.py --join "127.0.0.1:$port" --min-members 2 --micro-batch 16 $resnet --out runs/smoke/ft_other >/dev/null &
smoke ft_ddp_resnet "$PY" ft_ddp_resnet.py --join "127.0.0.1:$port" --min-members 2 --micro-batch 16 $resnet
wait
"$PY" examples/write_images.py runs/smoke/images --train-samples 256 --test-samples 100 >/dev/null
smoke ddp_resnet_folder "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 ddp_resnet.py $resnet \
  --data-dir runs/smoke/images --image-size 32 --workers 1
"$PY" - "${runs[@]}" <<'PYTHON'
import json, sys
rows = [json.load(open(f"{run}/metrics.json")) for run in sys.argv[1:]]
wide = max(len(m["backend"]) for m in rows)   # the columns fit the longest backend's name
print(f"\n{'approach':26} {'devices':12} {'backend':{wide}} {'samples/s':>10} {'test acc':>9} {'seconds':>8} {'MB/step':>8}")
for run, m in zip(sys.argv[1:], rows):
    devices = f"{len(m['devices'])} x {m['devices'][0]}"
    if m["script"] == "ft_ddp_resnet.py":   # each member writes its own metrics.json: run_all.sh starts two
        devices = f"2 x {m['devices'][0]}"
    print(f"{run.split('/')[-1]:26} {devices:12} {m['backend']:{wide}} {m['samples_per_s']:10,.0f} "
          f"{m['test_acc']:9.4f} {m['seconds']:8.1f} {m.get('sent_bytes_per_step', 0) / 1e6:8.2f}")
print("\nEvery run is a few steps, to show each script works here: ResNet-18 after 4 steps of 32 images is still at\n"
      "chance (test acc about 0.1); the README's full run reaches 0.93. What each test proves: tests/README.md.")
PYTHON
echo "run_all.sh: $((SECONDS - started)) s"
