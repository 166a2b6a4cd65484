"""The conformance suite's table (support/families.py) against the library: every registered target
family has a row, and every row runs in one test module (support/conformance.py's `GROUPS`, a module
tests/families/test_conformance_<group>.py each)."""
from pathlib import Path

from support import families
from support.conformance import GROUPS
from support.families import FAMILIES

TESTS = Path(__file__).resolve().parent


def test_every_library_family_has_a_conformance_row():
    """The table has one row per family the library registers, and each row's transformers class
    (and its multimodal one) reads as that family."""
    from dflash_jax.models.config import ModelConfig

    assert set(FAMILIES) == families.library_family_names()
    for name, row in FAMILIES.items():
        assert families.target_config(name).arch == name
        if row.conditional:
            hf = {"architectures": [row.conditional[1]], "text_config": row.config}
            assert ModelConfig.from_hf_config(hf).arch == name


def test_every_row_runs_in_one_conformance_module():
    """Each row is in one group of `GROUPS`, and each group's module runs the suite over it."""
    grouped = [name for rows in GROUPS.values() for name in rows]
    assert sorted(grouped) == sorted(FAMILIES), "put each row of support/families.py in one group of GROUPS"
    for group in GROUPS:
        module = TESTS / f"test_conformance_{group}.py"
        assert module.exists(), f"{module.name} is missing"
        assert f'conformance.tests("{group}")' in module.read_text(), module.name
    assert {p.name for p in TESTS.glob("test_conformance_*.py")} == {f"test_conformance_{g}.py" for g in GROUPS}
