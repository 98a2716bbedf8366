"""Tokenizer files for the lab's checkpoints (`make-tiny`, `train-tiny`).

`loopserve_lab.tokenization.build` makes byte-level BPE tokenizers (merges from the `tokenizers`
trainer) whose special-token ids, configuration files and chat templates follow the Ouro and Huginn
checkpoint layouts. Reading and rendering them is the runtime's (`loopserve/tokenizer.py`).
"""
