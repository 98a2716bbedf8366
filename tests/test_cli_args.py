"""Command-line flags come from the config dataclasses: every `EngineConfig` knob is reachable from
`generate`, `demo`, `serve` and every `bench` command that runs the engine, with the dataclass's
defaults and the choice lists the code itself accepts."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from loopserve.cache.layout import LAYOUTS
from loopserve.cli import EXIT_FLAGS, build_parser, engine_kwargs
from loopserve.config_args import FlagParser
from loopserve.engine.config import ENGINE_SCHEDULERS, SCHEDULERS, EngineConfig
from loopserve.exits import DEFAULT_POLICIES
from loopserve.sampling_params import EXIT_FIELDS
from loopserve.vllm_neutral import NEUTRAL, SERVE_NEUTRAL
from loopserve_lab.bench.cli import BENCH_DRIVEN, engine_overrides

FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
BENCH_COMMANDS = ("record", "throughput", "serve", "ablate min-coda")


def _actions(argv: list[str]) -> dict[str, argparse.Action]:
    """dest -> argparse action of the (sub)command that `argv` names."""
    parser = build_parser()
    for word in argv:
        (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = sub.choices[word]
    return {a.dest: a for a in parser._actions}


@pytest.mark.parametrize("command", ["generate", "demo", "serve"])
def test_every_engine_knob_is_a_flag_with_the_config_default(command):
    args = build_parser().parse_args([command])
    assert engine_kwargs(args) == dataclasses.asdict(EngineConfig())
    actions = _actions([command])
    assert FIELDS <= set(actions)
    # serve runs a batching engine: the reference decoder is not offered (nor taken: argparse's exit 2)
    assert list(actions["scheduler"].choices or ()) == list(ENGINE_SCHEDULERS if command == "serve" else SCHEDULERS)
    assert list(actions["kv_layout"].choices or ()) == list(LAYOUTS)
    assert list(actions["exit_policy"].choices or ()) == list(DEFAULT_POLICIES)  # (a trace is a request's own)
    assert set(EXIT_FIELDS) <= set(actions) and set(EXIT_FLAGS) == set(EXIT_FIELDS)  # (each exit field a flag)


def test_serve_refuses_the_reference_scheduler_as_a_flag():
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--scheduler", "reference"])
    assert e.value.code == 2
    assert build_parser().parse_args(["generate", "--scheduler", "reference"]).scheduler == "reference"


def test_flags_reach_the_config():
    args = build_parser().parse_args(["generate", "--kv-layout", "shared", "--no-pipeline-core-steps", "--async-coda",
                                      "--min-coda-batch", "3", "--min-prelude-batch", "2", "--lookahead",
                                      "--kv-cache-memory-gb", "0.25"])
    cfg = EngineConfig(**engine_kwargs(args))
    assert (cfg.kv_layout, cfg.pipeline_core_steps, cfg.async_coda, cfg.min_coda_batch, cfg.min_prelude_batch,
            cfg.lookahead, cfg.kv_cache_memory_gb) == ("shared", False, True, 3, 2, True, 0.25)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--kv-layout", "paged"])


@pytest.mark.parametrize("command", BENCH_COMMANDS)
def test_bench_commands_reach_every_knob_but_the_ones_they_drive(command):
    argv = ["bench", *command.split()]
    actions = _actions(argv[:2])
    assert FIELDS - set(BENCH_DRIVEN) <= set(actions)
    assert not set(BENCH_DRIVEN) & set(actions)
    assert engine_overrides(build_parser().parse_args(argv)) == {}  # unset: the benchmark chooses
    args = build_parser().parse_args([*argv, "--kv-layout", "last_exited", "--no-lookahead", "--max-num-seqs", "9"])
    assert engine_overrides(args) == {"kv_layout": "last_exited", "lookahead": False, "max_num_seqs": 9}


def _subparser(argv: list[str]) -> argparse.ArgumentParser:
    parser = build_parser()
    for word in argv:
        (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = sub.choices[word]
    return parser


def test_every_serve_flag_has_help_that_shows_its_default():
    parser = _subparser(["serve"])
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help and action.help.strip(), f"{action.option_strings[0]}: no help"
        if action.default is argparse.SUPPRESS:  # (vLLM's neutral flags: unset unless given, no default to show)
            assert action.dest in NEUTRAL or action.dest in SERVE_NEUTRAL, action.dest
            continue
        shown = formatter._expand_help(action)
        assert f"default: {action.default}" in shown, (action.option_strings[0], shown)
        assert shown.count("default:") == 1, shown


@pytest.mark.parametrize(("command", "schedulers"), [("serve", ENGINE_SCHEDULERS), ("generate", SCHEDULERS)])
def test_a_commands_scheduler_help_describes_the_choices_it_takes(command, schedulers):
    """serve's help offered "reference: the sequential oracle", which serve refuses (it is no engine to serve from)."""
    (action,) = [a for a in _subparser([command])._actions if a.dest == "scheduler"]
    assert tuple(action.choices) == schedulers
    described = re.findall(r"(?:^|; )([a-z-]+): ", action.help)
    assert described == list(schedulers), action.help


