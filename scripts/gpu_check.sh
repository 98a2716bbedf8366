#!/usr/bin/env bash
# The engine's device check, sized for a lent GPU: at most BUDGET seconds (540 by default) of a 15-minute lease.
# Steps, most telling first (docs/benchmarks.md §6.2 holds the last lease's figures to compare with):
# - the CUDA tests: exactness against the reference decoder on the device (eager, and with the default graphs) and
#   no host-device sync while planning or queueing;
# - CB vs CDB with graphs at Ouro-1.4B's shapes (random weights, `ouro-1.4b-shape`: about a minute to write its
#   5.4 GB checkpoint, which the later 1.4B steps reuse). On the last lease CDB refill gained 1.19x (1.36x without
#   the graph captures); since then a layer launches about 35 kernels instead of 55 (norms without casts, stacked
#   projections, decode attention as one fused call, a shorter rotary embedding: docs/benchmarks.md §8.27), so compare the decode rates;
# - the same run at the last lease's revision (BEFORE), for an A/B of the kernel changes on this machine;
# - the overlap ablation at that size, interleaved: on `ouro-bench` async codas cost 16-24 % under graphs, while the
#   separate throughput runs disagreed; since then an async coda whose tokens have arrived is taken before the next
#   tick is planned (no extra tick when the device keeps up, docs/design.md §6.4); this A/B decides the default;
# - the same run with its graphs captured at start-up (`--cuda-graph-warmup-tokens`): no capture inside the run;
# - that core step's own time as graph replays against the roofline (the last lease's grid did not finish in 90 s:
#   each point drew its random KV, up to 6.4G numbers, on the host; now drawn on the device);
# - the device's busy share of the wall time in CB and CDB runs at that size (`--device-busy`: 52 % on the last
#   lease, with a core step of some thousand small kernels);
# - `ouro-bench` with graphs, where a tick is all host path (comparable across leases);
# - Huginn-like with graphs at `--min-prelude-batch 8` (better than 1 on the last lease);
# - last, eager `ouro-bench` (`--no-cuda-graphs`, §6.1/§6.2's eager runs).
# Every throughput and ablation step names --cuda-graphs or --no-cuda-graphs: unset, graphs are on for CUDA since
# 2026-12-04 (step-latency times eager steps unless given its own --cuda-graphs).
# Each step runs under its own time limit and is skipped once the script has used BUDGET seconds, so one slow
# step cannot take the later ones with it. On the first lent GPU (an H200, 2026-12-04) the busy step did not end
# in the 4 minutes left. It now runs a smaller workload, and `DeviceBusy` reads the profiler's raw records: its
# event list builds a Python object per record, about 30 us each on this project's CPU (a likely culprit).
# Uses the machine's own python3 and torch (no venv needed); results and logs go to $OUT (relative paths are
# the repository root's). With PACK=file.tgz (outside $OUT) everything under $OUT is also packed into that one
# file after every step, so that a run stopped at its limit still hands back what it measured. The device tool
# returns only a few files from its $OUT, so run it as
#
#   D=$OUT; OUT=/tmp/gc PACK=$D/gc.tgz scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-docs/bench-gpu/check}
BUDGET=${BUDGET:-540}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # (absolute: a step may run in another tree)
: > "$OUT/steps.txt"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
step() {  # step NAME LIMIT_S COMMAND...: output to $OUT/NAME.log; skipped once the budget is spent
    local name=$1 limit=$2; shift 2
    local left=$((BUDGET - SECONDS))
    if ((left < 30)); then
        echo "skipped $name: ${SECONDS}s of ${BUDGET}s used" | tee "$OUT/$name.log" >> "$OUT/steps.txt"; return
    fi
    ((limit > left)) && limit=$left
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    echo "$name: rc ${PIPESTATUS[0]} after ${SECONDS}s (limit ${limit}s)" | tee -a "$OUT/steps.txt"
    pack
}
pack() { if [[ -n "${PACK:-}" ]]; then tar czf "$PACK.part" -C "$OUT" . && mv "$PACK.part" "$PACK"; fi; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
  git rev-parse --short HEAD 2>/dev/null
  git status --short 2>/dev/null; } | tee "$OUT/machine.txt"  # (the tree as sent: edits not yet committed too)
