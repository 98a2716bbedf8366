"""Command-line flags generated from config dataclasses, so each knob is declared once.

A field becomes `--name-with-dashes`; its type and default come from the dataclass, its help and
choices from `field(metadata={"help": ..., "choices": ...})` (`knob`; `human_readable=True`: a count vLLM's flag
takes as 32k too, `human_int`), and a bool becomes `--x/--no-x`.
`generate`, `demo`, `serve` and `bench` all add `EngineConfig` this way (`generate`, `demo` and `serve` `LoadConfig`
too), `train-tiny` its `TrainConfig` and the soak test its `SoakConfig`;
`config_kwargs` reads the fields back from the parsed arguments, and `as_flags` writes values as arguments (a
benchmark's server). `FlagParser` is the parser class of every loopserve command: vLLM's command-line rules.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import sys
import types
import typing
from fractions import Fraction
from pathlib import Path
from typing import Any


def knob(default: Any, help: str, **meta: Any) -> Any:
    """A config dataclass field with its command-line help (and choices): `add_config_args` makes the flags from
    these. `none_is_default=True`: None is taken for the default (`none_to_defaults`), as vLLM's engine arguments of
    that name take None for "the default"."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})


def none_to_defaults(config: Any) -> None:
    """The fields of dataclass `config` declared `none_is_default` (`knob`) that hold None, set to their default."""
    for f in dataclasses.fields(config):
        if f.metadata.get("none_is_default") and getattr(config, f.name) is None:
            setattr(config, f.name, f.default)


@functools.cache
def _hints(cls: Any) -> dict[str, Any]:
    """A config dataclass's field annotations as types (the modules write them as strings), read once per class."""
    return typing.get_type_hints(cls)


# the suffixes of `human_int`: k, m, g, t powers of 1000, K, M, G, T powers of 1024
_UNITS = {u: 1000 ** (i + 1) for i, u in enumerate("kmgt")} | {u: 1024 ** (i + 1) for i, u in enumerate("KMGT")}