@pytest.mark.parametrize(("argv", "refusal"), [
    ("--enable-chunked-prefill", None), ("--no-enable-chunked-prefill", None), ("--enable-chunked-prefill false", None),
    ("--kv-cache-dtype auto", None), ("--max-logprobs 20", None), ("--pipeline-parallel-size 1", None),
    ("--hf-overrides {}", None), ("--revision main", None), ("--uvicorn-log-level debug", None),
    ("--disable-uvicorn-access-log", None),
    ("--quantization awq", "quantization: not supported by loopserve (weights load unquantized"),
    ("--kv-cache-dtype fp8", "kv_cache_dtype: not supported by loopserve"),
    ("--max-logprobs 5", None), ("--max-logprobs -1", None), ("--max-logprobs -2", "max_logprobs: must be"),
    ("--data-parallel-size 2", "data_parallel_size: not supported by loopserve"),
    ("--skip-tokenizer-init", "skip_tokenizer_init: not supported by loopserve"),
    ("--enable-chunked-prefill False", None), ("--no-enable-lora", None), ("--tokenizer-revision None", None),
    # (a local folder, the embedded model here, has no revisions: any is taken, unused, as vLLM ignores it there)
    ("--revision abc123 --tokenizer-revision main", None),
    ("nobody/nothing --revision abc123", "revision: not supported by loopserve (a hub id is fetched at its default"),
    ("nobody/nothing --tokenizer-revision v2", "tokenizer_revision: not supported by loopserve"),
    ("--enable-lora", "enable_lora: not supported by loopserve (no LoRA adapters); it takes False, got True"),
    ("--hf-token hf_SECRET", "hf_token: not supported by loopserve"),
])
def test_serve_takes_vllms_flags_for_what_it_lacks_at_their_neutral_values(argv, refusal):
    """A vLLM launch line runs as it is where it asks for nothing loopserve lacks, and is refused naming the flag's
    keyword where it does (these flags stopped start-up with argparse's bare 'unrecognized arguments')."""
    from loopserve.serve.cli import _check

    said = _check(build_parser().parse_args(["serve", *argv.split()]))
    assert said == refusal if refusal is None else said.startswith(refusal), said
    assert "SECRET" not in (said or "")  # (a token is not repeated into logs)


@pytest.mark.parametrize("switch", ["--disable-custom-all-reduce", "--enable-chunked-prefill", "--enable-lora",
                                    "--no-enable-chunked-prefill"])
def test_vllms_switches_take_no_value_so_a_model_after_one_stays_the_model(switch):
    """A switch that took an optional value swallowed the model path: `serve --disable-custom-all-reduce /m` served
    the embedded model without a word."""
    assert build_parser().parse_args(["serve", switch, "/m"]).model_tag == "/m"


