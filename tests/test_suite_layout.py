"""The test suite's own layout: shared helpers live in the `support` package, and no test module
imports another (a test module's names are its own; a helper two modules need moves to support/).
Imports are read with `ast`, so a function-local import counts as much as a top-level one."""
import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

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


def test_modules_are_tests_conftest_or_support():
    """Every Python file directly in tests/ is a test module or conftest.py; helpers are in support/."""
    stray = sorted(p.name for p in TESTS.glob("*.py") if not p.name.startswith("test_") and p.name != "conftest.py")
    assert stray == [], f"helper modules belong in tests/support/: {stray}"


def test_no_test_module_imports_another():
    test_modules = {p.stem for p in TESTS.glob("test_*.py")}
    found = set()
    for path in sorted([*TESTS.glob("*.py"), *(TESTS / "support").glob("*.py")]):
        for name in imported_modules(path) & test_modules:
            found.add((path.stem, name))
    assert found - PENDING == set(), "import these from tests/support/ instead: " + ", ".join(
        f"{importer} imports {imported}" for importer, imported in sorted(found - PENDING))
    assert PENDING - found == set(), f"no longer imported, drop from PENDING: {sorted(PENDING - found)}"


def test_the_check_reads_function_local_imports(tmp_path):
    path = tmp_path / "test_example.py"
    path.write_text("import os\n\ndef test_x():\n    from test_other import helper\n    import support.hlo\n")
    assert imported_modules(path) == {"os", "test_other", "support"}
