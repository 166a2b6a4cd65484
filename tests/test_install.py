"""The package installs into a fresh virtualenv, offline, and works from another directory: its
dependencies are declared, only `dflash_jax` is installed (no top-level `infer` or `train`), and the
console scripts exist and run."""
import importlib.util
import json
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# training runs from a checkout: python -m train.train
SCRIPTS = ("dflash-generate", "dflash-benchmark", "dflash-convert")
PROBE = textwrap.dedent("""
    import importlib.metadata as md, importlib.util, json
    import dflash_jax
    print(json.dumps({
        "file": dflash_jax.__file__,
        "top_level": {name: importlib.util.find_spec(name) is not None for name in ("infer", "train")},
        "requires": md.requires("dflash-jax"),
        "has_load_target": callable(dflash_jax.load_target),
    }))
""")


def normalized(requirement: str) -> tuple[str, str]:
    """(name, specifiers) of a requirement line, in one canonical spelling."""
    from packaging.requirements import Requirement

    parsed = Requirement(requirement)
    return parsed.name.lower().replace("_", "-"), str(parsed.specifier)


def run(*cmd, cwd, timeout=180):
    return subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv, elsewhere): a venv that sees this environment's packages through a .pth line (so no
    index is needed) with the project installed into it by pip from a copy of the sources."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed here, so the project cannot be built offline")
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, src / name)
    for name in ("dflash_jax", "infer", "train"):  # infer/ and train/ present, yet must not be installed
        shutil.copytree(REPO_ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    venv = root / "venv"
    made = run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=root)
    if made.returncode != 0:
        pytest.skip(f"cannot create a virtualenv here: {made.stderr.strip()[-300:]}")
    python = venv / "bin" / "python"
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=root)
    Path(purelib.stdout.strip(), "_parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = run(python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation",
              "--ignore-installed", "--no-cache-dir", "-q", src, cwd=root, timeout=300)
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-2000:]
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    return venv, elsewhere


def test_imports_from_another_directory_with_declared_dependencies(installed):
    venv, elsewhere = installed
    out = run(venv / "bin" / "python", "-c", PROBE, cwd=elsewhere)
    assert out.returncode == 0, out.stderr[-3000:]
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(probe["file"]).is_relative_to(venv), probe["file"]
    assert probe["top_level"] == {"infer": False, "train": False}
    assert probe["has_load_target"]
    requires = probe["requires"]
    runtime = {normalized(r) for r in requires if "extra ==" not in r}
    listed = {normalized(line) for line in (REPO_ROOT / "requirements.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    assert runtime == listed
    for extra, package in (("test", "torch==2.13.0"), ("train", "pyyaml"), ("plot", "matplotlib")):
        assert any(r.startswith(package) and f'extra == "{extra}"' in r for r in requires), (extra, requires)


def test_console_scripts_run(installed):
    venv, elsewhere = installed
    for script in SCRIPTS:
        assert (venv / "bin" / script).is_file(), script
    out = run(venv / "bin" / "dflash-convert", "--help", cwd=elsewhere)
    assert out.returncode == 0 and "usage: dflash-convert" in out.stdout and "to-hf" in out.stdout, out.stderr
    out = run(venv / "bin" / "dflash-generate", "--help", cwd=elsewhere)
    assert out.returncode == 0 and "usage: dflash-generate" in out.stdout, out.stderr
    out = run(venv / "bin" / "dflash-generate", "--prompt", "hi", "--drafter", elsewhere / "missing", cwd=elsewhere)
    assert out.returncode == 2 and out.stderr.strip() == f"error: drafter path does not exist: {elsewhere / 'missing'}"
