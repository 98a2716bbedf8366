"""How `loopserve serve` listens, and vLLM's launch lines: HTTPS with vLLM's `--ssl-*` flags and a Unix domain
socket with `--uds` (real server processes, real clients), their errors before the model loads, and `vllm serve`'s
own flags for what loopserve's server lacks or always does (`vllm_neutral.SERVE_NEUTRAL`): taken at the values that
ask for nothing of it, so that a vLLM launch line starts, any other value refused naming the flag."""

from __future__ import annotations

import datetime
import ipaddress
import logging
import ssl
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from loopserve.cli import build_parser
from loopserve.cli import main as cli_main
from loopserve.serve.cli import _check, url_base
from tests.server_helpers import MODEL, free_port, server_env, stop, wait_ready

pytestmark = pytest.mark.timeout(120)


def _serve(*argv: str):
    return build_parser().parse_args(["serve", "m", *argv])


# -- vLLM's server flags -----------------------------------------------------------------------------------------
NEUTRAL_LINES = [
    "--response-role assistant", "--enable-prompt-tokens-details", "--enable-request-id-headers",
    "--disable-frontend-multiprocessing", "--chat-template-content-format string",
    "--no-enable-auto-tool-choice", "--tool-call-parser null", "--reasoning-parser ''", "--preemption-mode swap",
    "--no-enable-server-load-tracking", "--max-cudagraph-capture-size 512",
    "--cuda-graph-sizes 1 2 4", "--h11-max-incomplete-event-size 4194304", "--h11-max-header-count 256",
    "--max-num-partial-prefills 1", "--num-scheduler-steps 1", "--api-server-count 1", "--mm-processor-cache-gb 0",
    "--log-error-stack", "--no-trust-request-chat-template",
]
REFUSED_LINES = {
    "--reasoning-parser nope": "--reasoning-parser: no parser 'nope' (choose from deepseek_r1, qwen3)",
    "--response-role user": "--response-role: not supported by loopserve (a reply is the assistant's); it takes "
                            "'assistant', got 'user'",
    "--trust-request-chat-template": "--trust-request-chat-template: not supported by loopserve (a request cannot",
    "--lora-modules a=/x": "--lora-modules: not supported by loopserve (no LoRA adapters)",
    "--cuda-graph-sizes 0 8": "--cuda-graph-sizes: not supported by loopserve (every batch width",
    "--api-server-count 4": "--api-server-count: not supported by loopserve (one API server process",
}


def test_vllms_logging_level_variable_sets_the_log_level(monkeypatch):
    """$VLLM_LOGGING_LEVEL is --log-level's default, as vLLM reads it (it was ignored: INFO lines went on); the flag
    wins; a value that is no level stops the start naming the variable."""
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
    assert _serve().log_level == "error" and _check(_serve()) is None
    assert _serve("--log-level", "debug").log_level == "debug"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "loud")
    assert _check(_serve()) == ("$VLLM_LOGGING_LEVEL: must be one of critical, error, warning, info, debug (any case), "
                                "got 'loud'")
    monkeypatch.delenv("VLLM_LOGGING_LEVEL")
    assert _serve().log_level == "info"


@pytest.mark.parametrize("line", NEUTRAL_LINES)
def test_vllm_server_flags_that_ask_for_nothing_are_taken(line):
    import shlex

    assert _check(_serve(*shlex.split(line))) is None


@pytest.mark.parametrize("line", sorted(REFUSED_LINES))
def test_vllm_server_flags_that_ask_for_what_loopserve_lacks_stop_the_start_naming_the_flag(line, capsys):
    with pytest.raises(SystemExit) as exited:  # (before the model "m" is looked for)
        cli_main(["serve", "m", *line.split()])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("error: " + REFUSED_LINES[line]) and err.count("\n") == 1, err


def test_a_refused_switch_is_named_in_the_command_lines_words(capsys):
    """The flag, not the `LLM` keyword it sets, and its values as the command line writes them (not True/False)."""
    with pytest.raises(SystemExit):
        cli_main(["serve", "m", "--trust-request-chat-template"])
    err = capsys.readouterr().err
    assert err.startswith("error: --trust-request-chat-template: ") and err.endswith("; it takes false, got true\n"), \
        err
    # an apostrophe inside a word (the reason: "--tool-call-parser's") opens no quote: None after it is null too
    with pytest.raises(SystemExit):
        cli_main(["serve", "m", "--tool-parser-plugin", "x"])
    err = capsys.readouterr().err
    assert "--tool-call-parser's are built in" in err and err.endswith("; it takes null or '', got 'x'\n"), err