def test_serve_takes_vllm_flag_names():
    args = build_parser().parse_args(["serve", "--max-model-len", "512", "--gpu-memory-utilization", "0.8",
                                      "--api-key", "a", "--api-key", "b", "--allowed-origins", '["https://x.example"]',
                                      "--allowed-methods", "GET,POST", "--allow-credentials", "--root-path", "/p",
                                      "--enable-log-requests", "--disable-log-stats", "--dtype", "auto",
                                      "--device", "auto"])
    assert (args.max_model_len, args.gpu_memory_utilization, args.api_key) == (512, 0.8, ["a", "b"])
    assert (args.allowed_origins, args.allowed_methods) == (["https://x.example"], ["GET", "POST"])
    assert args.allow_credentials and args.enable_log_requests and args.disable_log_stats
    assert (args.root_path, args.dtype, args.device) == ("/p", "auto", "auto")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--allowed-origins", '["unclosed"'])
    # vLLM's --uvicorn-log-level is uvicorn's alone (it was an alias of --log-level), its "trace" too
    args = build_parser().parse_args(["serve", "--uvicorn-log-level", "trace"])
    assert (args.log_level, args.uvicorn_log_level) == ("info", "trace")
    # vLLM's form: several keys after one flag (`unrecognized arguments: k2`), and mixed with the repeated flag
    args = build_parser().parse_args(["serve", "/m", "--api-key", "k1", "k2", "--api-key", "k3"])
    assert (args.api_key, args.model_tag) == (["k1", "k2", "k3"], "/m")


@pytest.mark.parametrize("name", ["max_decode_batch", "min_coda_batch", "min_prelude_batch"])
def test_batch_knobs_below_one_are_refused(name):
    with pytest.raises(ValueError, match=f"^{name}: must be an integer >= 1"):
        EngineConfig(**{name: 0})



def test_min_prelude_batch_above_the_decode_width_is_refused():
    """A core batch with work never has that much room: such a floor would silently turn refill off."""
    with pytest.raises(ValueError, match=r"^min_prelude_batch: must be <= max_decode_batch \(4\)"):
        EngineConfig(max_decode_batch=4, min_prelude_batch=5)


def test_boundary_batches_default_by_the_models_boundary_layers():
    """Unset, a coda batch waits for half a decode batch of exited tokens and a prelude batch of its own for a
    quarter, but only for a model whose coda or prelude has layers (Huginn: each such batch re-reads their
    weights, docs/benchmarks.md §8.34); a fully looped model (Ouro's prelude is the embedding, its coda the head)
    runs them at once. Set, the knobs win."""
    cfg = EngineConfig(max_decode_batch=32)
    assert cfg.boundary_batches_for(0, 0) == (1, 1)
    assert cfg.boundary_batches_for(2, 2) == (8, 16)
    assert cfg.boundary_batches_for(2, 0) == (8, 1) and cfg.boundary_batches_for(0, 2) == (1, 16)
    assert EngineConfig(max_decode_batch=2).boundary_batches_for(1, 1) == (1, 1)
    assert EngineConfig(max_decode_batch=32, min_coda_batch=3, min_prelude_batch=2).boundary_batches_for(2, 2) == (2, 3)


def test_the_serving_benchmark_passes_every_knob_to_its_server():
    """`bench serve` in HTTP mode starts `loopserve serve` with every engine knob it runs in-process (each
    set here to a value other than its default, bools both ways), under the flags `serve` reads back."""
    from loopserve_lab.bench.serve import server_command

    given = dict(kv_layout="shared", block_size=4, kv_cache_tokens=96, kv_cache_memory_gb=0.5, max_num_seqs=7,
                 max_decode_batch=6, max_num_batched_tokens=40, prefill_chunk_size=8, min_coda_batch=3,
                 min_prelude_batch=2, kv_safety_margin=0.2, enable_prefix_caching=False, lookahead=True,
                 pipeline_core_steps=False, async_coda=True, cuda_graphs=False, cuda_graph_warmup_tokens=64,
                 num_speculative_tokens=2, speculative_draft_loops=2, speculative_max_batch=4,
                 speculative_min_acceptance=0.5, max_logprobs=5)
    assert set(given) == FIELDS - {"scheduler"}  # (a new knob must be added here)
    cmd = server_command(Path("m"), "cb", given, "float32", "cpu", port=1)
    cfg = engine_kwargs(build_parser().parse_args(cmd[cmd.index("serve"):]))
    assert cfg == {**given, "scheduler": "cb"}
    cmd = server_command(Path("m"), "cdb", {**given, "async_coda": False, "lookahead": None}, "float32", "cpu", port=1)
    cfg = engine_kwargs(build_parser().parse_args(cmd[cmd.index("serve"):]))
    assert (cfg["async_coda"], cfg["lookahead"]) == (False, EngineConfig.lookahead)


