#!/usr/bin/env bash
# The GPU checks in one call (a lent machine's time is short: about 15 minutes,
# start included). Runs the trainer's tests on CUDA, then the synchronous and asynchronous
# benchmarks on the GPU beside DDP, each step under its own time limit, and ends with a
# summary of every table (printed as each step ends, and kept in $OUT/summary.txt), within
# BUDGET seconds (520). The logs and Chrome traces end in $OUT/logs.tar.gz ($OUT: the device
# tool's, or ./device-out), since a lent machine gives back a few files only.
#
# The GPU image has torch, numpy, msgpack, xxhash, uvloop and pytest but not zstandard or
# pytest-asyncio: carry their wheels (and py-spy's, for the profile at the end). Once, on the
# machine you work on:
#   python -m pip download zstandard pytest-asyncio py-spy --only-binary :all: --python-version 3.12 \
#       --platform manylinux_2_17_x86_64 -d .wheels          # (.wheels/ is in .gitignore)
# then run `bash bench/device_check.sh` there with `.wheels` carried, with a limit of 560 s.
# `bash bench/device_check.sh --cpu` runs the same steps, short, on this machine's CPU, to
# check the script itself (no figures worth keeping).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEVICE=cuda QUICK=0
if [ "${1:-}" = "--cpu" ]; then DEVICE=cpu QUICK=1; fi
export PYTHONPATH=$PWD

if ! $PY -c "import zstandard, pytest_asyncio" 2>/dev/null; then
    $PY -m pip install -q --no-index --find-links .wheels zstandard pytest-asyncio >"$OUT/pip.log" 2>&1 \
        || { echo "zstandard or pytest-asyncio missing, and no wheels in .wheels/ (see the top of $0)"; exit 2; }
fi

SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
BUDGET=${BUDGET:-520}  # seconds for all steps: under the call's limit, so the summary always comes back
# step NAME SECONDS COMMAND...: run it under its limit (and what is left of the budget), keep its
# log, and print its tables (also to the summary) as soon as it ends.
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - SECONDS - 5))
    if [ $left -lt 30 ]; then echo "== $name: skipped, $left s of the budget left" | tee -a "$SUMMARY"; return; fi
    [ $limit -gt $left ] && limit=$left
    local began=$SECONDS
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    { echo "== $name: exit $rc after $((SECONDS - began)) s of $limit ($*)"
      grep -E '^(\||model:|[0-9]+ (passed|failed)|=+ .*(passed|failed|skipped))' "$OUT/$name.log" | tail -n 40
      if [ $rc -ne 0 ]; then tail -n 5 "$OUT/$name.log"; fi
    } | tee -a "$SUMMARY"
}
can_netns() {  # network namespaces and tc (a gVisor sandbox may have neither)
    ip netns add p2p-probe 2>/dev/null || return 1
    ip netns del p2p-probe
    command -v tc >/dev/null
}

