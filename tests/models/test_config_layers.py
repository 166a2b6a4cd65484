"""Configs that layer: a `base:` key names the file(s) a config deep-merges over (train/config.py),
and each SmolLM2 drafter stage in configs/smollm2/ resolves to exactly the flat file it replaced."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from train.config import ConfigError, config_from_dict, load_config, load_values

ROOT = Path(__file__).resolve().parents[2]
STAGES = ROOT / "configs" / "smollm2"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


BASE = """\
model:
  num_layers: 2
  block_size: 4
  target_layer_ids: [1, 2, 3]
data:
  path: [a, b]
  max_length: 256
  buckets: [128, 256]
optim:
  learning_rate: 1.0e-3
  warmup_ratio: 0.1
run:
  out_dir: runs/base
  steps: 10
"""


def test_overlay_merges_mappings_and_replaces_scalars_and_lists(tmp_path):
    write(tmp_path / "base.yaml", BASE)
    top = write(tmp_path / "top.yaml", """\
base: base.yaml
model:
  block_size: 2
  target_layer_ids: [5]
data:
  path: c
  buckets: [256]
run:
  steps: 3
""")
    values = load_values(top)
    assert "base" not in values
    assert values["model"] == {"num_layers": 2, "block_size": 2, "target_layer_ids": [5]}
    assert values["data"] == {"path": "c", "max_length": 256, "buckets": [256]}  # lists replace, not append
    assert values["optim"] == {"learning_rate": 1.0e-3, "warmup_ratio": 0.1}  # untouched section kept
    cfg = load_config(top)
    assert (cfg.model.num_layers, cfg.model.block_size, cfg.model.target_layer_ids) == (2, 2, (5,))
    assert (cfg.data.path, cfg.data.max_length, cfg.data.buckets) == ("c", 256, (256,))
    assert (cfg.optim.learning_rate, cfg.optim.warmup_ratio) == (1.0e-3, 0.1)
    assert (cfg.run.out_dir, cfg.run.steps) == ("runs/base", 3)


def test_null_in_the_overlay_replaces_the_base_value(tmp_path):
    write(tmp_path / "base.yaml", BASE.replace("  num_layers: 2\n", "  num_layers: 2\n  init_from: runs/x/export\n"))
    assert load_config(tmp_path / "base.yaml").model.init_from == "runs/x/export"
    top = write(tmp_path / "top.yaml", "base: base.yaml\nmodel:\n  init_from: null\n")
    assert load_config(top).model.init_from is None


def test_bases_chain_and_a_list_applies_in_order(tmp_path):
    write(tmp_path / "shared" / "root.yaml", BASE)
    write(tmp_path / "shared" / "middle.yaml", "base: root.yaml\nrun:\n  steps: 20\n  seed: 7\n")  # relative to itself
    write(tmp_path / "extra.yaml", "run:\n  seed: 9\n  log_every: 2\n")
    top = write(tmp_path / "top.yaml", "base: shared/middle.yaml\noptim:\n  learning_rate: 2.0e-3\n")
    cfg = load_config(top)
    assert (cfg.run.out_dir, cfg.run.steps, cfg.run.seed) == ("runs/base", 20, 7)
    assert (cfg.optim.learning_rate, cfg.optim.warmup_ratio) == (2.0e-3, 0.1)
    both = write(tmp_path / "both.yaml", "base: [shared/middle.yaml, extra.yaml]\nrun:\n  log_every: 5\n")
    cfg = load_config(both)
    assert (cfg.run.steps, cfg.run.seed, cfg.run.log_every) == (20, 9, 5)  # later base wins, the file last


def test_a_cycle_raises_naming_the_files(tmp_path):
    write(tmp_path / "a.yaml", "base: b.yaml\nrun:\n  steps: 1\n")
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match=r"cycle.*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_config(tmp_path / "a.yaml")
    write(tmp_path / "self.yaml", "base: self.yaml\n")
    with pytest.raises(ConfigError, match=r"self\.yaml.*cycle"):
        load_config(tmp_path / "self.yaml")


def test_a_missing_base_raises_naming_both_files(tmp_path):
    write(tmp_path / "top.yaml", "base: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=r"top\.yaml: base config file not found: .*nowhere\.yaml"):
        load_config(tmp_path / "top.yaml")
    write(tmp_path / "mid.yaml", "base: gone/deeper.yaml\n")
    write(tmp_path / "top2.yaml", "base: mid.yaml\n")
    with pytest.raises(ConfigError, match=r"mid\.yaml: base config file not found: .*deeper\.yaml"):
        load_config(tmp_path / "top2.yaml")
    with pytest.raises(ConfigError, match="config file not found"):  # the top file itself, as before
        load_config(tmp_path / "absent.yaml")
    write(tmp_path / "bad.yaml", "base: {a: 1}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*`base` must be a file name"):
        load_config(tmp_path / "bad.yaml")


def test_errors_in_a_base_name_the_base(tmp_path):
    write(tmp_path / "base.yaml", "model: [unclosed\n")
    write(tmp_path / "top.yaml", "base: base.yaml\n")
    with pytest.raises(ConfigError, match=r"base\.yaml: not valid YAML"):
        load_config(tmp_path / "top.yaml")
    write(tmp_path / "base.yaml", BASE + "  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"top\.yaml: unknown key\(s\) \['run\.stepz'\]"):
        load_config(tmp_path / "top.yaml")


def test_overrides_apply_after_the_bases(tmp_path):
    write(tmp_path / "base.yaml", BASE)
    top = write(tmp_path / "top.yaml", "base: base.yaml\nrun:\n  steps: 3\n")
    cfg = load_config(top, ["run.steps=50", "model.block_size=8", "data.path=[x, y, z]"])
    assert (cfg.run.steps, cfg.model.block_size, cfg.data.path) == (50, 8, ("x", "y", "z"))
    assert cfg.run.out_dir == "runs/base"
    # config_from_dict takes a base too, named relative to base_dir
    cfg = config_from_dict({"base": "top.yaml", "optim": {"warmup_ratio": 0.0}}, ["run.seed=4"], base_dir=tmp_path)
    assert (cfg.run.steps, cfg.run.seed, cfg.optim.warmup_ratio, cfg.optim.learning_rate) == (3, 4, 0.0, 1.0e-3)


# The flat files each stage ran from (configs/smollm2_dflash_stage1.yaml, configs/smollm2_dflash.yaml
# for stage 2, configs/smollm2_dflash_stage3.yaml ... _stage6.yaml), their values verbatim.
FLAT = {
    1: """\
