"""Run a test module's function in a subprocess that sees 8 CPU devices (the parent process has one)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def xla_flags(devices: int) -> str:
    """XLA_FLAGS of a test subprocess with `devices` CPU devices: with this leg's codegen flags
    (DFLASH_TEST_XLA_FLAGS, tests/conftest.py)."""
    return f"--xla_force_host_platform_device_count={devices} {os.environ.get('DFLASH_TEST_XLA_FLAGS', '')}".strip()


def run_8_devices(call: str, module: str) -> dict:
    """Run `<module>.<call>` (its "{out}" a JSON file it writes its findings to, "{tmp}" a scratch
    directory) in a subprocess with 8 CPU devices -> the findings."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "findings.json"
        folder = next((ROOT / "tests").rglob(f"{module}.py")).parent  # the module's package folder
        env = {**os.environ, "XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu",
               "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(folder)])}
        code = ("import jax; jax.config.update('jax_default_matmul_precision', 'highest'); "
                f"import {module} as t; t.{call.format(out=repr(str(out)), tmp=repr(tmp))}")
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        return json.loads(out.read_text())