def test_the_gpu_check_commands_parse_and_name_their_graphs():
    """A lent GPU gives a session 15 minutes: a flag mistyped in `scripts/gpu_check.sh` would cost a step there.
    Every `loopserve` command in it parses here, and each throughput and ablation run says --cuda-graphs or
    --no-cuda-graphs (unset, graphs are on for CUDA: a step's meaning must not hang on the default)."""
    import re
    import shlex

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
    text = re.sub(r"\\\n\s*", " ", script.read_text())  # (continued lines joined)
    commands = [m.group(1) for m in re.finditer(r"\$PY -m loopserve\.cli (.*)", text)]
    assert commands and len(commands) == text.count("loopserve.cli")  # (the pattern found every one)
    for line in commands:
        argv = shlex.split(line.replace("$OUT", "/tmp/out").replace("$floor", "8"))
        args = build_parser().parse_args(argv)  # (exits on an unknown flag or a bad value)
        if argv[1] in ("throughput", "ablate"):
            assert engine_overrides(args).get("cuda_graphs") is not None, line
    for test_file in re.search(r"pytest .*?((?:tests/\S+ ?)+)", text).group(1).split():  # type: ignore[union-attr]
        assert (script.parents[1] / test_file).is_file(), test_file


def _shown_help(argv: list[str]) -> dict[str, str]:
    """`--flag` -> its help as `--help` prints it (defaults filled in), for the (sub)command `argv` names."""
    parser = _subparser(argv)
    formatter = parser._get_formatter()
    return {a.option_strings[0]: formatter._expand_help(a) if a.help else ""
            for a in parser._actions if a.option_strings and a.dest != "help"}


@pytest.mark.parametrize("command", ["generate", "demo", "make-tiny"])
def test_every_flag_of_the_runtime_commands_has_help_that_shows_its_default(command):
    parser = _subparser([command])
    for flag, shown in _shown_help([command]).items():
        action = next(a for a in parser._actions if flag in a.option_strings)
        assert shown.strip(), f"{command} {flag}: no help"
        assert f"default: {action.default}" in shown, (flag, shown)
        assert shown.count("default:") == 1, shown


@pytest.mark.parametrize(("argv", "flags"), [
    (["generate"], {"--exit-threshold": "None", "--exit-policy": "None", "--min-loops": "None",
                    "--max-loops": "None", "--ignore-eos": "False", "--threads": "None"}),
    (["make-tiny"], {"--arch": "ouro", "--seed": "0", "--hidden-size": "64", "--shards": "1",
                     "--lookahead-gate": "False"}),
    (["eval", "ppl"], {"--out-json": "eval-results/embedded-model-results.json", "--plots-dir": "eval-results"}),
    (["bench", "throughput"], {"--sweep": "width", "--widths": "8,16,32,64", "--width": "32", "--repeats": "1",
                               "--num-requests": "128", "--workload": "alpaca", "--scale": "1.0", "--seed": "0"}),
    (["bench", "theory"], {"--r-max": "the config's", "--dtype": "bfloat16"}),
])
def test_flags_say_their_defaults(argv, flags):
    shown = _shown_help(argv)
    for flag, default in flags.items():
        assert f"default: {default}" in shown[flag], (flag, shown[flag])


def test_the_width_sweep_default_parses_to_widths():
    args = build_parser().parse_args(["bench", "throughput"])
    assert args.widths == [8, 16, 32, 64]


