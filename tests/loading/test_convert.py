"""Conversion CLI: official HF drafter -> Orbax -> official HF, bit-exact."""
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")

from dflash_jax.convert import main  # noqa: E402
from dflash_jax.formats.safetensors_io import SafetensorsFile  # noqa: E402
from support.dflash_torch_reference import drafter_hf_config, write_official_checkpoint  # noqa: E402


def test_round_trip_through_orbax(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_official_checkpoint(src, drafter_hf_config(layers=2))
    assert main(["to-orbax", str(src), str(tmp_path / "orbax")]) == 0
    assert main(["to-hf", str(tmp_path / "orbax"), str(tmp_path / "back")]) == 0
    a, b = SafetensorsFile(src / "model.safetensors"), SafetensorsFile(tmp_path / "back" / "model.safetensors")
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def test_errors_and_help(tmp_path, capsys):
    assert main(["to-orbax", str(tmp_path / "missing"), str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    out = subprocess.run([sys.executable, "-m", "dflash_jax.convert", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "to-orbax" in out.stdout