{ echo "device $DEVICE, $(nproc) cores, $(date -u +%FT%TZ)"
  nvidia-smi -L 2>/dev/null
  echo "kernel $(uname -r) (4.4.0: gVisor, whose loopback TCP runs in user space)"
  $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee -a "$SUMMARY"

if [ $QUICK = 1 ]; then
    STEPS=10 REPS=1 SECS=1 ROUNDS=20 SIZE=1m
else
    STEPS=100 REPS=2 SECS=4 ROUNDS=200 SIZE=10m
fi

# 1. Correctness on the device: bit-identical replicas, DDP's mathematics, a peer alone = the plain loop.
step tests 150 $PY -m pytest -q -p no:cacheprovider -n 0 tests/test_devices.py tests/test_device.py \
    tests/test_trainer_overlap.py -rs
# 2. A peer alone against the plain loop (goal >= 0.97 of its steps/s at 10 M parameters).
step overhead 100 $PY bench/overhead.py --device $DEVICE --task synthetic --model-size $SIZE \
    --staleness 0,1 --reps $REPS --seconds $SECS
#    And at 100 K parameters: what a step costs a peer alone when the step is short (0.4 ms on a CPU).
step overhead-small 40 $PY bench/overhead.py --device $DEVICE --task synthetic --model-size 100k \
    --batch-size 8 --staleness 0 --reps $REPS --seconds $SECS
# 3. Two peers on loopback sharing the GPU, fp32 and int8, beside DDP (gloo) and alone
#    (the issue's table: 9 M parameters, AdamW, batch 64; goal fp32 <= 1.1x DDP), and with overlap
#    (the ring during backward); Chrome traces of the last p2ptrain run of each
#    codec in $OUT/trace, and where their time went (bench/trace_spans.py).
step train-loopback 170 $PY bench/train.py --device $DEVICE --n 2 --codecs none,int8 --batch-size 64 \
    --steps $STEPS --reps 1 --modes ddp,p2ptrain,overlap,alone --trace "$OUT/trace"
step spans 20 $PY bench/trace_spans.py "$OUT/trace/n2-p2ptrain-none/rank0.json" "$OUT/trace/n2-p2ptrain-int8/rank0.json"
#    The links' own threads, to send and to read (P2PTRAIN_IO_THREADS, off by default until
#    measured here): this tree as it is, and beside it as "(baseline)" a copy with them on.
THREADED=$(mktemp -d)
cp -r p2ptrain "$THREADED/" && echo 'import os; os.environ.setdefault("P2PTRAIN_IO_THREADS", "1")' >"$THREADED/sitecustomize.py"
if PYTHONPATH="$THREADED" $PY -c "from p2ptrain.net.sender import io_threads_default as d; assert d()"; then
    echo "== io-threads: its '(baseline)' rows are the links' own threads ON (P2PTRAIN_IO_THREADS=1)" | tee -a "$SUMMARY"
    step io-threads 150 $PY bench/train.py --device $DEVICE --n 2 --codecs none,int8 --batch-size 64 \
        --steps $STEPS --reps 1 --modes p2ptrain --baseline-tree "$THREADED" --trace "$OUT/trace-io"
    step io-threads-spans 20 $PY bench/trace_spans.py "$OUT/trace-io/n2-p2ptrain-baseline-none/rank0.json" \
        "$OUT/trace-io/n2-p2ptrain-baseline-int8/rank0.json"
else
    echo "== io-threads: skipped (could not switch the copy's default)" | tee -a "$SUMMARY"
fi
#    And the interpreter's switch interval at 0.5 ms instead of 5 (sys.setswitchinterval, by
#    sitecustomize in a copy of the tree): whether the data threads' numpy calls wait on the GIL.
SWITCH=$(mktemp -d)
cp -r p2ptrain "$SWITCH/" && echo 'import sys; sys.setswitchinterval(0.0005)' >"$SWITCH/sitecustomize.py"
echo "== switch-interval: its '(baseline)' rows are sys.setswitchinterval(0.0005)" | tee -a "$SUMMARY"
step switch-interval 120 $PY bench/train.py --device $DEVICE --n 2 --codecs none,int8 --batch-size 64 \
    --steps $STEPS --reps 1 --modes p2ptrain --baseline-tree "$SWITCH"
# 4. A py-spy profile of both peers of an int8 run (every thread, idle included; collapsed stacks
#    in the logs): where the data path's threads wait. Only where the py-spy wheel was carried.
if $PY -m pip install -q --no-index --find-links .wheels py-spy >/dev/null 2>&1 && command -v py-spy >/dev/null; then
    step py-spy 60 py-spy record --subprocesses --threads --idle --rate 97 --format raw -o "$OUT/py-spy-int8.txt" -- \
        $PY bench/train.py --device $DEVICE --n 2 --codecs int8 --batch-size 64 --steps $STEPS --reps 1 --modes p2ptrain
fi
# 5. Staleness 1 and local steps against staleness 0 and DDP, time to a loss (loopback; the
#    least urgent step, so late in the order: a short budget skips it first).
step lan-loopback 150 $PY bench/lan.py --local 2 --device $DEVICE --no-allreduce --model-size 1m --batch-size 64 \
    --train-codecs int8 --staleness 0,1 --sync-every 16 --outer-lr 0.8 --outer-momentum 0.6 --rounds $ROUNDS --scaling 2
# 6. Steps 3 and 5 across emulated 1 Gbit/s hosts, where the sandbox allows namespaces.
if can_netns; then
    step train-1gbit 150 $PY bench/train.py --device $DEVICE --netns 1gbit --n 2 --codecs int8 --batch-size 64 \
        --steps 30 --reps 1 --modes ddp,p2ptrain,overlap,alone
    step lan-1gbit 120 $PY bench/lan.py --local 2 --netns 1gbit --device $DEVICE --no-allreduce --model-size 1m \
        --batch-size 64 --train-codecs int8 --staleness 0 --sync-every 16 --outer-lr 0.8 --outer-momentum 0.6 \
        --rounds $ROUNDS --scaling 2
else
    echo "== 1 Gbit/s steps skipped: no network namespaces or tc here" | tee -a "$SUMMARY"
fi
# What comes back from a lent machine is a few files: the summary, and the rest in one archive.
ARCHIVE=$(mktemp -u /tmp/device-logs.XXXXXX).tar.gz
tar czf "$ARCHIVE" -C "$OUT" --exclude summary.txt . \
    && find "$OUT" -mindepth 1 ! -name summary.txt -delete && mv "$ARCHIVE" "$OUT/logs.tar.gz"
echo "== done after $SECONDS s; $OUT/summary.txt, and logs and traces in $OUT/logs.tar.gz"