def test_eval_writes_outside_the_docs_unless_told():
    """Run from the repository's root, `eval ppl` and `eval trajectories` must not overwrite committed docs/ files
    by default; docs/embedded-model.md passes those paths itself."""
    ppl = build_parser().parse_args(["eval", "ppl"])
    traj = build_parser().parse_args(["eval", "trajectories"])
    for path in (ppl.out_json, ppl.plots_dir, traj.out_dir):
        assert Path(path).parts[0] == "eval-results", path
    doc = (Path(__file__).resolve().parents[1] / "docs" / "embedded-model.md").read_text()
    assert "--out-json docs/embedded-model-results.json --plots-dir docs" in doc
    assert "eval trajectories --out-dir docs/trajectories" in doc


def _one_error_line(stderr: str) -> str:
    """The one `error:` line a refusal prints, with no traceback before or after it."""
    err = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
    assert len(err) == 1 and "Traceback" not in stderr and stderr.endswith(err[0] + "\n"), stderr
    return err[0]


@pytest.mark.parametrize(("argv", "message"), [
    (["eval", "ppl", "/nonexistent"], "error: model: '/nonexistent' is not a model folder"),
    # (it rewrote the packaged embedded model's config.json, so the defaults of LLM() and `demo`, without a word)
    (["eval", "ppl", "--calibrate"], "error: --calibrate writes the chosen threshold into the model's config.json"),
    (["bench", "throughput", "--from-json", "/missing.json"], "error: --from-json: /missing.json: No such file"),
    (["bench", "step-latency", "--from-json", "/missing.json"], "error: --from-json: /missing.json: No such file"),
    # (run as `__main__`, the module's own `CommandError` class was not the one `bench` raises: exit 2, silently)
    (["bench", "throughput", "--model", "/nonexistent", "--no-progress", "--out", "out"],
     "error: --model: '/nonexistent' is neither a bench preset"),
    # (the positional model was named as the --model flag, which the user did not type; vLLM's `serve MODEL`)
    (["serve", "/nonexistent", "--port", "0"], "error: model: '/nonexistent' is not a model folder"),
    (["serve", "--model", "/nonexistent", "--port", "0"], "error: --model: '/nonexistent' is not a model folder"),
])
def test_refusals_are_one_error_line_with_status_2_run_as_a_module(argv, message, tmp_path):
    """`python -m loopserve.cli` (as the tests and docs run it) refuses a missing model or results file with one
    `error:` line and status 2, as the `loopserve` script does; a refused bench run leaves no results folder."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "loopserve.cli", *argv], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert _one_error_line(r.stderr).startswith(message), r.stderr
    assert list(tmp_path.iterdir()) == []


def test_from_json_that_is_not_the_commands_results_is_one_error_line(tmp_path, capsys):
    """`--from-json` given a file that is not JSON, or not the command's own results: an `error:` line, status 2."""
    from loopserve.cli import main

    def refused(argv: list[str]) -> str:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        return _one_error_line(capsys.readouterr().err)

    bad, other = tmp_path / "bad.json", tmp_path / "other.json"
    bad.write_text("{not json")
    other.write_text('{"points": []}')
    for command in ("throughput", "step-latency"):
        assert refused(["bench", command, "--from-json", str(bad)]).startswith(f"error: --from-json: {bad}: not JSON")
    assert "not the results of `loopserve bench throughput` (no 'sweeps')" in refused(
        ["bench", "throughput", "--from-json", str(other)])
    other.write_text('{"sweeps": {}}')
    assert "not the results of `loopserve bench step-latency` (no 'points')" in refused(
        ["bench", "step-latency", "--from-json", str(other)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "other.json"]  # (nothing written)


def test_empty_api_keys_fall_back_to_the_variable_with_a_warning(monkeypatch, caplog):
    """`--api-key "$KEY"` with KEY unset: no key of its own, so $LOOPSERVE_API_KEY (vLLM's rule), said in the log."""
    from loopserve.serve.cli import API_KEY_ENVS, _api_keys

    ours = API_KEY_ENVS[0]
    monkeypatch.delenv(API_KEY_ENVS[1], raising=False)
    monkeypatch.delenv(ours, raising=False)
    assert _api_keys(["a", ""]) == ["a"] and not caplog.records
    assert _api_keys([""]) == []
    assert "without a key" in caplog.text
    monkeypatch.setenv(ours, "secret")
    caplog.clear()
    assert _api_keys([""]) == ["secret"] and f"taking ${ours}" in caplog.text
    assert _api_keys(None) == ["secret"]
    monkeypatch.delenv(ours)
    monkeypatch.setenv(API_KEY_ENVS[1], "vllms")  # (vLLM's variable, where ours is unset)
    caplog.clear()
    assert _api_keys([""]) == ["vllms"] and f"taking ${API_KEY_ENVS[1]}" in caplog.text


@pytest.mark.parametrize("argv, prog", [(["generate", "--bogus"], "loopserve generate"),
                                        (["bench", "throughput", "--bogus"], "loopserve bench throughput"),
                                        (["eval", "ppl", "--bogus"], "loopserve eval ppl")])
def test_an_unknown_flag_is_reported_with_its_commands_usage(argv, prog, capsys):
    """argparse reported it with the top parser's usage (`usage: loopserve [-h] {generate,...}`), not the command's."""
    from loopserve.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"usage: {prog} ") and err.endswith(
        f"{prog}: error: unrecognized arguments: --bogus\n"), err


def test_version_flag_and_a_missing_command(capsys):
    from loopserve import __version__
    from loopserve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"loopserve {__version__}\n"
    for argv, missing in (([], "COMMAND"), (["bench"], "BENCHMARK"), (["eval"], "EVALUATION")):
        with pytest.raises(SystemExit):
            main(argv)
        assert capsys.readouterr().err.endswith(f"error: the following arguments are required: {missing}\n")


def _every_parser(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """`parser` and its subcommands' parsers, at every depth."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [parser, *(q for sub in subs for p in sub.choices.values() for q in _every_parser(p))]


def test_no_parser_takes_an_abbreviated_flag(capsys):
    """argparse's prefix matching read `serve MODEL --config c.yaml` as --config-format (a vLLM flag taken at its
    neutral values): a flag is only ever its own full name, in every command, the soak test's too."""
    from loopserve_lab.bench import soak

    parsers = _every_parser(build_parser())
    assert len(parsers) > 15 and all(isinstance(p, FlagParser) and not p.allow_abbrev for p in parsers)
    for argv in (["serve", "/m", "--config-form", "auto"], ["serve", "--max-model", "64"],
                 ["bench", "throughput", "--max-num", "9"], ["generate", "--max-tok", "3"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 2 and f"unrecognized arguments: {argv[-2]}" in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):  # (--duration for --duration-s ran a soak)
        soak.main(["--duration", "-1"])
    assert "required: --duration-s" in capsys.readouterr().err


def test_long_flags_may_be_spelled_with_underscores():
    """vLLM's parser takes `--max_model_len` for `--max-model-len`: every long flag so, the --no- forms too; a value
    keeps its underscores, and an unknown flag is named as it was given."""
    args = build_parser().parse_args(["serve", "--max_model_len", "64", "--no_enable_prefix_caching",
                                      "--served_model_name", "a_b", "--kv_cache_tokens=96", "--enable_chunked_prefill"])
    assert (args.max_model_len, args.enable_prefix_caching, args.served_model_name) == (64, False, ["a_b"])
    assert args.kv_cache_tokens == 96 and args.enable_chunked_prefill is True
    assert build_parser().parse_args(["bench", "throughput", "--max_num_seqs", "9"]).max_num_seqs == 9
    args, unknown = build_parser().parse_known_args(["generate", "--bogus_flag", "--", "--max_tokens"])
    assert unknown == ["--bogus_flag"] and args.prompts == ["--max_tokens"] and args.max_tokens is None


@pytest.mark.parametrize(("value", "want"), [("32k", 32000), ("32K", 32768), ("1.5k", 1500), ("4.35k", 4350),
                                              ("2m", 2_000_000), ("1M", 2**20), ("1g", 10**9), ("1G", 2**30),
                                              ("512", 512)])
def test_token_counts_take_vllms_human_readable_suffixes(value, want):
    """vLLM's --max-model-len 32k (and --max-num-batched-tokens): k, m, g thousands, K, M, G powers of 1024."""
    args = build_parser().parse_args(["serve", "--max-model-len", value, "--max-num-batched-tokens", value])
    assert args.max_model_len == args.max_num_batched_tokens == want


@pytest.mark.parametrize(("value", "said"), [("1.5K", "a fraction only with k, m, g or t"),
                                             ("32x", "expected an integer (or with a suffix")])
def test_a_bad_human_readable_count_names_the_flag(value, said, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["generate", "--max-model-len", value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: argument --max-model-len: " in err and said in err, err


def _serve_with_config(tmp_path: Path, text: str, *argv: str) -> argparse.Namespace:
    config = tmp_path / "c.yaml"
    config.write_text(text)
    return build_parser().parse_args(["serve", *argv[:1], "--config", str(config), *argv[1:]])


def test_serve_reads_vllms_config_file_under_the_command_line(tmp_path):
    """vLLM's `--config FILE.yaml` (it was read as --config-format, an abbreviation): a mapping of flag names, with
    dashes or underscores; a list for a list flag, true or false for a switch; the command line wins over the file,
    which wins over the defaults (a repeatable flag given on the command line replaces the file's values)."""
    text = ("port: 8123\nmax-model-len: 32k\nmax_num_seqs: 7\nserved-model-name: [a, b]\nenable-log-requests: true\n"
            "enable_prefix_caching: false\napi-key: [k1, k2]\nenable-chunked-prefill: true\nallowed-origins: "
            "['https://a.example']\nkv-cache-tokens: null\n")
    args = _serve_with_config(tmp_path, text, "/m", "--port", "9000", "--max_num_seqs", "3")
    assert (args.model_tag, args.port, args.max_model_len, args.max_num_seqs) == ("/m", 9000, 32000, 3)
    assert (args.served_model_name, args.api_key, args.allowed_origins) == (["a", "b"], ["k1", "k2"],
                                                                            ["https://a.example"])
    assert args.enable_log_requests and args.enable_prefix_caching is False and args.enable_chunked_prefill is True
    assert args.kv_cache_tokens is None and args.block_size == EngineConfig.block_size  # (the defaults)
    args = _serve_with_config(tmp_path, text, "/m", "--api-key", "z", "--served-model-name", "x",
                              "--enable-prefix-caching")
    assert (args.api_key, args.served_model_name, args.enable_prefix_caching, args.port) == (["z"], ["x"], True, 8123)
    args = _serve_with_config(tmp_path, text, "/m", "--disable-log-requests")  # (the file's --enable-log-requests)
    assert args.disable_log_requests and not args.enable_log_requests
    assert _serve_with_config(tmp_path, "# nothing set\n").port == 8000


@pytest.mark.parametrize(("text", "said"), [
    ("port: 1\nnonsense: 2\n", "c.yaml: nonsense: not a `loopserve serve` flag"),
    ("- port\n- 8000\n", "c.yaml: expected a mapping of flag names to values (port: 8000), got a list"),
    ("port: [1\n", "c.yaml: not valid YAML: "),
    ("enable-log-requests: maybe\n", "c.yaml: enable-log-requests: expected true or false"),
    ("config: other.yaml\n", "c.yaml: config: a config file cannot name another"),
    ("port: abc\n", "argument --port: invalid int value: 'abc'"),
])
def test_a_config_file_that_is_not_flags_is_one_error_naming_the_file_and_key(tmp_path, capsys, text, said):
    with pytest.raises(SystemExit) as e:
        _serve_with_config(tmp_path, text, "/m")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: loopserve serve ") and said in err.splitlines()[-1], err


def test_a_missing_or_repeated_config_file_is_one_error(tmp_path, capsys):
    for argv, said in ((["--config", str(tmp_path / "none.yaml")], f"--config {tmp_path / 'none.yaml'}: No such file"),
                       (["--config", "a.yaml", "--config=b.yaml"], "--config: given 2 times; give one file")):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["serve", *argv])
        assert e.value.code == 2 and said in capsys.readouterr().err.splitlines()[-1]
