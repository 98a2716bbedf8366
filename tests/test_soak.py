"""The soak test of the real server, shortened for CI: `python -m loopserve_lab.bench.soak` for 20 s.

The driver starts its own server (a make_tiny checkpoint, small KV pool and admission bound) and
throws the whole traffic mix at it; this checks its report: nothing lost, no 5xx, no valid request
refused with a 4xx, no bad input accepted, the KV cache empty once idle, a clean log, exit code 0
after SIGTERM, and that every kind of fault was really exercised. The 30-minute run is
`scripts/soak.sh` (docs/reliability.md).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(150)

DURATION_S = 20


def test_short_soak(tmp_path):
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "loopserve_lab.bench.soak", "--duration-s", str(DURATION_S), "--concurrency", "6",
           "--drain-s", "5", "--request-timeout-s", "60", "--idle-timeout-s", "15", "--out", str(out),
           "--server-log", str(tmp_path / "server.log")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=140)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-6000:]
    report = json.loads(out.read_text())
    outcomes, kinds, server = report["outcomes"], report["by_kind"], report["server"]

    for name in ("5xx", "lost", "unexpected_4xx", "bad_accepted"):
        assert outcomes[name] == 0, (name, report["failures"])
    assert outcomes["served"] > 0
    assert report["idle"]["reached"] and report["idle"]["kv_cache_usage_perc"] == 0
    assert report["final_request"] == "served"
    assert report["log"]["tracebacks"] == report["log"]["http_500_lines"] == report["log"]["error_lines"] == 0
    assert report["shutdown"]["exit_code"] == 0
    assert report["ok"]

    # Every kind of traffic happened: the workers start with one round of every kind, and most kinds are
    # drawn several times more in 20 s. A cut upload, a stalled upload and a bad input get their outcome
    # whatever the timing; a cut stream, a client timeout or a valid request may instead meet a 503, but
    # not every attempt of a kind.
    for kind in ("disconnect_stream", "disconnect_upload", "disconnect_before_body", "client_timeout"):
        assert kinds.get(kind, {}).get("aborted", 0) > 0, (kind, kinds.get(kind))
    assert kinds["bad_input"].get("client_error", 0) > 0
    assert kinds["stalled_upload"].get("client_error", 0) > 0  # 408 after the read timeout
    assert server["finished"].get("abort", 0) > 0  # the server aborted what the clients cut
    for kind in ("completion", "completion_stream", "chat", "chat_stream", "long"):
        assert kinds.get(kind, {}).get("served", 0) > 0, (kind, kinds.get(kind))
    # Overload is reliable by construction: a burst of more requests than the server admits, each holding
    # its slot for 32+ tokens, arrives within the first 10 s. KV pressure is not asserted: a preemption needs
    # long requests to overlap, which depends on timing (3 to 6 per 20 s run on a loaded 2-core machine,
    # never 0 so far, but nothing guarantees it); the 30-minute soak reports their count.
    assert outcomes["rejected"] > 0 and kinds["burst"].get("rejected", 0) > 0
    assert server["rejected_overload"] >= outcomes["rejected"]


def test_every_bad_input_gets_its_status(tiny_ouro, tmp_path):
    """The soak draws its bad inputs at random, so one a change had made valid (an unknown chat role, which vLLM
    passes to the template) failed it only in the runs that drew it. Here each is sent once, the soak's way."""
    import httpx

    from loopserve_lab.bench import soak

    cfg = soak.SoakConfig(duration_s=0)
    proc, base_url, _ = soak.start_server(cfg, tiny_ouro, tmp_path / "server.log")
    try:
        info = httpx.get(base_url + "/v1/models", timeout=10).json()["data"][0]
        max_len = int(info["max_model_len"])
        lim = soak.Limits(room=min(max_len, cfg.kv_cache_tokens), max_model_len=max_len, r_max=int(info["r_max"]),
                          capacity=cfg.max_num_seqs + cfg.max_queued_requests, body_limit=cfg.max_request_body_bytes,
                          read_timeout_s=cfg.read_timeout_s)
        wrong = {}
        with httpx.Client(base_url=base_url, timeout=60) as client:
            for name, method, path, body, want, content_type in soak.bad_inputs(lim):
                kw = soak.bad_request_kwargs(body, content_type, iter([b" " * 4096] * (lim.body_limit // 4096 + 2)))
                try:
                    status = client.request(method, path, **kw).status_code
                except httpx.TransportError:  # (an over-limit body's reset may overtake its 413: the soak's rule)
                    status = 413 if want == 413 else "reset"
                if status != want:
                    wrong[name] = (status, want)
        assert not wrong, wrong
    finally:
        soak.stop_server(proc)
