"""Tokenizer construction for loopserve checkpoints.

`loopserve_lab.tokenization.build` makes byte-level BPE tokenizers whose special-token ids, configuration
files and chat templates follow the Ouro and Huginn checkpoint layouts.
"""
