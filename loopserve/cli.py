"""Command line: `loopserve generate | demo | make-tiny | serve | bench | train-tiny | eval`.

Each subcommand registers itself from the module that owns it (`register(subparsers)`): the runtime's
(`generate` and `demo`, here; `serve`) and the lab's (`make-tiny`, `bench`, `train-tiny`, `eval`, from
`loopserve_lab`, in the same wheel, imported only when the parser is built). This file also owns what the
commands share: the engine, load, chat and exit-rule flags (`add_engine_args`, `add_chat_args`, `add_exit_args`,
`EXIT_FLAGS`), `CommandError`, and the extras check (a command that needs an optional extra which is not
installed exits 2 naming the extra).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from loopserve.config_args import FlagParser, add_config_args, as_flag_error, config_kwargs, flag_of
from loopserve.engine.config import SCHEDULERS, EngineConfig
from loopserve.exits import DEFAULT_POLICIES, DEFAULT_THRESHOLDS
from loopserve.load_config import LoadConfig
from loopserve.sampling_params import EXIT_FIELDS

# Modules that add subcommands (the runtime's, then the lab's); a missing one is skipped.
_COMMAND_MODULES = ["loopserve.cli", "loopserve.serve.cli", "loopserve_lab.tiny", "loopserve_lab.bench.cli",
                    "loopserve_lab.train.cli"]
# The extra a command's own third-party modules come with, when more than one extra provides a module.
_COMMAND_EXTRA = {"serve": "serve", "bench": "bench", "train-tiny": "train", "eval": "train"}
BARS = " ▁▂▃▄▅▆▇█"
# The help of every command's flags shows their defaults (as `loopserve serve --help` does).
HELP_FORMAT = argparse.ArgumentDefaultsHelpFormatter


class CommandError(SystemExit):
    """A command's refusal of its arguments or inputs: `main` prints one `error: <message>` line and the process
    exits with status 2, as for argparse's own errors (`str(e)` is the message)."""

    def __init__(self, message: str, *, as_flag: bool = True) -> None:
        super().__init__(2)
        self.message = message
        # whether `main` names a keyword's error ("model: ...") by the command's flag for it (`as_flag_error`): not
        # where the user gave that value as a positional argument, and typed no such flag
        self.as_flag = as_flag

    def __str__(self) -> str:
        return self.message


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum`."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {number}")
        return number
    return parse


positive_int = int_at_least(1)  # counts of requests, windows, threads


def output_folder(value: str) -> Path:
    """An argparse type for a folder a command writes into (made when it writes): refused when the flags are read,
    not after the run, if a file stands where it or one of its parents would be."""
    path = Path(value)
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                where = "" if part == path else f": {part} is a file, not a folder"
                raise argparse.ArgumentTypeError(f"{value}{where or ' exists and is not a folder'}")
            break
    return path


def output_file(value: str) -> Path:
    """An argparse type for a file a command writes: refused when the flags are read if it is a folder, or if a
    file stands where one of its folders would be."""
    path = Path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{value}: is a folder; name a file")
    output_folder(str(path.parent))
    return path


def add_engine_args(p: argparse.ArgumentParser, schedulers: tuple[str, ...] = SCHEDULERS) -> None:
    """Model flags, and every `EngineConfig` knob (generated), shared by generate, demo and serve (`schedulers`: the
    ones the command runs)."""
    p.add_argument("--model", default=None, help="HF folder or hub id (unset: the embedded model)")
    add_config_args(p.add_argument_group("model (LLM's keywords of the same names)"), LoadConfig)
    add_config_args(p.add_argument_group("engine"), EngineConfig, choices={"scheduler": schedulers})


def engine_kwargs(args: argparse.Namespace) -> dict:
    return config_kwargs(args, EngineConfig)


def load_kwargs(args: argparse.Namespace) -> dict:
    return config_kwargs(args, LoadConfig)


def add_chat_args(p: argparse.ArgumentParser) -> None:
    """The model's chat template and sampling defaults, overridable (generate, demo, serve; vLLM's flags)."""
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template used instead of the model's: a file, or the template text")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults: 'auto' reads the model's generation_config.json, 'vllm' ignores its "
                        "sampling values (its eos ids still end requests), or a folder holding one (explicit "
                        "sampling flags and request fields win)")


# What `generate` samples with when neither a flag nor the model's generation_config.json says otherwise.
GENERATE_DEFAULTS = {"max_tokens": 64, "temperature": 0.8, "top_p": 1.0, "top_k": -1}
_SAMPLING_HELP = {"max_tokens": "tokens to generate per prompt", "temperature": "sampling temperature (0: greedy)",
                  "top_p": "nucleus sampling: the smallest set of tokens holding this much probability",
                  "top_k": "sample among the k likeliest tokens (-1: all)"}


# The looped-model fields of SamplingParams as flags (generate, demo; serve's request defaults): (type, help); each
# is unset by default.
EXIT_FLAGS: dict[str, tuple[type, str]] = {  # (keyed by EXIT_FIELDS, each once)
    "exit_threshold": (float, "the exit policy's threshold (unset: the gate's is the checkpoint's early_exit_threshold"
                              + "".join(f", {k}'s {v:g}" for k, v in DEFAULT_THRESHOLDS.items()) + ")"),
    "exit_policy": (str, "exit policy (unset: the model's: gate with a learned exit gate, else latent_diff)"),
    "min_loops": (int, "no exit before this many loops (unset: 1)"),
    "max_loops": (int, "always exit at this many loops (unset: the model's r_max)"),
}


def add_exit_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The exit-rule flags (`EXIT_FLAGS`: request defaults for `serve`, the requests' own for `generate` / `demo`)."""
    for name, (kind, text) in EXIT_FLAGS.items():
        choices = DEFAULT_POLICIES if name == "exit_policy" else None
        p.add_argument(flag_of(name), type=kind, default=None, help=text, choices=choices)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    for name, value in GENERATE_DEFAULTS.items():
        p.add_argument(flag_of(name), type=type(value), default=None,
                       help=f"{_SAMPLING_HELP[name]} (unset: the model's generation config, else {value})")
    p.add_argument("--chat", action="store_true", help="each prompt is a user message, rendered by the chat template")
    add_exit_args(p)
    p.add_argument("--ignore-eos", action="store_true",
                   help="go on past end-of-sequence tokens, to --max-tokens (or the context)")


def depth_histogram(depths: list[int]) -> str:
    """One line per depth of the decode tokens' exit depths: `d=2  ▇▇▇▇▇▇      31 (44%)` (an output's first token
    is its prompt's, which runs every loop: callers leave it out, as the server's stats and metrics do)."""
    if not depths:
        return "(no decode tokens)"
    counts = Counter(depths)
    top = max(counts.values())
    lines = []
    for d in range(1, max(counts) + 1):
        c = counts.get(d, 0)
        width = round(24 * c / top)
        lines.append(f"  d={d:<3d}{'█' * width:<24s} {c:5d} ({100 * c / len(depths):.0f}%)")
    mean = sum(depths) / len(depths)
    return "\n".join([f"exit depth: mean {mean:.2f} over {len(depths)} decode tokens", *lines])


def cmd_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from loopserve import LLM, SamplingParams

    prompts = list(args.prompts)
    if args.prompts_file:
        try:
            text = Path(args.prompts_file).read_text()
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise CommandError(f"--prompts-file: {args.prompts_file}: {why}") from None
        prompts += [ln.rstrip("\n") for ln in text.splitlines() if ln.strip()]
    if not prompts:
        raise CommandError(f"--prompts-file: {args.prompts_file}: no prompts in it (one a line)" if args.prompts_file
                           else "give prompts as arguments or with --prompts-file")
    try:
        llm = LLM(args.model, chat_template=args.chat_template, generation_config=args.generation_config,
                  **load_kwargs(args), **engine_kwargs(args))
        given = {k: getattr(args, k) for k in GENERATE_DEFAULTS if getattr(args, k) is not None}
        params = SamplingParams(**{**GENERATE_DEFAULTS, **llm.generation_defaults, **given},
                                **{k: getattr(args, k) for k in EXIT_FIELDS}, ignore_eos=args.ignore_eos,
                                seed=args.seed)
        if args.chat or args.chat_template is not None:
            prompts = [llm._chat_prompt([{"role": "user", "content": p}]) for p in prompts]
    except ValueError as e:
        raise CommandError(str(e)) from None
    try:  # (a request the engine can never run, say past its KV pool, is refused before it starts)
        if args.scheduler == "reference" or len(prompts) > 1:
            outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
        else:
            seq = llm._make_sequence(prompts[0], params)
    except ValueError as e:
        raise CommandError(str(e)) from None
    if args.scheduler == "reference" or len(prompts) > 1:
        all_depths = []
        for o in outs:
            c = o.outputs[0]
            decoded = c.exit_depths[1:]  # (the first token is the prompt's, at full depth)
            all_depths += decoded
            mean = f"{sum(decoded) / len(decoded):.2f}" if decoded else "-"
            print(f"\n>>> {o.prompt}\n{c.text}\n[{c.finish_reason}, {len(c.token_ids)} tokens, "
                  f"mean decode depth {mean}]")
        print("\n" + depth_histogram(all_depths))
        return 0
    # one prompt: stream text as tokens arrive, with each token's depth as a shade underneath
    engine = llm.engine
    assert engine is not None
    engine.add_sequence(seq)
    print(seq.prompt or "", end="", flush=True)
    shown = 0
    while engine.has_unfinished_requests():
        engine.step()
        if len(seq.text) > shown:
            print(seq.text[shown:], end="", flush=True)
            shown = len(seq.text)
    shade = "".join(BARS[min(d, len(BARS) - 1)] for d in seq.exit_depths)
    tqdm.write(f"\n\n[{seq.finish_reason}] per-token depth: {shade}\n" + depth_histogram(seq.exit_depths[1:]))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    args.prompts = args.prompts or ["ROMEO:\nBut soft, what light"]
    return cmd_generate(args)


def register(sub: argparse._SubParsersAction) -> None:
    for name, fn, help_ in (("generate", cmd_generate, "generate text with exit depths (one prompt is streamed)"),
                            ("demo", cmd_demo, "generate from the embedded default model")):
        p = sub.add_parser(name, help=help_, formatter_class=HELP_FORMAT)
        p.add_argument("prompts", nargs="*")
        p.add_argument("--prompts-file", default=None,
                       help="a file of prompts, one per line (after those given as arguments)")
        add_engine_args(p)
        add_chat_args(p)
        add_sampling_args(p)
        p.set_defaults(func=fn)


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="loopserve", description=__doc__.splitlines()[0])
    from loopserve import __version__

    parser.add_argument("--version", action="version", version=f"loopserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        module.register(sub)
    _name_own_parsers(parser)
    return parser


def _name_own_parsers(parser: argparse.ArgumentParser) -> None:
    """Each subcommand's parser the default `_parser` of what it parses (the deepest wins), so that `main` reports an
    unknown flag with that command's usage: argparse's own error for one comes from the top parser's."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for p in action.choices.values():
                p.set_defaults(_parser=p)
                _name_own_parsers(p)


def extras_providing(module: str) -> list[str]:
    """The optional extras (pyproject.toml, read back from the installed metadata) that install `module`."""
    try:
        requirements = importlib.metadata.requires("loopserve") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    wanted = module.split(".")[0].lower().replace("-", "_")
    extras = []
    for req in requirements:
        m = re.match(r"([A-Za-z0-9_.-]+).*;.*extra\s*==\s*['\"]([^'\"]+)['\"]", req)
        if m and m[1].lower().replace("-", "_") == wanted and m[2] != "dev" and m[2] not in extras:
            extras.append(m[2])
    return extras


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    command_parser = vars(args).pop("_parser", parser)  # (not a setting: benches write their args out)
    if unknown:
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # (Ctrl-C: what was written stays; no traceback for the user's own stop)
        print(f"\nloopserve {args.command}: interrupted", file=sys.stderr)
        return 130
    except CommandError as e:
        if e.as_flag:
            e.message = as_flag_error(e.message, command_parser)
        print(f"error: {e}", file=sys.stderr)
        raise  # (exit status 2; a caller that catches SystemExit reads the message from it)
    except ModuleNotFoundError as e:
        extras = extras_providing(e.name or "")
        if not extras:
            raise
        own = _COMMAND_EXTRA.get(args.command)
        extra = own if own in extras else extras[0]
        package = (e.name or "").split(".")[0]  # (the module's package: "fastapi", not "fastapi.responses")
        print(f"error: `loopserve {args.command}` needs {package}, from the [{extra}] extra: "
              f"pip install 'loopserve[{extra}]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # `python -m loopserve.cli` runs this file as `__main__`, a second copy of the module: the commands (and the
    # `CommandError` they raise) come from `loopserve.cli`, so its `main` is the one that must catch them.
    from loopserve.cli import main as _main

    sys.exit(_main())