# -- TLS and a Unix domain socket ---------------------------------------------------------------------------------
def _certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@contextmanager
def _server(model: Path, log: Path, client: httpx.Client, url: str, *flags: str) -> Iterator[subprocess.Popen]:
    """`loopserve serve` with `flags`, ready once `client` gets /health from `url`; stopped (SIGTERM) on exit."""
    cmd = [sys.executable, "-m", "loopserve.cli", "serve", "--model", str(model), "--served-model-name", MODEL,
           "--device", "cpu", "--log-level", "info", "--no-access-log", *flags]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=server_env())
    try:
        if not wait_ready(proc, url, client=client):
            pytest.fail(f"server did not start:\n{log.read_text()}")
        yield proc
    finally:
        stop(proc)


def test_https_with_vllms_ssl_flags(tiny_ouro, tmp_path):
    """--ssl-keyfile / --ssl-certfile: the API over HTTPS (the official client, trusting the certificate), and a
    plain-HTTP request on that port gets no answer."""
    cert, key = _certificate(tmp_path)
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    with httpx.Client(verify=ssl.create_default_context(cafile=str(cert))) as tls, \
            _server(tiny_ouro, tmp_path / "tls.log", tls, url, "--port", str(port), "--ssl-keyfile", str(key),
                    "--ssl-certfile", str(cert), "--ssl-ciphers", "ECDHE+AESGCM"):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, http_client=tls)
        out = client.completions.create(model=MODEL, prompt="To be", max_tokens=3, temperature=0)
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        # --ssl-ciphers (vLLM's flag): a client offering none of them is refused in the handshake (TLS 1.2: 1.3's
        # suites are not set by a cipher list)
        only_cbc = ssl.create_default_context(cafile=str(cert))
        only_cbc.maximum_version = ssl.TLSVersion.TLSv1_2
        only_cbc.set_ciphers("ECDHE+AES128+SHA")
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", verify=only_cbc, timeout=5)
    assert f"serving on https://127.0.0.1:{port}" in (tmp_path / "tls.log").read_text()


def test_a_unix_domain_socket_with_uds(tiny_ouro, tmp_path):
    """--uds PATH: the API on that socket (host and port unused), open to every user as uvicorn makes it (a proxy
    running as another user connects), said in the start-up line; the socket file removed when the server
    stops. A stale socket file left at PATH is replaced; one a live server answers on, or another kind of file, is
    refused."""
    path = tmp_path / "api.sock"
    import socket

    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))  # (a server killed without its clean-up leaves one)
    stale.close()
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(path))) as uds, \
            _server(tiny_ouro, tmp_path / "uds.log", uds, "http://loopserve", "--uds", str(path)):
        r = uds.post("http://loopserve/v1/completions",
                     json={"model": MODEL, "prompt": "To be", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert path.stat().st_mode & 0o777 == 0o666
        second = subprocess.run([sys.executable, "-m", "loopserve.cli", "serve", "--model", str(tiny_ouro), "--uds",
                                 str(path)], capture_output=True, text=True, timeout=60,
                                env=server_env())
        assert second.returncode == 2 and f"--uds: a server is listening on {path}" in second.stderr
        assert uds.get("http://loopserve/health").status_code == 200  # (its socket left alone)
    assert not path.exists()
    assert f"serving on http on unix:{path} " in (tmp_path / "uds.log").read_text()
    # a server still loading its model listens already: a second start finds it (it had taken the socket over)
    from loopserve.serve.cli import listen_unix

    loading = listen_unix(str(path))
    try:
        second = subprocess.run([sys.executable, "-m", "loopserve.cli", "serve", "--model", str(tiny_ouro), "--uds",
                                 str(path)], capture_output=True, text=True, timeout=60,
                                env=server_env())
        assert second.returncode == 2 and f"--uds: a server is listening on {path}" in second.stderr
    finally:
        loading.close()
        path.unlink()
    path.write_text("not a socket")
    assert "--uds" in subprocess.run(
        [sys.executable, "-m", "loopserve.cli", "serve", "--model", str(tiny_ouro), "--uds", str(path)],
        capture_output=True, text=True, timeout=60,
        env=server_env()).stderr.splitlines()[-1]


def test_tls_and_socket_flags_are_checked_before_the_model_loads(tmp_path):
    cert, key = _certificate(tmp_path)
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    from cryptography.hazmat.primitives import serialization

    locked = tmp_path / "locked.pem"  # (encrypted: refused, not asked for on the terminal)
    locked.write_bytes(serialization.load_pem_private_key(key.read_bytes(), None).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret")))
    cases = {
        ("--ssl-keyfile", str(key)): "--ssl-keyfile: needs --ssl-certfile",
        ("--ssl-certfile", str(bad)): "--ssl-certfile: cannot use it, with no --ssl-keyfile (the private key must",
        ("--ssl-certfile", str(tmp_path / "missing.pem")): "--ssl-certfile: cannot use it: No such file",
        # (each file named by its own flag: a missing key file was blamed on --ssl-certfile)
        ("--ssl-certfile", str(cert), "--ssl-keyfile", str(tmp_path / "missing.pem")):
            "--ssl-keyfile: cannot use it: No such file",
        ("--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--ssl-ca-certs", str(tmp_path / "missing.pem")):
            "--ssl-ca-certs: cannot use it: No such file",
        ("--ssl-certfile", str(cert)): "--ssl-certfile: cannot use it, with no --ssl-keyfile",
        ("--ssl-certfile", str(cert), "--ssl-keyfile", str(locked)): "--ssl-certfile, --ssl-keyfile: cannot use them",
        ("--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--ssl-cert-reqs", "2"):
            "--ssl-cert-reqs: asks for client certificates, so needs --ssl-ca-certs",
        ("--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--ssl-cert-reqs", "5"): "--ssl-cert-reqs: must be",
        ("--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--replicas", "2"):
            "--ssl-keyfile: not with Ray Serve replicas",
        ("--uds", str(tmp_path / "s"), "--replicas", "2"): "--uds: not with Ray Serve replicas",
        ("--ssl-ciphers", "ECDHE+AESGCM"): "--ssl-ciphers: needs --ssl-certfile",
        ("--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--ssl-ciphers", "NO-SUCH-CIPHER"):
            "--ssl-ciphers: no cipher OpenSSL knows matches 'NO-SUCH-CIPHER'",
    }
    for argv, words in cases.items():
        problem = _check(_serve(*argv))
        assert problem is not None and problem.startswith(words), (argv, problem)
    assert _check(_serve("--ssl-certfile", str(cert), "--ssl-keyfile", str(key))) is None


def test_access_log_lines_of_chosen_paths_are_dropped():
    """vLLM's --disable-access-log-for-endpoints: no access-log line for those paths, a query string aside (it was
    refused as an unknown flag)."""
    from loopserve.serve.cli import uvicorn_log_config
    from loopserve.serve.responses import QuietPathsFilter

    args = _serve("--disable-access-log-for-endpoints", "/health,/metrics")
    assert args.disable_access_log_for_endpoints == ["/health", "/metrics"] and _check(args) is None
    cfg = uvicorn_log_config("info", args.disable_access_log_for_endpoints)
    assert "quiet_paths" in cfg["loggers"]["uvicorn.access"]["filters"]
    made = cfg["filters"]["quiet_paths"]
    assert made["()"] == f"{QuietPathsFilter.__module__}.{QuietPathsFilter.__name__}"
    quiet = QuietPathsFilter(made["paths"])

    def line(path: str) -> logging.LogRecord:  # (as uvicorn's access logger makes one)
        return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5", "GET", path, "1.1", 200), None)

    assert [quiet.filter(line(p)) for p in ("/health", "/metrics?x=1", "/v1/models", "/healthz")] == [
        False, False, True, True]
    assert "quiet_paths" not in uvicorn_log_config("info")["filters"]


def test_the_logged_address_of_an_ipv6_host_is_bracketed():
    """`--host ::` was logged as "http://:::8000", which no client can use."""
    assert url_base("http", "::", 8000) == "http://[::]:8000"
    assert url_base("https", "::1", 443) == "https://[::1]:443"
    assert url_base("http", "127.0.0.1", 8000) == "http://127.0.0.1:8000"