def human_int(text: str, also: str = "") -> int:
    """An argparse type for a count of tokens as vLLM's flags take it: an integer, or one with a suffix: k, m, g, t
    for thousands, millions, ... (a decimal fraction too: 1.5k is 1500) or K, M, G, T for powers of 1024 (32K is
    32768; whole numbers only). `also`: what else the flag takes, for its error (" or auto")."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text.strip())
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer (or with a suffix: 32k is 32000, 32K 32768){also}, "
                                             f"got {text!r}") from None
    number, unit = match.groups()
    if unit.isupper() and "." in number:
        raise argparse.ArgumentTypeError(f"{text!r}: a fraction only with k, m, g or t (powers of 1000), not {unit}")
    return int(Fraction(number) * _UNITS[unit])  # (exact: a float made 4.35k 4349)


def auto_or_int(auto: int, text: str) -> int:
    """An argparse type: `human_int`, or "auto" as `auto` (vLLM's `--max-model-len auto`)."""
    if text.strip().lower() == "auto":
        return auto
    return human_int(text, " or auto")


def check_bool_knobs(config: Any) -> None:
    """A ValueError naming the first bool field of dataclass `config` (`bool`, or `bool | None` left unset) that holds
    anything else: a flag's "false" string, or 0, would otherwise be read as a setting."""
    hints = _hints(config.__class__)
    for f in dataclasses.fields(config):
        kinds = typing.get_args(hints[f.name]) or (hints[f.name],)
        if bool not in kinds:
            continue
        v, optional = getattr(config, f.name), type(None) in kinds
        if not isinstance(v, bool) and not (optional and v is None):
            raise ValueError(f"{f.name}: must be true or false{' (or unset)' if optional else ''}, got {v!r}")


def _value_type(hint: Any) -> Any:
    """int, float, str or bool of an annotation like `int | None`; a dict's flag takes a JSON object (`json_object`),
    as vLLM's dict-valued flags do."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = args
    if typing.get_origin(hint) is dict:
        return json_object
    if hint not in (int, float, str, bool):
        raise TypeError(f"no command-line flag for a field of type {hint!r}")
    return hint


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object ('{"temperature": 0.5}')."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_config_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
                    skip: tuple[str, ...] = (), all_default: Any = dataclasses.MISSING,
                    default_note: str | None = None, choices: dict[str, tuple[Any, ...]] | None = None) -> None:
    """One flag per field of dataclass `cls` (except `skip`). `all_default` replaces every default
    (e.g. None: "the command decides"), described in the help by `default_note`; `choices` narrows a field's
    choices for this command (a subset of the field's own)."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = _value_type(hints[f.name])
        default = f.default if all_default is dataclasses.MISSING else all_default
        # "%(default)s": argparse fills it in, and ArgumentDefaultsHelpFormatter then adds no second one
        note = default_note if all_default is not dataclasses.MISSING else "default: %(default)s"
        text = f.metadata.get("help", "")
        if f.metadata.get("human_readable"):
            text += "; also as 32k (32000) or 32K (32768)"
        kw: dict[str, Any] = {"default": default}
        if "choices" in f.metadata:
            own = f.metadata["choices"]
            kw["choices"] = tuple((choices or {}).get(f.name, own))
            if isinstance(own, dict):  # choice -> what it does: the help describes this command's choices only
                text = "; ".join([text] * bool(text) + [f"{c}: {own[c]}" for c in kw["choices"]])
        kw["help"] = f"{text.replace('%', '%%')} ({note})".strip()
        flags = [flag_of(f.name), *f.metadata.get("short", ())]  # (vLLM's short forms: -tp)
        if kind is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
        elif "auto" in f.metadata:  # (a count that also takes "auto", as the value the field keeps for it)
            parser.add_argument(*flags, type=functools.partial(auto_or_int, f.metadata["auto"]), **kw)
        else:
            parser.add_argument(*flags, type=human_int if f.metadata.get("human_readable") else kind, **kw)


def flag_of(name: str) -> str:
    """The command-line flag of config field `name`."""
    return "--" + name.replace("_", "-")


_CLI_TERMS = {"None": "null", "True": "true", "False": "false"}


def cli_terms(text: str) -> str:
    """Python's None, True and False in `text` as a command line writes them: null, true, false; not inside quotes
    (a value as given: `--response-role True` got 'True'); an apostrophe inside a word ("a reply's") opens none."""
    return re.sub(r"(?<!\w)'[^']*'|(?<!\w)\"[^\"]*\"|\b(None|True|False)\b",
                  lambda m: _CLI_TERMS[m[1]] if m[1] else m[0], text)


def as_flag_error(message: str, parser: argparse.ArgumentParser) -> str:
    """A keyword's error ("max_num_seqs: must be ...", raised by a config or `LLM(...)`) as the command line that set it
    names it: the keyword as `parser`'s flag for it, values in the command line's words (`cli_terms`). Any other
    message (a positional's, or one already naming a flag) as it is."""
    name, sep, rest = message.partition(": ")
    flags = [s for s, a in parser._option_string_actions.items() if a.dest == name and s.startswith("--")]
    return flags[0] + sep + cli_terms(rest) if sep and flags else message


class FlagParser(argparse.ArgumentParser):
    """The parser of every loopserve command (a subcommand's parser is made of its parent's class), with the rules of
    vLLM's parser beside argparse's: no abbreviations (argparse took `--config` for `--config-format`, a flag it is a
    prefix of); a long flag may be spelled with underscores (`--max_model_len`); and where the command has a
    `--config` flag, `--config FILE` reads the flags of a YAML file (`flags_argv`), the command line's own winning."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]  # (typeshed's overloads; the call is the base class's)
            self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        args = self._dashed(list(sys.argv[1:] if args is None else args))
        path = self._config_file(args)
        if path is None:
            return super().parse_known_args(args, namespace)
        # the file's flags first, then the command line's over them: a flag it gives replaces the file's value; one
        # that adds up its values (--api-key, repeatable) starts again from its default, and one of a group that
        # excludes each other (--enable-log-requests, --disable-log-requests) sets the others back to theirs
        namespace, extras = super().parse_known_args(self._file_argv(path), namespace)
        cli = args[:args.index("--")] if "--" in args else args
        given = {a.dest for a in self._actions
                 if any(arg == o or arg.startswith(o + "=") for o in a.option_strings for arg in cli)}
        reset: list[argparse.Action] = [a for a in self._actions
                                        if isinstance(a, argparse._AppendAction) and a.dest in given]
        for group in self._mutually_exclusive_groups:
            if any(a.dest in given for a in group._group_actions):
                reset += [a for a in group._group_actions if a.dest not in given]
        for a in reset:
            setattr(namespace, a.dest, a.default)
        namespace, more = super().parse_known_args(args, namespace)
        return namespace, extras + more

    def _dashed(self, args: list[str]) -> list[str]:
        """`args` with each long flag that is one of this parser's when written with dashes so written (`--a_b=1`:
        `--a-b=1`); up to a `--`, after which everything is a value."""
        out = list(args)
        for i, arg in enumerate(out):
            if arg == "--":
                break
            name, eq, value = arg.partition("=")
            if arg.startswith("--") and "_" in name:
                dashed = "--" + name[2:].replace("_", "-")
                if dashed in self._option_string_actions:
                    out[i] = dashed + eq + value
        return out

    def _config_file(self, args: list[str]) -> str | None:
        """The FILE of `--config FILE` (or `--config=FILE`) in `args`, where this parser has that flag."""
        if CONFIG_FLAG not in self._option_string_actions:
            return None
        args = args[:args.index("--")] if "--" in args else args
        files = [args[i + 1] for i, a in enumerate(args[:-1]) if a == CONFIG_FLAG]
        files += [a.partition("=")[2] for a in args if a.startswith(CONFIG_FLAG + "=")]
        if len(files) > 1:
            self.error(f"{CONFIG_FLAG}: given {len(files)} times; give one file")
        return files[0] if files else None

    def _file_argv(self, path: str) -> list[str]:
        """The arguments a `--config` YAML file gives (`parser.error`, naming the file, for one that cannot be read
        or gives what is not a flag of this command)."""
        try:
            import yaml
        except ModuleNotFoundError:
            self.error(f"{CONFIG_FLAG}: reading a YAML file needs pyyaml, from the [serve] extra: pip install "
                       f"'loopserve[serve]'")
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            self.error(f"{CONFIG_FLAG} {path}: {getattr(e, 'strerror', None) or e}")
        try:
            values = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark is not None else ""
            self.error(f"{CONFIG_FLAG} {path}: not valid YAML: {getattr(e, 'problem', None) or e}{where}")
        if values is None:  # (an empty file, or one of comments only)
            return []
        if not isinstance(values, dict):
            self.error(f"{CONFIG_FLAG} {path}: expected a mapping of flag names to values (port: 8000), got a "
                       f"{type(values).__name__}")
        try:
            if any(str(k).replace("_", "-").lstrip("-") == CONFIG_FLAG[2:] for k in values):
                raise ValueError(f"{CONFIG_FLAG[2:]}: a config file cannot name another")
            return flags_argv(self, {str(k): v for k, v in values.items()})
        except ValueError as e:
            self.error(f"{CONFIG_FLAG} {path}: {e}")


CONFIG_FLAG = "--config"  # vLLM's: a YAML file of flags (`FlagParser`), where a command declares it


def flags_argv(parser: argparse.ArgumentParser, values: dict[str, Any]) -> list[str]:
    """The arguments that give `parser`'s flags `values` (a config file's mapping: {"max_model_len": 512,
    "api_key": [...]}): a key is a long flag's name without its dashes, with `_` or `-`; a switch takes true or
    false (as a switch of its own, `no_x: true` is `x: false`); a list flag or a repeatable one a list (or one
    value); a dict or a list for any other flag is its JSON; null leaves a flag unset. ValueError naming the first
    key that is not a flag or not a switch's value."""
    actions: dict[str, argparse.Action] = {}
    for a in parser._actions:  # (by dest, the first flag of it: a switch of vLLM's has its --no-x after its --x)
        if a.option_strings:
            actions.setdefault(a.dest, a)
    # and by each flag's own name: an alias (disable_uvicorn_access_log), a switch's --no- form (an engine switch's
    # `no_x: true` is `x: false`)
    negated: set[str] = set()
    for a in parser._actions:
        for opt in a.option_strings:
            name = opt.lstrip("-").replace("-", "_")
            if isinstance(a, argparse.BooleanOptionalAction) and opt.startswith("--no-"):
                negated.add(name)
            actions.setdefault(name, a)
    def switch(key: str, value: Any) -> bool:
        if value not in (True, False, "true", "false"):
            raise ValueError(f"{key}: expected true or false")
        return value in (True, "true")

    argv: list[str] = []
    for key, value in values.items():
        name = key.replace("-", "_")
        action = actions.get(name)
        if action is None:
            raise ValueError(f"{key}: not a `{parser.prog}` flag")
        if name in negated:
            value = not switch(key, value)
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreConstAction) and not isinstance(action, argparse._StoreTrueAction):
            # a switch of vLLM's: `x: true` is --x, `x: false` its --no-x (`vllm_neutral.add_neutral_args`)
            opposite = "--" + flag[5:] if flag.startswith("--no-") else "--no-" + flag[2:]
            argv.append(flag if switch(key, value) else opposite)
        elif isinstance(action, argparse._StoreTrueAction | argparse.BooleanOptionalAction):
            on = switch(key, value)
            if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x: false is said too
                argv.append(action.option_strings[0 if on else 1])
            elif on:
                argv.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for item in value if isinstance(value, list) else [value]:
                argv += [flag, str(item)]
        elif action.nargs == "+":  # several values after one flag: served_model_name: [a, b] (or one: a)
            items = value if isinstance(value, list) else [] if value is None else [value]
            argv += [flag, *map(str, items)] if items else []
        elif isinstance(value, list | dict):
            argv += [flag, json.dumps(value)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def as_flags(values: dict[str, Any]) -> list[str]:
    """The arguments that set config fields `values` (by name) on a command made by `add_config_args`: the
    inverse of `config_kwargs` (a bool as `--x` or `--no-x`; None is left out: the command's default)."""
    out: list[str] = []
    for name, v in values.items():
        if isinstance(v, bool):
            out.append(flag_of(name) if v else "--no-" + flag_of(name)[2:])
        elif v is not None:
            out += [flag_of(name), str(v)]
    return out


def config_kwargs(args: argparse.Namespace, cls: type, drop_none: bool = False) -> dict[str, Any]:
    """The fields of `cls` found in `args` (without those left at None when `drop_none`)."""
    out = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return {k: v for k, v in out.items() if v is not None} if drop_none else out
