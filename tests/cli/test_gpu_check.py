"""`infer/gpu_check.sh`, the prepared GPU checks, cannot run here; what can go stale is checked: its
commands (printed by GPU_CHECK_DRY=1, for the GPU and for the CPU smoke run) name modules that
exist, test files that exist, and arguments each module's parser accepts."""
from __future__ import annotations

import argparse
import importlib
import os
import shlex
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "infer" / "gpu_check.sh"


class Parsed(Exception):
    """Raised in place of running a command once its arguments parsed."""


def commands(smoke: bool, tmp_path) -> list[list[str]]:
    env = {**os.environ, "GPU_CHECK_DRY": "1", "GPU_CHECK_SMOKE": "1" if smoke else "0", "OUT": str(tmp_path),
           "PYTHON": "python3"}  # the script's default interpreter, whatever the caller's PYTHON says
    out = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, check=True).stdout
    return [shlex.split(line) for line in out.splitlines() if line.strip()]


@pytest.mark.parametrize("smoke", [False, True], ids=["gpu", "cpu-smoke"])
def test_every_command_names_what_exists_and_parses(smoke, tmp_path, monkeypatch):
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)  # exits 2 on an argument the parser does not take
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    checked = []
    for argv in commands(smoke, tmp_path):
        while argv[0] == "env" or "=" in argv[0]:
            argv = argv[1:]
        assert argv[0] == "python3", argv
        if argv[1] == "-c":
            continue
        assert argv[1] == "-m", argv
        module, args = argv[2], argv[3:]
        if module == "pytest":
            files = [a for a in args if a.endswith(".py")]
            assert files and all((REPO_ROOT / f).is_file() for f in files), args
        else:
            with pytest.raises(Parsed):
                importlib.import_module(module).main(args)
        checked.append(module)
    assert checked == ["pytest", "infer.benchmark_attention", "infer.profile_cycle", "infer.profile_cycle",
                       "infer.benchmark", "infer.profile_cycle", "infer.profile_cycle", "train.benchmark",
                       "infer.profile_cycle", "infer.benchmark"]