model:
  target: smollm2
  num_layers: 2
  block_size: 2
  sliding_window: 4
  is_causal: false
  target_layer_ids: [1, 14, 27]
  warm_start: true
  fc_init: last_feature
  draft_vocab_size: 8192
data:
  path: runs/features/smollm2-v2
  max_length: 576
  batch_size: 4
  buckets: [320, 576]
optim:
  learning_rate: 1.0e-3
  warmup_ratio: 0.03
  final_lr_ratio: 0.1
run:
  out_dir: runs/smollm2_dflash_stage1
  steps: 60
  num_anchors: 128
  anchor_chunk: 16
  log_every: 10
  checkpoint_every: 1000
  keep_checkpoints: 1
""",
    2: """\
model:
  target: smollm2
  num_layers: 2
  block_size: 4
  sliding_window: 4
  is_causal: false
  target_layer_ids: [1, 14, 27]
  draft_vocab_size: 8192
  init_from: runs/smollm2_dflash_stage1/export
data:
  path: runs/features/smollm2-v2
  max_length: 576
  batch_size: 8
  buckets: [320, 576]
optim:
  learning_rate: 1.0e-3
  warmup_ratio: 0.02
  final_lr_ratio: 0.1
run:
  out_dir: runs/smollm2_dflash
  steps: 1100
  num_anchors: 96
  anchor_chunk: 16
  log_every: 20
  checkpoint_every: 100
  keep_checkpoints: 11
""",
    3: """\
model:
  target: smollm2
  num_layers: 2
  block_size: 4
  sliding_window: 4
  is_causal: false
  target_layer_ids: [1, 14, 27]
  draft_vocab_size: 8192
  init_from: runs/smollm2_dflash/export
data:
  path: runs/features/sharegpt-original-nt
  max_length: 576
  batch_size: 8
  buckets: [320, 576]
optim:
  learning_rate: 5.0e-4
  warmup_ratio: 0.02
  final_lr_ratio: 0.1
run:
  out_dir: runs/smollm2_dflash_stage3
  steps: 300
  labels: target
  num_anchors: 96
  anchor_chunk: 16
  log_every: 20
  checkpoint_every: 100
  keep_checkpoints: 3
""",
    4: """\
model:
  target: smollm2
  num_layers: 2
  block_size: 2
  sliding_window: 4
  is_causal: false
  target_layer_ids: [1, 14, 27]
  draft_vocab_size: 8192
  init_from: runs/smollm2_dflash_stage3/export
data:
  path: [runs/features/sharegpt-original-3-nt, runs/features/sharegpt-original-4-nt]
  max_length: 576
  batch_size: 8
  buckets: [320, 576]
optim:
  learning_rate: 5.0e-4
  warmup_ratio: 0.02
  final_lr_ratio: 0.1
run:
  out_dir: runs/smollm2_dflash_stage4
  steps: 1500
  labels: target
  num_anchors: 96
  anchor_chunk: 16
  log_every: 20
  checkpoint_every: 200
  keep_checkpoints: 3
""",
    5: """\
