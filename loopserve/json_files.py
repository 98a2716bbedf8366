"""Reading a checkpoint's small JSON files (config, generation config, tokenizer config): an object, or a
ValueError naming the file; and that ValueError for any checkpoint file that cannot be read (`unreadable`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The first bytes of a git-lfs pointer: a clone made without git-lfs (or before `git lfs pull`) holds these small text
# files in place of its large ones (weights, tokenizer.json), which then fail to parse with no word of why
_LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def unreadable(path: Path, why: str) -> ValueError:
    """The ValueError for a checkpoint file that cannot be read: `{path}: {why}`, or, where the file is a git-lfs
    pointer, one saying so and how to fetch the file."""
    try:
        with path.open("rb") as f:
            pointer = f.read(len(_LFS_POINTER)) == _LFS_POINTER
    except OSError:
        pointer = False
    if pointer:
        return ValueError(f"{path}: a git-lfs pointer, not the file itself: fetch it (git lfs pull in the clone, or "
                          f"hf download)")
    return ValueError(f"{path}: {why}")


def read_text(path: Path) -> str:
    """The UTF-8 text `path` holds (a ValueError naming the file if it is not UTF-8: a chat template saved in another
    encoding, a binary file)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise unreadable(path, f"not UTF-8 text ({e})") from None


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object `path` holds (ValueError naming the file if it is not valid JSON or not an object)."""
    try:
        raw = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise unreadable(path, f"not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw
