"""Shared tiny checkpoints, written once per test session with `make_tiny` (HF folder layout).

Every fixture returns the folder path; tests load it through the same `load_model` path a real
downloaded checkpoint takes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loopserve_lab.tiny import TinySpec, make_tiny


def _make(tmp_path_factory: pytest.TempPathFactory, name: str, spec: TinySpec) -> Path:
    return make_tiny(tmp_path_factory.mktemp(name), spec)


@pytest.fixture(scope="session")
def tiny_ouro(tmp_path_factory) -> Path:
    """Ouro, 2 layers, MHA (4 heads), r_max 4."""
    return _make(tmp_path_factory, "tiny_ouro", TinySpec(arch="ouro", layers="2", r_max=4, seed=11))


@pytest.fixture(scope="session")
def tiny_ouro_gqa(tmp_path_factory) -> Path:
    """Ouro with grouped-query attention: 2 KV heads for 4 query heads."""
    return _make(tmp_path_factory, "tiny_ouro_gqa",
                 TinySpec(arch="ouro", layers="2", num_heads=4, num_kv_heads=2, r_max=4, seed=12))


@pytest.fixture(scope="session")
def tiny_ouro_la(tmp_path_factory) -> Path:
    """Ouro with a distilled `lookahead_gate` head (the lookahead_gate exit policy); r_max 4."""
    return _make(tmp_path_factory, "tiny_ouro_la",
                 TinySpec(arch="ouro", layers="2", r_max=4, seed=15, lookahead_gate=True))


@pytest.fixture(scope="session")
def tiny_huginn(tmp_path_factory) -> Path:
    """Huginn with a non-default split: 1 prelude, 2 core, 1 coda block; r_max 6."""
    return _make(tmp_path_factory, "tiny_huginn", TinySpec(arch="huginn", layers="1-2-1", r_max=6, seed=13))


@pytest.fixture(scope="session")
def tiny_huginn_242(tmp_path_factory) -> Path:
    """Huginn with the released model's split (2 prelude, 4 core, 2 coda); r_max 4."""
    return _make(tmp_path_factory, "tiny_huginn_242", TinySpec(arch="huginn", layers="2-4-2", r_max=4, seed=14))


@pytest.fixture(autouse=True)
def single_thread():
    """Run a test with one intra-op thread: the tiny models' ops are far too small to split, and on
    a loaded 2-core machine torch's thread pool spins instead of working (10x slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