model:
  target: smollm2
  num_layers: 2
  block_size: 2
  sliding_window: 4
  is_causal: false
  target_layer_ids: [1, 14, 27]
  draft_vocab_size: 8192
  init_from: runs/smollm2_dflash_stage4/export
data:
  path: [runs/features/sharegpt-original-3-nt, runs/features/sharegpt-original-4-nt,
         runs/features/sharegpt-original-5-nt]
  max_length: 576
  batch_size: 8
  buckets: [320, 576]
optim:
  learning_rate: 5.0e-4
  warmup_ratio: 0.02
  final_lr_ratio: 0.1
run:
  out_dir: runs/smollm2_dflash_stage5
  steps: 1200
  labels: target
  num_anchors: 96
  anchor_chunk: 16
  log_every: 20
  checkpoint_every: 200
  keep_checkpoints: 3
""",
    6: """\
model:
  target: smollm2
  num_layers: 2
  block_size: 2
  sliding_window: 4
  is_causal: false
  target_layer_ids: [1, 14, 27]
  draft_vocab_size: 8192
  init_from: runs/smollm2_dflash_stage5/export
data:
  path: [runs/features/sharegpt-regen-6-nt, runs/features/sharegpt-original-5-nt]
  max_length: 576
  batch_size: 8
  buckets: [320, 576]
optim:
  learning_rate: 5.0e-4
  warmup_ratio: 0.02
  final_lr_ratio: 0.1
run:
  out_dir: runs/smollm2_dflash_stage6
  steps: 700
  labels: target
  num_anchors: 96
  anchor_chunk: 16
  log_every: 20
  checkpoint_every: 100
  keep_checkpoints: 3
""",
}

# A few of those values spelled out per stage:
# (block_size, warm_start, init_from, data.path, batch_size, learning_rate, labels, steps, out_dir)
KEY_VALUES = {
    1: (2, True, None, "runs/features/smollm2-v2", 4, 1.0e-3, "tokens", 60, "runs/smollm2_dflash_stage1"),
    2: (4, False, "runs/smollm2_dflash_stage1/export", "runs/features/smollm2-v2", 8, 1.0e-3, "tokens", 1100,
        "runs/smollm2_dflash"),
    3: (4, False, "runs/smollm2_dflash/export", "runs/features/sharegpt-original-nt", 8, 5.0e-4, "target", 300,
        "runs/smollm2_dflash_stage3"),
    4: (2, False, "runs/smollm2_dflash_stage3/export",
        ("runs/features/sharegpt-original-3-nt", "runs/features/sharegpt-original-4-nt"), 8, 5.0e-4, "target", 1500,
        "runs/smollm2_dflash_stage4"),
    5: (2, False, "runs/smollm2_dflash_stage4/export",
        ("runs/features/sharegpt-original-3-nt", "runs/features/sharegpt-original-4-nt",
         "runs/features/sharegpt-original-5-nt"), 8, 5.0e-4, "target", 1200, "runs/smollm2_dflash_stage5"),
    6: (2, False, "runs/smollm2_dflash_stage5/export",
        ("runs/features/sharegpt-regen-6-nt", "runs/features/sharegpt-original-5-nt"), 8, 5.0e-4, "target", 700,
        "runs/smollm2_dflash_stage6"),
}


@pytest.mark.parametrize("stage", sorted(FLAT))
def test_each_smollm2_stage_resolves_to_its_old_flat_file(stage):
    path = STAGES / f"stage{stage}.yaml"
    assert "base" in yaml.safe_load(path.read_text())  # an overlay, not a copy
    cfg = load_config(path)
    assert cfg == config_from_dict(yaml.safe_load(FLAT[stage]))
    assert cfg.to_dict() == config_from_dict(yaml.safe_load(FLAT[stage])).to_dict()
    m, d, o, r = cfg.model, cfg.data, cfg.optim, cfg.run
    assert (m.block_size, m.warm_start, m.init_from, d.path, d.batch_size, o.learning_rate, r.labels, r.steps,
            r.out_dir) == KEY_VALUES[stage]
    # shared by every stage (configs/smollm2/base.yaml)
    assert (m.target, m.num_layers, m.sliding_window, m.is_causal, m.target_layer_ids, m.draft_vocab_size) == \
        ("smollm2", 2, 4, False, (1, 14, 27), 8192)
    assert (d.max_length, d.buckets, o.final_lr_ratio, r.anchor_chunk) == (576, (320, 576), 0.1, 16)


def test_config_files_hold_no_results_logs():
    """A config says what a run is; what it measured lives in docs/results/."""
    for path in (ROOT / "configs").rglob("*.yaml"):
        comments = [line for line in path.read_text().splitlines() if line.lstrip().startswith("#")]
        text = "\n".join(comments)
        for log in (r"\btau\b", r"issue #\d", r"\d (minutes|s per step)", r"Measured here", r"\bsession\b"):
            assert not re.search(log, text), (path, log)
