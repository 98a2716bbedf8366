"""loopserve's lab: what builds, trains and measures the models the runtime (`loopserve`) serves.

- `bench/`: `loopserve bench ...` (FLOP bounds and KV bytes, workloads, throughput, serving, plots, soak).
- `train/`: `loopserve train-tiny` and `loopserve eval ...` (the embedded model's corpus, training, scoring).
- `tokenization/`: tokenizer files in the Ouro / Huginn layouts (what the `tokenizers` trainer does not do).
- `tiny.py`: `loopserve make-tiny`, random checkpoints in the exact HF layouts (tests, bench models).

The runtime never imports this package when it is imported itself; the `loopserve` command adds the lab's
subcommands. Its third-party needs beyond the runtime's are the `[bench]` and `[train]` extras.
"""
