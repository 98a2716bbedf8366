"""`loopserve bench peer`: what CI can check without transformers or the upstream code.

The prerequisites fail with one clear line (no traceback), the HF folder is assembled without
touching the checkpoint, the ratios are medians of within-round ratios (hand-made runs), and the
loopserve half runs on a micro model. With transformers installed and LOOPSERVE_PEER_OURO_CODE
naming a folder with the upstream `modeling_ouro.py`, one more test runs the HF half too.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

from loopserve.model_config import HUGINN, OURO
from loopserve_lab.bench.peer import (
    PeerCode,
    PeerConfig,
    PeerError,
    SystemRun,
    check_peer_code,
    compare_outputs,
    interleave,
    remote_code_folder,
    static_batches,
    summarize,
)
from loopserve_lab.bench.workloads import Request, Workload


@pytest.fixture
def bench_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LOOPSERVE_BENCH_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _ouro_code(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("modeling_ouro.py", "configuration_ouro.py"):
        (folder / name).write_text("# stand-in\n")
    return folder


def _peer(argv: list[str], capsys) -> tuple[int, str]:
    from loopserve.cli import main

    try:
        rc = main(["bench", "peer", "--model", "micro-ouro", "--no-progress", *argv])
    except SystemExit as e:  # (a refusal: `error:` line, status 2)
        rc = int(e.code or 0)
    err = capsys.readouterr().err
    return rc, err


# --------------------------------------------------------------------------------------------------
# Prerequisites: one clear line each
# --------------------------------------------------------------------------------------------------


def test_no_code_folder_names_the_files_it_needs(bench_cache, capsys):
    rc, err = _peer([], capsys)
    assert rc == 2
    assert "--hf-code" in err and "modeling_ouro.py" in err and "configuration_ouro.py" in err
    assert "Traceback" not in err


def test_a_folder_without_the_modeling_file_is_named(bench_cache, capsys):
    folder = bench_cache / "code"
    folder.mkdir()
    (folder / "configuration_ouro.py").write_text("")
    rc, err = _peer(["--hf-code", str(folder)], capsys)
    assert rc == 2
    assert f"--hf-code {folder}: missing modeling_ouro.py" in err and "configuration_ouro.py," not in err
    rc, err = _peer(["--hf-code", str(bench_cache / "nowhere")], capsys)
    assert rc == 2 and "not a folder" in err


def test_huginn_needs_the_raven_files():
    with pytest.raises(PeerError, match="raven_modeling_minimal.py, raven_config_minimal.py"):
        check_peer_code(Path("."), HUGINN)


def test_missing_transformers_is_a_clear_error(bench_cache, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if not installed
    rc, err = _peer(["--hf-code", str(_ouro_code(bench_cache / "code"))], capsys)
    assert rc == 2
    assert "needs transformers" in err and "pip install transformers==4.57.6" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("flag,value,msg", [("--workloads", "uniform,sharegpt", "--workloads"),
                                            ("--hf-batch", "0", "--hf-batch must be >= 1"),
                                            ("--repeats", "0", "--repeats must be >= 1"),
                                            ("--scale", "0", "--scale must be > 0")])
def test_bad_arguments_fail_before_anything_loads(bench_cache, capsys, flag, value, msg):
    rc, err = _peer(["--hf-code", str(_ouro_code(bench_cache / "code")), flag, value], capsys)
    assert rc == 2 and msg in err


def test_peer_defaults_are_one_thread_and_the_issue_setup():
    from loopserve.cli import build_parser

    args = build_parser().parse_args(["bench", "peer"])
    assert args.threads == 1 and args.hf_batch == 32 and args.width == 32
    assert args.workloads == "uniform,alpaca" and args.dtype == "bfloat16"


# --------------------------------------------------------------------------------------------------
# The HF folder and the arithmetic
# --------------------------------------------------------------------------------------------------


def test_remote_code_folder_links_the_checkpoint_and_points_auto_map_at_the_copied_code(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"architectures": [OURO], "hidden_size": 8}))
    (ckpt / "model.safetensors").write_bytes(b"weights")
    (ckpt / "tokenizer.json").write_text("{}")
    code = _ouro_code(tmp_path / "code")
    (code / "helpers.py").write_text("# a sibling the modeling file may import\n")
    peer_code = check_peer_code(code, OURO)
    assert peer_code.digests["modeling_ouro.py"] == hashlib.sha256((code / "modeling_ouro.py").read_bytes()).hexdigest()
    with remote_code_folder(ckpt, peer_code) as root:
        assert (root / "model.safetensors").is_symlink() and (root / "model.safetensors").read_bytes() == b"weights"
        assert {p.name for p in root.glob("*.py")} == {"modeling_ouro.py", "configuration_ouro.py", "helpers.py"}
        config = json.loads((root / "config.json").read_text())
        assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_ouro.OuroForCausalLM"
        assert config["hidden_size"] == 8
    assert not root.exists()
    assert "auto_map" not in json.loads((ckpt / "config.json").read_text())  # the checkpoint is untouched


def test_static_batches_keep_arrival_order():
    wl = Workload("w", [Request([1], 1) for _ in range(5)])
    assert static_batches(wl, 2) == [[0, 1], [2, 3], [4]]


def test_ratios_are_medians_of_within_round_ratios():
    # HF: 100, 50, 100 tok/s; CB: 150, 100, 110 -> within-round ratios 1.5, 2.0, 1.1 -> median 1.5
    # (the ratio of medians would be 110 / 100 = 1.1)
    hf = iter([SystemRun("hf", 100, t, t) for t in (1.0, 2.0, 1.0)])
    cb = iter([SystemRun("cb", 150, t, 2 * t) for t in (1.0, 1.5, 150 / 110)])
    order: list[str] = []
    runs = interleave({"hf": lambda: next(hf), "cb": lambda: next(cb)}, 3, lambda rep, r: order.append(r.system))
    assert order == ["hf", "cb"] * 3
    rows = {r["system"]: r for r in summarize(runs)}
    assert rows["hf"]["cpu_vs_hf"] == pytest.approx(1.0)
    assert rows["cb"]["cpu_tokens_per_s"] == pytest.approx(110)
    assert rows["cb"]["cpu_vs_hf"] == pytest.approx(1.5)
    assert rows["cb"]["wall_vs_hf"] == pytest.approx(0.75)


def test_compare_outputs_reports_where_requests_diverge():
    chk = compare_outputs([[1, 2, 3], [4, 5], [6]], [[1, 2, 3], [4, 9], [6]])
    assert chk == {"requests": 3, "identical": 2, "tokens": 6, "first_difference_at": [1]}


def test_config_validation():
    with pytest.raises(PeerError):
        PeerConfig(hf_code=Path("."), workloads=())
    assert PeerConfig(hf_code=Path(".")).hf_batch == 32


# --------------------------------------------------------------------------------------------------
# The loopserve half on a micro model
# --------------------------------------------------------------------------------------------------


def test_loopserve_half_runs_cb_at_full_depth_and_cdb_at_the_traces(bench_cache):
    from loopserve_lab.bench.harness import BenchModel
    from loopserve_lab.bench.peer import loopserve_outputs, run_loopserve
    from loopserve_lab.bench.trajectories import synthetic_traces
    from loopserve_lab.bench.workloads import make_workload

    bm = BenchModel.load("micro-ouro", "float32")
    wl = make_workload("alpaca", 6, bm.tokenizer, seed=1, scale=0.2)
    traces = synthetic_traces([r.output_len for r in wl.requests], bm.r_max, 2.0, "binomial", seed=0)
    cb = run_loopserve(bm, wl, traces, "cb", 4)  # CB ignores the traces: full depth
    cdb = run_loopserve(bm, wl, traces, "cdb", 4)
    assert cb.tokens == cdb.tokens == wl.output_tokens
    assert cb.extra["mean_exit_depth"] == 4
    assert cdb.extra["mean_exit_depth"] < 4
    assert cb.cpu_s > 0 and cdb.cpu_tokens_per_s > 0
    outs = loopserve_outputs(bm, wl, 4)
    assert [len(o) for o in outs] == [r.output_len for r in wl.requests]


# --------------------------------------------------------------------------------------------------
# The HF half, only where transformers and the upstream code are at hand
# --------------------------------------------------------------------------------------------------


def test_hf_half_matches_loopserve_greedy_in_float32(bench_cache, capsys):
    pytest.importorskip("transformers")
    code = os.environ.get("LOOPSERVE_PEER_OURO_CODE")
    if not code or not Path(code, "modeling_ouro.py").is_file():
        pytest.skip("LOOPSERVE_PEER_OURO_CODE: no folder with the upstream modeling_ouro.py")
    out = bench_cache / "peer"
    rc, err = _peer(["--hf-code", code, "--dtype", "float32", "--num-requests", "4", "--prompt-len", "5",
                     "--output-len", "4", "--scale", "0.2", "--hf-batch", "2", "--width", "2", "--repeats", "1",
                     "--check-requests", "4", "--out", str(out)], capsys)
    assert rc == 0, err
    report = json.loads((out / "peer.json").read_text())
    for body in report["workloads"].values():
        assert {r["system"] for r in body["rows"]} == {"hf", "cb", "cdb"}
        assert body["greedy_check"]["identical"] == body["greedy_check"]["requests"] == 4
    assert (out / "peer.md").read_text().startswith("# bench peer")
    assert isinstance(check_peer_code(code, OURO), PeerCode)
