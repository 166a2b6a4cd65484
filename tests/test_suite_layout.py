"""The test suite's own layout: test modules sit in folders named after the packages they check
(tests/models/ for dflash_jax/models/, tests/train/ for train/, ...; checks of the project as a whole at
the top), their names unique over the folders (pytest imports each by its name), shared helpers live
in the `support` package, and no test module imports another (a test module's names are its own; a
helper two modules need moves to support/).
Imports are read with `ast`, so a function-local import counts as much as a top-level one. And the
guard that fails a skipped `one_leg` check on the leg that runs those checks (tests/conftest.py)."""
import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
HELPERS = ("support",)  # folders of tests/ that hold no test modules

# Imports of a test module inside files another change owns, to be moved to `support` there; an
# entry that no longer occurs fails, so the list only shrinks.
PENDING: set[tuple[str, str]] = set()  # (importer, imported) pairs allowed while they move


def imported_modules(path: Path) -> set[str]:
    """The top-level names of every module `path` imports (relative imports excluded)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p.relative_to(TESTS).parts[0] not in HELPERS)


def test_modules_are_tests_conftest_or_support():
    """Every Python file of tests/ outside support/ is a test module or the top conftest.py."""
    stray = sorted(str(p.relative_to(TESTS)) for p in _test_files()
                   if not p.name.startswith("test_") and p != TESTS / "conftest.py")
    assert stray == [], f"helper modules belong in tests/support/: {stray}"


def test_folders_mirror_the_packages_and_names_are_unique():
    """Each folder of tests/ (but support/) is named after the package it checks: a package of
    dflash_jax, or the `train` entry points; no two test modules share a name."""
    packages = {p.parent.name for p in (ROOT / "dflash_jax").glob("*/__init__.py")} | {"train"}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name not in HELPERS and p.name != "__pycache__"}
    assert folders and folders <= packages, f"test folders named after no package: {sorted(folders - packages)}"
    names = [p.stem for p in _test_files() if p.name.startswith("test_")]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})


def test_no_test_module_imports_another():
    test_modules = {p.stem for p in _test_files() if p.name.startswith("test_")}
    found = set()
    for path in [*_test_files(), *sorted((TESTS / "support").glob("*.py"))]:
        for name in imported_modules(path) & test_modules:
            found.add((path.stem, name))
    assert found - PENDING == set(), "import these from tests/support/ instead: " + ", ".join(
        f"{importer} imports {imported}" for importer, imported in sorted(found - PENDING))
    assert PENDING - found == set(), f"no longer imported, drop from PENDING: {sorted(PENDING - found)}"


def test_the_check_reads_function_local_imports(tmp_path):
    path = tmp_path / "test_example.py"
    path.write_text("import os\n\ndef test_x():\n    from test_other import helper\n    import support.hlo\n")
    assert imported_modules(path) == {"os", "test_other", "support"}


def test_a_skipped_one_leg_check_fails_on_the_leg_that_runs_it(tmp_path):
    """`make test` runs `one_leg` checks on its newer-jax leg only (DFLASH_TEST_LEG=newer-jax): there,
    tests/conftest.py fails such a check that skips, and a module holding one that is skipped whole;
    elsewhere they skip as any test does."""
    import os
    import subprocess
    import sys

    (tmp_path / "test_skips_inside.py").write_text(
        "import pytest\n\n@pytest.mark.one_leg\ndef test_skips():\n    pytest.skip('no torch')\n\n"
        "@pytest.mark.one_leg\ndef test_runs():\n    pass\n\ndef test_unmarked_skips():\n    pytest.skip('fine')\n")
    (tmp_path / "test_skipped_whole.py").write_text(
        "import pytest\n\npytest.importorskip('no_such_module_here')\n\n"
        "@pytest.mark.one_leg\ndef test_x():\n    pass\n")

    def outcomes(leg: str) -> str:
        env = {**os.environ, "DFLASH_TEST_LEG": leg, "DFLASH_TEST_COMPILATION_CACHE": "0",
               "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
        env.pop("PYTEST_XDIST_WORKER", None)
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "conftest", "-p", "no:cacheprovider",
                               "-W", "ignore::pytest.PytestUnknownMarkWarning", "--continue-on-collection-errors",
                               str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        return proc.stdout

    newer = outcomes("newer-jax")
    assert "FAILED test_skips_inside.py::test_skips" in newer and "PASSED test_skips_inside.py::test_runs" in newer
    assert "SKIPPED" in newer and "ERROR test_skipped_whole.py" in newer, newer
    assert "1 failed, 1 passed, 1 skipped, 1 error" in newer, newer
    default = outcomes("")
    assert "1 passed, 3 skipped" in default, default
