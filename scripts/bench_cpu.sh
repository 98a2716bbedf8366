#!/usr/bin/env bash
# The CPU benchmarks behind docs/benchmarks.md, command for command.
#
#   scripts/bench_cpu.sh [setup|record|ouro|ablate|huginn|latency|serve|all] ...
#
# Results (JSON + PNG) go to docs/bench/<name>/. On a machine shared with other work, run it as
#   NICE="nice -n -15" scripts/bench_cpu.sh all      (root: negative nice keeps the 1 bench thread on a core)
# Every command pins one torch thread (--threads 1) so no OpenMP barrier waits on a descheduled thread.
set -euo pipefail
cd "$(dirname "$0")/.."
LS="${NICE:-} .venv/bin/loopserve"
OUT=${OUT:-docs/bench}
TRAJ=$OUT/trajectories/ouro-bench-alpaca128.json.gz

setup() {
  $LS bench setup --models ouro-bench,huginn-bench,huginn-bench-1-4-1,huginn-bench-0-4-0
}

record() {  # threshold-free gate trajectories of ouro-bench on the 128-request Alpaca-like workload
  $LS bench record --model ouro-bench --workload alpaca --num-requests 128 --threads 1 --file "$TRAJ" \
      --out $OUT/trajectories
}

ouro() {
  # the schedulers side by side, a step of each in turn (docs/benchmarks.md §8.34): ratios free of the machine's drift
  $LS bench throughput --model ouro-bench --workload alpaca --num-requests 128 --mean-depth 2.5 \
      --sweep width,full-depth --widths 16,32,64 --width 32 --repeats 3 --lockstep --threads 1 \
      --out $OUT/ouro-throughput
  $LS bench throughput --model ouro-bench --workload alpaca --num-requests 128 --trajectories "$TRAJ" \
      --sweep threshold --width 32 --threads 1 --out $OUT/ouro-threshold
  $LS bench throughput --model ouro-bench --workload sharegpt --scale 0.25 --num-requests 64 --mean-depth 2.5 \
      --sweep width --widths 32 --threads 1 --out $OUT/ouro-sharegpt
  $LS bench throughput --model ouro-bench --workload mtbench --scale 0.25 --num-requests 64 --mean-depth 2.5 \
      --sweep width --widths 32 --threads 1 --out $OUT/ouro-mtbench
}

ablate() {
  $LS bench ablate overhead --model ouro-bench --num-requests 128 --mean-depth 2.5 --width 32 --threads 1 \
      --out $OUT/ablate-overhead
  $LS bench ablate min-coda --model ouro-bench --num-requests 64 --mean-depth 2.5 --width 32 \
      --values 1,2,4,8,16 --threads 1 --out $OUT/ablate-min-coda
  $LS bench ablate trace --model ouro-bench --num-requests 16 --mean-depth 2.5 --width 8 --threads 1 \
      --out $OUT/ablate-trace
  $LS bench ablate overlap --model ouro-bench --num-requests 64 --width 32 --repeats 4 --threads 1 \
      --out $OUT/ablate-overlap
  $LS bench ablate huginn-split --model huginn-bench --num-requests 16 --scale 0.5 --mean-depth 10 --width 32 \
      --kv-layout shared --threads 1 --out $OUT/ablate-huginn-split
}

huginn() {
  # r_max 16: a token costs 4x an ouro-bench token, so half-length outputs and 32 requests
  $LS bench throughput --model huginn-bench --workload alpaca --scale 0.5 --num-requests 32 --mean-depth 10 \
      --kv-layout shared --sweep width,full-depth --widths 32 --width 32 --repeats 3 --lockstep --threads 1 \
      --out $OUT/huginn-throughput
  # with queued work (more requests than rows): what refill has to add
  $LS bench throughput --model huginn-bench --workload alpaca --scale 0.5 --num-requests 128 --mean-depth 10 \
      --kv-layout shared --sweep width --widths 32 --repeats 3 --lockstep --threads 1 --out $OUT/huginn-throughput-128
  # the former defaults (until §8.34): codas 8 at a time, preludes of their own at once
  $LS bench throughput --model huginn-bench --workload alpaca --scale 0.5 --num-requests 32 --mean-depth 10 \
      --kv-layout shared --sweep width --widths 32 --min-coda-batch 8 --min-prelude-batch 1 --repeats 3 --lockstep \
      --threads 1 --out $OUT/huginn-throughput-mincoda8
}

latency() {
  $LS bench step-latency --model ouro-bench --contexts 64,256,512 --batches 1,2,4,8,16,32,48,64,96,128 \
      --reps 5 --threads 1 --out $OUT/step-latency-ouro
  $LS bench step-latency --model huginn-bench --contexts 64,256 --batches 1,2,4,8,16,32,64,128 \
      --reps 5 --threads 1 --out $OUT/step-latency-huginn
  # t(B) is linear only while the batch's KV fits the caches: refit on B <= 32 (no new measurement)
  for m in ouro huginn; do
    $LS bench step-latency --from-json $OUT/step-latency-$m/step_latency.json --fit-max-batch 32
  done
}

serve() {
  # in-process: synthetic depths (mean 2.5 of 4), rates as fractions of CB's measured offline capacity
  $LS bench serve --model ouro-bench --workload alpaca --num-requests 64 --mean-depth 2.5 --width 32 \
      --rate-fractions 0.25,0.5,0.75,1.0,1.25 --threads 1 --out $OUT/serve-inprocess
  # HTTP: `loopserve serve` per scheduler, live gate exits; 0.33 is the gate threshold whose replay of the
  # recorded trajectories gives mean depth 2.5 (loopserve_lab.bench.trajectories.threshold_for_depth)
  $LS bench serve --model ouro-bench --workload alpaca --num-requests 32 --mode http --depth-law full \
      --exit-policy gate --exit-threshold "${HTTP_THRESHOLD:-0.33}" --width 32 --rate-fractions 0.5,1.0 \
      --threads 1 --out $OUT/serve-http
}

replot() {  # redraw the throughput figures from their JSON (the figures in the docs come from this)
  for d in ouro-throughput ouro-threshold ouro-sharegpt ouro-mtbench huginn-throughput huginn-throughput-mincoda8; do
    if [ -f $OUT/$d/throughput.json ]; then $LS bench throughput --from-json $OUT/$d/throughput.json > /dev/null; fi
  done
}

for stage in "${@:-all}"; do
  case "$stage" in
    all) setup; record; ouro; ablate; huginn; latency; serve; replot ;;
    setup|record|ouro|ablate|huginn|latency|serve|replot) "$stage" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