step tests 120 $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda.py tests/test_pipeline.py
step graphs-ouro-1.4b-shape 150 $PY -m loopserve.cli bench throughput --model ouro-1.4b-shape --device cuda \
    --dtype bfloat16 --workload alpaca --num-requests 64 --mean-depth 2.5 --sweep width --widths 32 --repeats 1 \
    --cuda-graphs --no-progress --out "$OUT/graphs-ouro-1.4b-shape"
# the same run at BEFORE (the last lease's revision, before the kernel changes): the A/B of those changes
BEFORE=${BEFORE:-80be24e}
if git worktree add -f /tmp/before "$BEFORE" > /dev/null 2>&1; then
    (cd /tmp/before && PYTHONPATH=/tmp/before step graphs-ouro-1.4b-shape-before 150 $PY -m loopserve.cli bench \
        throughput --model ouro-1.4b-shape --device cuda --dtype bfloat16 --workload alpaca --num-requests 64 \
        --mean-depth 2.5 --sweep width --widths 32 --repeats 1 --cuda-graphs --no-progress \
        --out "$OUT/graphs-ouro-1.4b-shape-before")
else
    echo "skipped graphs-ouro-1.4b-shape-before: no worktree of $BEFORE (history not sent, or /tmp/before in use)" \
        | tee -a "$OUT/steps.txt"
fi
step overlap-ouro-1.4b-shape 120 $PY -m loopserve.cli bench ablate overlap --model ouro-1.4b-shape --device cuda \
    --dtype bfloat16 --num-requests 64 --width 32 --repeats 2 --cuda-graphs --no-progress \
    --out "$OUT/overlap-ouro-1.4b-shape"
# graphs captured at start-up (`--cuda-graph-warmup-tokens`, this workload's contexts are under 512 tokens): the run
# should capture nothing (its graph_buckets 0) and decode at what the first step reports "without captures"; the
# step's time against the first step's is roughly the warm-up's cost (three engines, one each)
step warmup-ouro-1.4b-shape 150 $PY -m loopserve.cli bench throughput --model ouro-1.4b-shape --device cuda \
    --dtype bfloat16 --workload alpaca --num-requests 64 --mean-depth 2.5 --sweep width --widths 32 --repeats 1 \
    --cuda-graphs --cuda-graph-warmup-tokens 512 --no-progress --out "$OUT/warmup-ouro-1.4b-shape"
step step-latency-ouro-1.4b-shape-graphs 150 $PY -m loopserve.cli bench step-latency --model ouro-1.4b-shape \
    --device cuda --dtype bfloat16 --kv-layout shared --contexts 256,1024 --batches 1,8,32,64 --reps 5 --cuda-graphs \
    --no-progress --out "$OUT/step-latency-ouro-1.4b-shape-graphs"
step busy-ouro-1.4b-shape 150 $PY -m loopserve.cli bench throughput --model ouro-1.4b-shape --device cuda \
    --dtype bfloat16 --workload alpaca --num-requests 32 --mean-depth 2.5 --sweep width --widths 32 --repeats 1 \
    --cuda-graphs --device-busy --no-progress --out "$OUT/busy-ouro-1.4b-shape"
step cuda-graphs 90 $PY -m loopserve.cli bench throughput --model ouro-bench --device cuda --dtype bfloat16 \
    --workload alpaca --num-requests 128 --mean-depth 2.5 --sweep width --widths 32,128 --repeats 1 --cuda-graphs \
    --no-progress --out "$OUT/cuda-graphs"
step huginn-graphs-minprelude8 60 $PY -m loopserve.cli bench throughput --model huginn-bench --device cuda \
    --dtype bfloat16 --workload alpaca --scale 0.5 --num-requests 64 --mean-depth 10 --kv-layout shared \
    --sweep width --widths 32 --repeats 1 --cuda-graphs --min-prelude-batch 8 --no-progress \
    --out "$OUT/huginn-graphs-minprelude8"
step throughput 120 $PY -m loopserve.cli bench throughput --model ouro-bench --device cuda --dtype bfloat16 \
    --workload alpaca --num-requests 128 --mean-depth 2.5 --sweep width,full-depth --widths 32,128 --width 128 \
    --repeats 1 --no-cuda-graphs --no-progress --out "$OUT"
pack
