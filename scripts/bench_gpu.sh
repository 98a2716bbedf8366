#!/usr/bin/env bash
# The same benchmarks on a GPU (not yet run: no GPU was available when docs/benchmarks.md was
# written). Point OURO / HUGINN at real checkpoint folders for the paper's setting, or keep the
# bench presets. Results go to docs/bench-gpu/<name>/.
#
#   OURO=path/to/Ouro-1.4B HUGINN=path/to/huginn-0125 scripts/bench_gpu.sh [record|ouro|huginn|latency|serve|all]
set -euo pipefail
cd "$(dirname "$0")/.."
LS=".venv/bin/loopserve"
OURO=${OURO:-ouro-bench}
HUGINN=${HUGINN:-huginn-bench}
OUT=${OUT:-docs/bench-gpu}
DEV="--device ${DEVICE:-cuda} --dtype bfloat16"
TRAJ=$OUT/trajectories/ouro-alpaca512.json.gz

record() {
  $LS bench record --model "$OURO" $DEV --workload alpaca --num-requests 512 --width 128 --file "$TRAJ" \
      --out $OUT/trajectories
}

ouro() {
  $LS bench throughput --model "$OURO" $DEV --workload alpaca --num-requests 512 --mean-depth 2.5 \
      --sweep width,full-depth --widths 16,32,64,128,256 --width 128 --repeats 3 --out $OUT/ouro-throughput
  $LS bench throughput --model "$OURO" $DEV --workload alpaca --num-requests 512 --trajectories "$TRAJ" \
      --sweep threshold --width 128 --repeats 3 --out $OUT/ouro-threshold
  $LS bench throughput --model "$OURO" $DEV --workload sharegpt --num-requests 512 --mean-depth 2.5 \
      --sweep width --widths 64,128,256 --repeats 3 --out $OUT/ouro-sharegpt
}

huginn() {
  $LS bench throughput --model "$HUGINN" $DEV --workload alpaca --num-requests 256 --mean-depth 10 \
      --kv-layout shared --sweep width,full-depth --widths 32,64,128 --width 64 --repeats 3 --out $OUT/huginn-throughput
}

latency() {
  $LS bench step-latency --model "$OURO" $DEV --contexts 128,1024,4096 --batches 1,8,16,32,64,128,256,512 \
      --reps 20 --out $OUT/step-latency-ouro
  $LS bench step-latency --model "$HUGINN" $DEV --contexts 128,1024 --batches 1,8,16,32,64,128,256 \
      --reps 20 --out $OUT/step-latency-huginn
}

serve() {
  $LS bench serve --model "$OURO" $DEV --workload sharegpt --num-requests 512 --mean-depth 2.5 --width 128 \
      --rate-fractions 0.25,0.5,0.75,1.0,1.25,1.5 --out $OUT/serve-inprocess
  $LS bench serve --model "$OURO" $DEV --workload sharegpt --num-requests 256 --mode http --depth-law full \
      --exit-policy gate --exit-threshold 0.5 --width 128 --rate-fractions 0.5,1.0,1.25 --out $OUT/serve-http
}

for stage in "${@:-all}"; do
  case "$stage" in
    all) record; ouro; huginn; latency; serve ;;
    record|ouro|huginn|latency|serve) "$stage" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
