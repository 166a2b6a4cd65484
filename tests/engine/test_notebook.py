"""examples/quickstart.ipynb runs top to bottom in a fresh kernel without a cell error.

The kernel is this test's own Python (a kernelspec written into a temporary directory names
sys.executable), so it imports the same dflash_jax and packages, never some other interpreter's.
The notebook runs on a copy, from examples/, so the stored outputs are left as they are.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (requirements-test.txt)")
nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (requirements-test.txt)")
pytest.importorskip("ipykernel", reason="ipykernel is not installed (requirements-test.txt)")

from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402  (comes with nbclient)
from jupyter_client.manager import KernelManager  # noqa: E402
from nbclient.exceptions import CellExecutionError  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "quickstart.ipynb"
KERNEL_NAME = "dflash-test-python"
CELL_TIMEOUT_S = 600


def _kernel_manager(spec_root: Path) -> KernelManager:
    """A kernel manager for a kernelspec, in spec_root only, that runs sys.executable."""
    from ipykernel.kernelspec import install

    install(kernel_name=KERNEL_NAME, prefix=str(spec_root))  # argv: sys.executable -m ipykernel_launcher
    kernels = spec_root / "share" / "jupyter" / "kernels"
    ksm = KernelSpecManager(kernel_dirs=[str(kernels)], ensure_native_kernel=False)
    spec = ksm.get_kernel_spec(KERNEL_NAME)
    assert spec.argv[0] == sys.executable, spec.argv
    return KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=ksm)


# newer-jax leg only (`one_leg`): both legs check the calls it makes, on the same target and drafter loaded
# by name (test_shipped_drafter.py, test_runtime_without_torch.py), greedy and sampled (test_generate.py,
# test_sampling.py)
@pytest.mark.one_leg
def test_quickstart_notebook_runs(tmp_path):
    assert NOTEBOOK.is_file(), f"{NOTEBOOK} is missing"
    copy = tmp_path / NOTEBOOK.name
    shutil.copyfile(NOTEBOOK, copy)
    nb = nbformat.read(copy, as_version=4)
    client = nbclient.NotebookClient(
        nb, km=_kernel_manager(tmp_path / "kernelspec"), timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},  # run from examples/, as a user would
        allow_errors=False)
    try:
        client.execute()
    except CellExecutionError as e:
        code = [c for c in nb.cells if c.cell_type == "code"]
        failed = next((i for i, c in enumerate(code)
                       if any(o.get("output_type") == "error" for o in c.get("outputs", []))), None)
        where = (f"code cell {failed + 1} of {len(code)}:\n{code[failed].source}" if failed is not None
                 else "a cell")
        pytest.fail(f"{NOTEBOOK.name}: {where}\n\nfailed with:\n{e}", pytrace=False)
    finally:
        nbformat.write(nb, copy)  # the executed copy, outputs included, for a look after a failure
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("execution_count") for c in code), "not every code cell ran"
    text = "".join(o.get("text", "") for c in code for o in c.get("outputs", []))
    assert "identical text: True" in text, text
    assert any("image/png" in o.get("data", {}) for c in code for o in c.get("outputs", [])), \
        "the acceptance-length plot was not shown inline"
