"""Packaging (issue 14.4 and 14.6): the wheel builds, installs into a fresh venv that cannot see the
repository, and `loopserve demo` runs from it; `import loopserve` pulls neither the lab nor any
optional extra; a command whose extra is missing names it.

The fresh venv gets no network: the wheel goes in with `--no-deps`, and torch and the other
requirements come from this venv's site-packages, listed as a plain path in a `.pth` file. A plain
path's own `.pth` files are not processed, so the editable install of loopserve stays invisible;
the test checks that `loopserve` and `loopserve_lab` are imported from the fresh venv.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Third-party modules that only the optional extras install, and the lab: `import loopserve` loads none.
NOT_AT_IMPORT = ("matplotlib", "fastapi", "starlette", "uvicorn", "prometheus_client", "huggingface_hub",
                 "httpx", "llguidance", "ray", "loopserve_lab")
RUNTIME_REQUIREMENTS = {"torch", "safetensors", "tokenizers", "jinja2", "numpy", "numba", "tqdm"}

# Run by the fresh venv's python: where loopserve came from, what importing it loaded, what it requires.
PROBE = """
import importlib.metadata, json, re, sys
import loopserve
from loopserve import LLM, SamplingParams
loaded = sorted({name.split(".")[0] for name in sys.modules} & set(json.loads(sys.argv[1])))
import loopserve_lab
requires = importlib.metadata.requires("loopserve") or []
core = sorted(re.match(r"[A-Za-z0-9_.-]+", r)[0].lower() for r in requires if "extra ==" not in r)
print(json.dumps({"loopserve": loopserve.__file__, "loopserve_lab": loopserve_lab.__file__, "loaded": loaded,
                  "core": core}))
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _build_wheel(tmp: Path) -> Path:
    """`python -m build --wheel --no-isolation` (the dev extra's `build`; else `pip wheel`) on a copy of
    the sources, so that the build leaves nothing in the repository."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for package in ("loopserve", "loopserve_lab"):
        shutil.copytree(REPO / package, src / package, ignore=ignore)
    out = tmp / "dist"
    if importlib.util.find_spec("build") is not None:
        cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(src)]
    else:
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)]
    r = subprocess.run(cmd, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (wheel,) = out.glob("loopserve-*.whl")
    return wheel


def test_wheel_installs_into_a_fresh_venv_and_demo_runs(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert "loopserve/assets/ouro-shakespeare/model.safetensors" in names  # the embedded model ships
    assert "loopserve_lab/tiny.py" in names and "loopserve_lab/hf_code/configuration_ouro.py" in names
    assert not [n for n in names if n.startswith(("tests/", "docs/", "scripts/"))]

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    purelib = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    (purelib / "repo_venv_site_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "--disable-pip-version-check",
                        "install", "--no-deps", "--no-index", str(wheel)],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    r = subprocess.run([str(py), "-c", PROBE, json.dumps(NOT_AT_IMPORT)], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    probe = json.loads(r.stdout.strip().splitlines()[-1])
    for package in ("loopserve", "loopserve_lab"):  # from the wheel, not the repository
        assert Path(probe[package]).is_relative_to(purelib), probe
    assert probe["loaded"] == [], probe
    assert set(probe["core"]) == RUNTIME_REQUIREMENTS, probe

    r = subprocess.run([str(venv / "bin" / "loopserve"), "demo", "--max-tokens", "12", "--temperature", "0"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ROMEO:" in r.stdout and "exit depth: mean" in r.stdout, r.stdout


def test_import_loads_no_extra_and_not_the_lab():
    """Nor torch's Dynamo or sympy, for the library, a command's flags (every command's parser is built) or a model's
    loading: importing Dynamo took 1.6 s of each process's start (a CLI error took 7 s in all) and as much again when a
    model was built, and only `bench compile` runs it; sympy (which Module.to_empty imported) 0.6 s."""
    code = ("import json, sys; import loopserve; from loopserve import LLM, LLMEngine, EngineConfig, SamplingParams; "
            f"loaded = sorted({{m.split('.')[0] for m in sys.modules}} & set({list(NOT_AT_IMPORT)!r})); "
            "from loopserve.cli import build_parser; build_parser(); "
            "from loopserve.models.loader import embedded_model_path, load_model; "
            "load_model(embedded_model_path(), 'float32', 'cpu'); "
            "print(json.dumps([loaded, [m for m in ('torch._dynamo', 'sympy') if m in sys.modules]]))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout) == [[], []]


@pytest.mark.parametrize(("argv", "blocked", "extra"), [
    (["serve"], "fastapi", "serve"),
    (["serve", "--config", "c.yaml"], "yaml", "serve"),  # (read while the flags are)
    (["bench", "step-latency", "--from-json", "x.json"], "matplotlib", "bench"),
    # (before the evaluation or the runs, which write their JSON: a missing extra was said only after minutes of them)
    (["eval", "ppl", "--windows", "1", "--out-json", "out/res.json"], "matplotlib", "train"),
    (["bench", "peer", "--out", "out"], "matplotlib", "bench"),
])
def test_a_command_without_its_extra_names_it(tmp_path, argv, blocked, extra):
    code = (f"import sys; sys.modules[{blocked!r}] = None; from loopserve.cli import main; "
            f"sys.exit(main({argv!r}))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"[{extra}] extra" in r.stderr and f"pip install 'loopserve[{extra}]'" in r.stderr, r.stderr
    needed = re.search(r"needs (\S+), from", r.stderr)
    assert needed and "." not in needed[1], r.stderr  # (a package, not the submodule imported: fastapi.responses)
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()  # nothing ran


def test_a_hub_id_without_the_hub_extra_names_it(monkeypatch, tmp_path):
    from loopserve.models.loader import resolve_model_path

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"'nobody/nothing'.*\[hub\] extra"):
        resolve_model_path("nobody/nothing")
