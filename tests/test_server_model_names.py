"""`--served-model-name` with one name and with several (vLLM's `--served-model-name a b`): the flag as parsed
(and as a Ray Serve config gives it), then real `loopserve serve` processes. A request's `model` may give any
served name (absent or empty: the first), another name is a 404 naming `model`; /v1/models lists one card per
name and /v1/models/{name} returns that name's card; a response reports the name its request gave (absent or empty:
the first), as vLLM's do (`OpenAIServing._get_model_name`), and metrics the first. Also: the serve subcommand's own
usage on a flag it does not know (not the top-level `loopserve` usage), and a later name that is a checkpoint folder
refused as the model swallowed by the flag."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from loopserve.cli import build_parser, main
from loopserve.serve.api import ServerSettings
from loopserve.serve.cli import _check
from tests.server_helpers import REPO, Server, metric, run_server, sse_events

pytestmark = pytest.mark.timeout(120)

C, CHAT = "/v1/completions", "/v1/chat/completions"
SEVERAL = ("first", "org/second", "third")  # (a hub-style name with a '/' among them)
NAMINGS = {"one": ("solo",), "several": SEVERAL}


def _serve(*argv: str):
    return build_parser().parse_args(["serve", *argv])


# -- the flag --------------------------------------------------------------------------------------------------
def test_the_flag_takes_one_name_or_several():
    assert _serve("--served-model-name", "a").served_model_name == ["a"]
    args = _serve("tiny", "--served-model-name", "a", "b")  # refused before: "unrecognized arguments: b"
    assert (args.model_tag, args.served_model_name) == ("tiny", ["a", "b"])
    args = _serve("--model", "m", "--served-model-name", "a", "org/b", "--port", "1")
    assert (args.model, args.served_model_name, args.port) == ("m", ["a", "org/b"], 1)
    assert _serve("--served-model-name", "a", "--served-model-name", "b").served_model_name == ["b"]  # last wins
    assert _serve().served_model_name is None


@pytest.mark.parametrize("argv", [["--bogus"], ["m", "extra"], ["m", "--served-model-name", "a", "b", "--nope", "1"]],
                         ids=["unknown-flag", "extra-positional", "after-names"])
def test_unknown_arguments_show_the_serve_usage(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2
    # serve's own usage, short (as vLLM's: the generated one was some 130 lines of flags before the error)
    assert err.startswith("usage: loopserve serve [model_tag] [options]") and len(err.splitlines()) == 2, err
    assert "loopserve serve: error: unrecognized arguments: " in err, err


def test_bad_values_keep_the_serve_usage(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--served-model-name"])
    err = capsys.readouterr().err
    assert err.startswith("usage: loopserve serve ") and "--served-model-name: expected at least one argument" in err


def test_a_port_in_use_or_a_bad_host_is_an_error_before_the_model_loads(capsys, monkeypatch):
    """(It was said after the model had loaded, under a "serving on" line: uvicorn's own bind error, exit 3.)"""
    import socket

    from loopserve.serve import cli as serve_cli

    def no_load(args):
        raise AssertionError("the model loaded before the socket was bound")

    monkeypatch.setattr(serve_cli, "load_server", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for argv, words in ((["--port", str(port)], f"error: --port: cannot listen on 127.0.0.1:{port}: Address "
                                                    "already in use"),
                            (["--host", "nohost.invalid"], "error: --host: 'nohost.invalid' is not an address of this "
                                                           "machine")):
            with pytest.raises(SystemExit) as e:
                main(["serve", *argv])
            assert e.value.code == 2 and capsys.readouterr().err.startswith(words)


def test_a_model_path_taken_as_a_name_is_refused(tmp_path, monkeypatch):
    """A later name that is a checkpoint folder (a config.json in it) is the model the flag swallowed; one that
    merely exists here (a folder or file of the working directory) is a name."""
    (tmp_path / "config.json").write_text("{}")
    problem = _check(_serve("--served-model-name", "a", str(tmp_path)))
    assert problem is not None and problem.startswith("--served-model-name took the model"), problem
    assert str(tmp_path) in problem
    assert _check(_serve(str(tmp_path), "--served-model-name", "a", "b")) is None
    assert _check(_serve("--model", str(tmp_path), "--served-model-name", "a", "b")) is None
    # from the repository root, with the embedded model: "docs" and "README.md" exist there, and are names
    monkeypatch.chdir(REPO)
    assert Path("docs").is_dir() and Path("README.md").is_file()
    assert _check(_serve("--served-model-name", "ouro", "docs", "README.md")) is None
    assert _check(_serve("--served-model-name", "ouro", str(tmp_path.parent))) is None  # (no config.json there)
    # vLLM's --api-key k1 k2 takes several keys after one flag too
    problem = _check(_serve("--api-key", "k1", str(tmp_path)))
    assert problem == f"--api-key took the model {str(tmp_path)!r} as a key; give the model before the flag or as " \
                      "--model", problem


def test_settings_hold_one_tuple_of_names():
    s = ServerSettings(model_names=("a", "b", "a"))
    assert (s.model_names, s.model_name) == (("a", "b"), "a")
    for bad in ("a", (), ("a", "")):
        with pytest.raises(ValueError, match="model_names"):
            ServerSettings(model_names=bad)  # type: ignore[arg-type]


def test_ray_config_gives_one_name_or_a_list(tmp_path):
    lray = pytest.importorskip("loopserve.serve.ray")
    assert lray.flags_from_config({"model": str(tmp_path), "served_model_name": ["a", "b"],
                                   "port": 1}).served_model_name == ["a", "b"]
    assert lray.flags_from_config({"model": str(tmp_path), "served-model-name": "a"}).served_model_name == ["a"]
    assert lray.flags_from_config({"model": str(tmp_path), "served_model_name": None}).served_model_name is None


# -- a server ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=list(NAMINGS), ids=list(NAMINGS))
def named(request, tiny_ouro, tmp_path_factory) -> Iterator[tuple[Server, tuple[str, ...]]]:
    names = NAMINGS[request.param]
    log = tmp_path_factory.mktemp(f"names-{request.param}") / "server.log"
    # (after the helper's own --served-model-name: the last flag wins)
    with run_server(tiny_ouro, log, "--served-model-name", *names, "--kv-cache-tokens", "1024",
                    "--max-model-len", "64", log_level="info") as s:
        yield s, names


def test_models_list_has_a_card_per_name(named):
    server, names = named
    cards = server.client().models.list().data
    assert [c.id for c in cards] == list(names)
    for card in cards:
        assert (card.object, card.owned_by) == ("model", "loopserve")
        # one model behind every name: the same root (the first name: the path stays private)
        assert (card.model_extra["root"], card.model_extra["max_model_len"]) == (names[0], 64)
        [permission] = card.model_extra["permission"]  # (vLLM's one entry)
        assert permission["object"] == "model_permission" and permission["allow_sampling"] is True


def test_models_retrieve_each_name(named):
    server, names = named
    client = server.client()
    listed = {c.id: c.model_dump() for c in client.models.list().data}
    for name in names:
        card = client.models.retrieve(name)
        assert card.id == name and card.model_dump() == listed[name]


@pytest.mark.parametrize("unknown", ["tiny", "other", "first/"])
def test_models_retrieve_of_another_name_is_a_404_naming_model(named, unknown):
    server, _ = named
    with pytest.raises(openai.NotFoundError) as e:
        server.client().models.retrieve(unknown)
    assert e.value.body["param"] == "model" and f"`{unknown}`" in e.value.body["message"]


def test_models_slash_names_no_model(named):
    r = httpx.get(named[0].url + "/v1/models/", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text


def test_a_request_may_name_any_served_name(named):
    """Each name (and none) reaches the model; the response reports the name the request gave, else the first, as
    vLLM's do (completions, chat, stream chunks, beam search); metrics are labelled with the first name."""
    server, names = named
    client = server.client()
    for name in names:
        r = client.completions.create(model=name, prompt="hi", max_tokens=2, temperature=0)
        assert (r.model, r.usage.completion_tokens) == (name, 2)
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2, temperature=0)
        assert chat.model == name and chat.choices[0].message.content is not None
        chunks = list(client.completions.create(model=name, prompt="hi", max_tokens=2, stream=True,
                                                stream_options={"include_usage": True}))
        assert len(chunks) > 1 and {c.model for c in chunks} == {name}  # (the usage chunk too)
        chunks = list(client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=2, stream=True))
        assert chunks and {c.model for c in chunks} == {name}
        for stream in (False, True):
            beam = server.post(C, {"model": name, "prompt": "hi", "max_tokens": 2, "use_beam_search": True, "n": 2,
                                   "stream": stream})
            assert beam.status_code == 200, beam.text
            bodies = [json.loads(e) for e in sse_events(beam.text.splitlines()) if e != "[DONE]"] if stream else [
                beam.json()]
            assert bodies and {b["model"] for b in bodies} == {name}, bodies
        tokenized = server.post("/tokenize", {"model": name, "prompt": "hi"})
        assert tokenized.status_code == 200 and tokenized.json()["count"] > 0, tokenized.text
    same = [client.completions.create(model=n, prompt="hi", max_tokens=3, temperature=0).choices[0].text
            for n in names]
    assert len(set(same)) == 1  # one model behind every name
    for absent in ({"model": ""}, {}):
        r = server.post(C, {**absent, "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == names[0], r.text
    assert metric(server, "loopserve:request_success_total", model_name=names[0]) >= len(names)
    for other in names[1:]:
        assert metric(server, "loopserve:request_success_total", 0.0, model_name=other) == 0


@pytest.mark.parametrize("path", [C, CHAT, "/tokenize"])
def test_an_unknown_name_is_a_404_naming_model(named, path):
    server, names = named
    body = {"prompt": "hi"} if path != CHAT else {"messages": [{"role": "user", "content": "hi"}]}
    for unknown in ("tiny", "nope", f"{names[0]} "):
        r = server.post(path, {"model": unknown, **body, **({"max_tokens": 1} if path != "/tokenize" else {})})
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert (error["param"], error["type"]) == ("model", "NotFoundError")
        assert f"`{unknown}`" in error["message"]


def test_the_startup_line_names_every_name(named):
    server, names = named
    served = ", ".join(repr(n) for n in names)
    assert f" served as {served}: " in Path(server.log).read_text()
