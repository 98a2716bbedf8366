#!/bin/bash
# whole-session CPU A/B: 80be24e (/tmp/old) vs HEAD (/work/main), bench throughput, alternating, 3 rounds
for round in 1 2 3; do
  for side in old new; do
    for model in ouro-bench huginn-bench; do
      dir=/work/main; [[ $side == old ]] && dir=/tmp/old
      extra=""; [[ $model == huginn-bench ]] && extra="--scale 0.5 --mean-depth 10 --kv-layout shared"
      [[ $model == ouro-bench ]] && extra="--mean-depth 2.5"
      (cd $dir && PYTHONPATH=$dir /work/main/.venv/bin/python -m loopserve.cli bench throughput --model $model --dtype bfloat16 \
        --threads 1 --workload alpaca --num-requests 64 $extra --sweep width --widths 32 --repeats 1 --no-progress \
        --out /tmp/ab2/$side-$model-$round > /tmp/ab2/$side-$model-$round.log 2>&1)
    done
  done
done
echo done
