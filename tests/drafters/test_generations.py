"""The drafter generations' registry (`dflash_jax.drafters.generations`): every generation is found by
its name and by a config of it, the names the CLIs and training list are the registry's, and outside
the registry and the config module no file of the library, the training scripts or the measuring tools
tests which generation it holds (`config.dspark is not None`, `generation == "dflash2"`, ...): they ask
the generation. The check reads the sources with `ast`, and a planted test is caught."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from dflash_jax.drafters import generations
from dflash_jax.drafters.config import DFlash2Config, DrafterConfig, DSparkConfig

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("dflash_jax", "train", "infer")
# the two files that may tell generations apart (the limit is two): the config module (reads and
# writes each generation's own config) and the registry
ALLOWED = {"dflash_jax/drafters/config.py", "dflash_jax/drafters/generations.py"}
OWN_CONFIGS = ("dflash2", "dspark")  # the DrafterConfig fields of a generation's own config


def generation_tests(source: str) -> list[int]:
    """Lines that test which generation something is: a comparison of a generation's own config field
    (`x.dflash2`, `x.dspark`) with None, or of anything with a generation's name."""
    names = set(generations.names())
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        own = any(isinstance(s, ast.Attribute) and s.attr in OWN_CONFIGS for s in sides)
        none = any(isinstance(s, ast.Constant) and s.value is None for s in sides)
        named = any(isinstance(s, ast.Constant) and s.value in names for s in sides)
        if (own and none) or named:
            lines.append(node.lineno)
    return lines


def test_the_check_sees_a_planted_generation_test():
    assert generation_tests("if config.dspark is not None:\n    pass\n") == [1]
    assert generation_tests("x = 1\nif cfg.model.generation == 'dflash2':\n    pass\n") == [2]
    assert generation_tests("y = dc.dflash2 is None\n") == [1]
    assert generation_tests("if generation.trains_own_loss:\n    pass\nz = config.dspark.markov_rank\n") == []


def test_no_file_but_the_registry_and_the_config_tests_the_generation():
    found = {}
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            lines = generation_tests(path.read_text())
            if lines:
                found[str(path.relative_to(ROOT))] = lines
    assert set(found) <= ALLOWED, {k: v for k, v in found.items() if k not in ALLOWED}


BASE = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                     vocab_size=64, num_target_layers=4, target_layer_ids=(1, 3), block_size=8, mask_token_id=63)


@pytest.mark.parametrize("name", generations.names())
def test_each_generation_is_found_by_name_and_by_its_config(name):
    generation = generations.get(name)
    config = generation.published(BASE)
    assert generations.of(config) is generation and config.generation == name
    assert config.architecture == generation.architecture
    assert generation.own(config) == {"dflash": None, "dflash2": config.dflash2, "dspark": config.dspark}[name]
    assert config.proposals + 1 == BASE.block_size  # published keeps what a cycle verifies
    assert generation.published_verify_block >= generation.min_verify_block >= 2
    assert generation.drafter_slots(config, config.proposals + 1) == config.block_size


def test_an_unknown_generation_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown drafter generation 'dflash3' .*dflash, dflash2, dspark"):
        generations.get("dflash3")


def test_the_cli_and_training_list_the_registrys_generations():
    from dflash_jax.cli.bench_random import DRAFTER_GENERATIONS
    from train.config import GENERATION_FIELDS, GENERATION_LOSS_WEIGHTS, GENERATIONS

    assert DRAFTER_GENERATIONS == GENERATIONS == generations.names() == ("dflash", "dflash2", "dspark")
    assert set(GENERATION_FIELDS) == set(GENERATION_LOSS_WEIGHTS) == {"dflash2", "dspark"}


def test_the_name_rules_name_every_param_of_each_generation():
    """Each generation's checkpoint names cover exactly its drafter's params (one rule per leaf)."""
    from dflash_jax.drafters.drafter import drafter_param_shapes

    import jax

    configs = [BASE, dataclasses.replace(BASE, dflash2=DFlash2Config(2, 16, 8, 4)),
               dataclasses.replace(BASE, block_size=7, dspark=DSparkConfig(8, True, True))]
    for config in configs:
        leaves = {tuple(k.key for k in path) for path, _ in
                  jax.tree_util.tree_leaves_with_path(drafter_param_shapes(config))}
        rules = {rule.path for rule in generations.of(config).name_rules(config)}
        assert rules == leaves, (config.generation, leaves ^ rules)
