"""Training runs end to end on the tiny fitted target: tau rises, kill-and-resume reproduces an
uninterrupted run, bad input fails with one clear error and leaves nothing half-written."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from support import fitted_models
from support.devices import xla_flags
from dflash_jax import generate
from dflash_jax.drafters.drafter import Drafter, init_drafter_params
from dflash_jax.formats.names import params_to_hf, target_rules
from dflash_jax.formats.safetensors_io import SafetensorsFile, save_safetensors
from dflash_jax.loading.drafter_io import load_drafter
from dflash_jax.models.config import write_config_json
from train import checkpointing, drafter_init
from train.config import ConfigError, config_from_dict, load_config
from train.cache_features import cache_features
from train.data import load_token_records
from train.export import export
from train.train import drafter_config_for, train

ROOT = Path(__file__).resolve().parents[2]
PROMPT, NEW = 4, 28
VOCAB = 32  # draft vocabulary of the reduced-vocabulary run (the data uses 40 ids)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, fitted_target):
    """(target dir, train JSONL, held-out prompts): the fitted target and its own greedy continuations."""
    root = tmp_path_factory.mktemp("tiny")
    target = fitted_target
    cfg = fitted_models.TARGET_CONFIG
    hf = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": cfg.vocab_size,
          "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
          "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
          "tie_word_embeddings": False}
    target_dir = root / "target"
    target_dir.mkdir()
    save_safetensors(params_to_hf(target_rules(cfg), target.params, cfg.num_layers), target_dir / "model.safetensors")
    write_config_json(target_dir, hf)
    prompts = fitted_models.pattern_batch(np.random.default_rng(1), 72, PROMPT).tolist()
    out = generate(target, None, prompts, max_new_tokens=NEW, stop_token_ids=())
    data = root / "train.jsonl"
    with data.open("w") as f:
        for p, t in zip(prompts[:64], out.tokens[:64]):
            f.write(json.dumps({"tokens": p + t, "loss_mask": [0] * PROMPT + [1] * len(t)}) + "\n")
    return target, target_dir, data, prompts[64:]


def settings(tiny, out_dir, **run):
    _, target_dir, data, _ = tiny
    return {"model": {"target": str(target_dir), "num_layers": 1, "intermediate_size": 128, "block_size": 8,
                      "target_layer_ids": [0, 2], "mask_token_id": fitted_models.MASK},
            "data": {"path": str(data), "max_length": 32, "batch_size": 8, "seed": 3},
            "optim": {"learning_rate": 3e-3, "warmup_ratio": 0.05},
            "run": {"out_dir": str(out_dir), "steps": 120, "num_anchors": 8, "log_every": 20,
                    "checkpoint_every": 60, "async_checkpointing": False, **run}}


@pytest.mark.slow  # a training-convergence check (120 steps, then generate): `make test-all`
def test_a_short_run_raises_tau_through_generate(tiny, tmp_path):
    target, _, _, held_out = tiny
    cfg = config_from_dict(settings(tiny, tmp_path / "run"))
    last = train(cfg, target=target)
    assert last["step"] == 120 and np.isfinite(last["loss"])
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert len(lines) == 6 and last["loss"] < first["loss"] and len(first["slot_accuracy"]) == 7
    dcfg = drafter_config_for(cfg, target)
    _, params = checkpointing.restore_params(tmp_path / "run")
    untrained = Drafter(dcfg, init_drafter_params(dcfg, jax.random.PRNGKey(0)))
    tau_before = generate(target, untrained, held_out, max_new_tokens=24, stop_token_ids=()).tau
    tau_after = generate(target, Drafter(dcfg, params["drafter"]), held_out, max_new_tokens=24,
                         stop_token_ids=()).tau
    assert tau_after > tau_before + 1.0, (tau_before, tau_after)


def test_a_run_exports_and_a_later_run_continues_from_the_export(tiny, tmp_path):
    """A few steps end to end: metrics logged, the export loads as the same drafter (also with a
    smaller block), and a later run starts from it (model.init_from), refusing a misfit."""
    target = tiny[0]
    cfg = config_from_dict(settings(tiny, tmp_path / "run", steps=4, log_every=2, checkpoint_every=4))
    last = train(cfg, target=target)
    assert last["step"] == 4 and np.isfinite(last["loss"])
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and len(json.loads(lines[0])["slot_accuracy"]) == 7
    dcfg = drafter_config_for(cfg, target)
    _, params = checkpointing.restore_params(tmp_path / "run")

    exported = export(tmp_path / "run", tmp_path / "drafter", dtype="float32")
    loaded = load_drafter(exported, target=target)
    assert loaded.config == dcfg
    jax.tree.map(np.testing.assert_array_equal, loaded.params, params["drafter"])
    with pytest.raises(FileExistsError, match="--force"):
        export(tmp_path / "run", tmp_path / "drafter")
    smaller = load_drafter(export(tmp_path / "run", tmp_path / "block4", dtype="float32", block_size=4), target=target)
    assert smaller.config == dataclasses.replace(dcfg, block_size=4)
    with pytest.raises(ValueError, match="block-size must be >= 2"):
        export(tmp_path / "run", tmp_path / "block1", block_size=1)
    with pytest.raises(checkpointing.CheckpointError, match=r"has no checkpoint of step 99; its steps: 4$"):
        export(tmp_path / "run", tmp_path / "step99", step=99)
    assert not (tmp_path / "step99").exists()

    # A later run continues from the exported drafter (model.init_from), here with another block
    # size and an attention window the export did not have (both masks, not weight shapes).
    again = config_from_dict(settings(tiny, tmp_path / "again", steps=1),
                             [f"model.init_from={exported}", "model.block_size=4", "model.sliding_window=3",
                              "optim.learning_rate=1e-9"])
    train(again, target=target)
    _, continued = checkpointing.restore_params(tmp_path / "again")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), continued["drafter"], params["drafter"])
    windowed = load_drafter(export(tmp_path / "again", tmp_path / "windowed", dtype="float32"), target=target)
    assert (windowed.config.sliding_window, windowed.config.block_size) == (3, 4)
    assert set(windowed.config.layer_types) == {"sliding_attention"}
    with pytest.raises(ConfigError, match=r"does not fit the configured drafter .*intermediate_size"):
        train(config_from_dict(settings(tiny, tmp_path / "misfit"),
                               [f"model.init_from={exported}", "model.intermediate_size=64"]), target=target)

    # ... or grows it by a layer, which starts as an identity: the trained layer kept below it.
    grown_run = config_from_dict(settings(tiny, tmp_path / "grown", steps=1),
                                 [f"model.init_from={exported}", "model.num_layers=2", "optim.learning_rate=1e-9"])
    train(grown_run, target=target)
    _, grown = checkpointing.restore_params(tmp_path / "grown")
    assert jax.tree.leaves(grown["drafter"]["layers"])[0].shape[0] == 2
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a[:1], b, atol=1e-6), grown["drafter"]["layers"],
                 params["drafter"]["layers"])
    # The added layer started as an identity (drafter_init.grow zeroes its attention output and MLP down
    # projections; a fresh init's are far from 0, one step at 1e-9 keeps them within 1e-6), and grow
    # refuses to "extend" a drafter to fewer layers (test_a_grown_drafter_drafts_what_it_grew_from, under
    # make test-all, checks by drafting that the grown drafter drafts what it grew from).
    added = grown["drafter"]["layers"]
    for projection in (added["self_attn"]["o_proj"], added["mlp"]["down_proj"]):
        jax.tree.map(lambda a: np.testing.assert_allclose(a[1:], 0, atol=1e-6), projection)
    with pytest.raises(drafter_init.DrafterFitError, match="cannot extend"):
        drafter_init.grow(grown, params)
    with pytest.raises(ConfigError, match=r"does not fit the configured drafter .*num_layers"):
        train(config_from_dict(settings(tiny, tmp_path / "shrunk"),
                               [f"model.init_from={export(tmp_path / 'grown', tmp_path / 'deeper')}",
                                "model.num_layers=1"]), target=target)


@pytest.mark.slow  # covered by default: test_a_run_exports_and_a_later_run_continues_from_the_export (a run grown
# from an export through drafter_init.grow: the trained layer kept, the added one's zeroed projections, the same
# "cannot extend" DrafterFitError); here the three generate runs that show it drafts the same: `make test-all`
def test_a_grown_drafter_drafts_what_it_grew_from(fitted, tiny):
    """drafter_init.grow stacks identity layers on a trained drafter: the same drafts, cycle for
    cycle, as the drafter it grew from (a deeper run starts where the shallower one ended), where
    the same layers stacked as they were initialised draft something else."""
    target, drafter = fitted
    prompts = tiny[3]
    n = drafter.config.num_layers
    deeper = dataclasses.replace(drafter.config, num_layers=n + 2, layer_types=drafter.config.layer_types[:1] * (n + 2))
    start = {"drafter": drafter.params}
    fresh = {"drafter": init_drafter_params(deeper, jax.random.PRNGKey(2))}
    grown = drafter_init.grow(start, fresh)["drafter"]
    raw = {**grown, "layers": jax.tree.map(lambda a, b: np.concatenate([a, b[n:]]), drafter.params["layers"],
                                           fresh["drafter"]["layers"])}
    run = lambda config, params: generate(target, Drafter(config, params), prompts, max_new_tokens=24,
                                          stop_token_ids=())
    before, after, unzeroed = run(drafter.config, drafter.params), run(deeper, grown), run(deeper, raw)
    assert before.tau > 2.0
    assert after.acceptance_lengths == before.acceptance_lengths
    assert unzeroed.acceptance_lengths != before.acceptance_lengths
    with pytest.raises(drafter_init.DrafterFitError, match="cannot extend"):
        drafter_init.grow({"drafter": grown}, fresh)


def test_a_run_learns_the_targets_distribution_from_a_top_k_cache(tiny, tmp_path):
    """run.labels=distribution end to end: two feature caches with the target's top-k tokens read
    as one corpus (data.path a list; the smaller top-k counts), the offline step's soft labels
    (with a reduced draft vocabulary), logged metrics."""
    target, _, data, _ = tiny
    for name, top_k in (("cache", 4), ("more", 6)):
        cache_features(target, load_token_records(data, None, 32), tmp_path / name, (0, 2), batch_size=8,
                       buckets=(32,), top_k=top_k, progress=False)
    caches = f"[{tmp_path / 'cache'}, {tmp_path / 'more'}]"
    cfg = config_from_dict(settings(tiny, tmp_path / "run", steps=2, log_every=1, checkpoint_every=2),
                           [f"data.path={caches}", "data.buckets=[32]", "run.labels=distribution",
                            "run.label_top_k=4", f"model.draft_vocab_size={VOCAB}"])
    assert cfg.data.paths == (str(tmp_path / "cache"), str(tmp_path / "more"))
    with pytest.raises(ConfigError, match="--top-k 5 or more; this one has 4"):
        train(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, label_top_k=5)), target=target)
    last = train(cfg, target=target)
    assert last["step"] == 2 and np.isfinite(last["loss"]) and last["loss"] > 0
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def _launch(config_file: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "XLA_FLAGS": xla_flags(1), "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, "-m", "train.train", "--config", str(config_file), *extra],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow  # two training subprocesses, one SIGKILLed: `make test-all`
def test_kill_and_resume_equals_an_uninterrupted_run(tiny, tmp_path):
    configs = {}
    for name in ("straight", "killed"):
        configs[name] = tmp_path / f"{name}.yaml"
        values = settings(tiny, tmp_path / name, steps=400, checkpoint_every=25, log_every=50, keep_checkpoints=2)
        values["model"]["draft_vocab_size"] = VOCAB  # a reduced draft vocabulary: labels outside it weigh 0
        configs[name].write_text(yaml.safe_dump(values))
    straight, killed = _launch(configs["straight"]), _launch(configs["killed"])
    first = tmp_path / "killed" / "checkpoints" / "25"
    deadline = time.time() + 400
    while not first.is_dir() and time.time() < deadline and killed.poll() is None:
        time.sleep(0.02)
    assert killed.poll() is None, "the run ended before it could be killed: " + killed.stdout.read()
    assert first.is_dir(), "no checkpoint within the deadline"
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert straight.wait(timeout=300) == 0, straight.stdout.read()
    resumed = _launch(configs["killed"], "--resume")
    assert resumed.wait(timeout=300) == 0, resumed.stdout.read()

    step_a, a = checkpointing.restore_params(tmp_path / "straight")
    step_b, b = checkpointing.restore_params(tmp_path / "killed")
    assert step_a == step_b == 400
    jax.tree.map(np.testing.assert_array_equal, a, b)
    data_state = lambda run: (run / "checkpoints" / "400" / "data" / "process_0-of-1.json").read_text()
    assert data_state(tmp_path / "straight") == data_state(tmp_path / "killed")

    exported = export(tmp_path / "straight", tmp_path / "drafter")
    tensors = SafetensorsFile(exported / "model.safetensors")
    d2t, t2d, head = tensors["d2t"], tensors["t2d"], tensors["lm_head.weight"]
    assert d2t.dtype == np.int64 and d2t.shape == (VOCAB,) and t2d.dtype == bool and t2d.shape == (48,)
    np.testing.assert_array_equal(np.flatnonzero(t2d), d2t + np.arange(VOCAB))
    np.testing.assert_allclose(head.astype(np.float32), np.asarray(a["draft_head"]).T, rtol=1e-2, atol=1e-3)
    assert json.loads((exported / "config.json").read_text())["draft_vocab_size"] == VOCAB


def test_resume_run_dir_continues_with_the_runs_config_and_says_so(tiny, tmp_path, capsys):
    """`python -m train.train --resume RUN_DIR run.steps=4` continues the run with the configuration it
    was started with (its config.yaml: the data path given to the first run included), says from
    which step, and prints a line per logged step; RUN_DIR without a run is one error line."""
    from train.train import main

    target = tiny[0]
    run = tmp_path / "run"
    train(config_from_dict(settings(tiny, run, steps=2, log_every=1, checkpoint_every=2)), target=target)
    capsys.readouterr()
    assert main(["--resume", str(run), "run.steps=4"]) == 0
    err = capsys.readouterr().err
    assert f"resuming {run} from step 2 (its latest checkpoint) to step 4" in err, err
    assert "step 3/4  loss " in err and "step 4/4  loss " in err and "tokens/s" in err and "left" in err, err
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert main(["--resume", str(tmp_path / "nowhere")]) == 2
    assert "no run there" in capsys.readouterr().err


def test_bad_input_fails_with_one_clear_error(tiny, tmp_path):
    target = tiny[0]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="no records"):
        train(config_from_dict(settings(tiny, tmp_path / "a"), [f"data.path={empty}"]), target=target)
    with pytest.raises(drafter_init.DrafterFitError, match=r"target_layer_ids \[7\]"):
        train(config_from_dict(settings(tiny, tmp_path / "b"), ["model.target_layer_ids=[0,7]"]), target=target)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()

    corrupt = tmp_path / "c" / "checkpoints" / "60"
    (corrupt / "state").mkdir(parents=True)
    (corrupt / "state" / "garbage").write_text("not a checkpoint")
    with pytest.raises(checkpointing.CheckpointError, match="cannot be restored"):
        train(config_from_dict(settings(tiny, tmp_path / "c")), resume=True, target=target)
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        train(config_from_dict(settings(tiny, tmp_path / "c")), target=target)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['run.stepz'\]"):
        config_from_dict(settings(tiny, tmp_path / "d"), ["run.stepz=3"])
    with pytest.raises(ConfigError, match="optim.learning_rate: expected a number"):
        config_from_dict(settings(tiny, tmp_path / "d"), ["optim.learning_rate=fast"])
    assert config_from_dict(settings(tiny, tmp_path / "d"), ["optim.learning_rate=2e-3"]).optim.learning_rate == 2e-3
    with pytest.raises(ConfigError, match="warm_start_layers needs model.warm_start"):
        config_from_dict(settings(tiny, tmp_path / "d"), ["model.warm_start_layers=[0]"])
    with pytest.raises(ConfigError, match=r"run.labels must be one of \('tokens', 'target', 'distribution'\)"):
        config_from_dict(settings(tiny, tmp_path / "d"), ["run.labels=gold"])

    # run.labels=target reads the target's next tokens from a feature cache; an older cache has none.
    # (The cache is written with --top-k 4, as the top-k test's first one is: the same compiled
    # feature pass. What these checks read is meta.json, edited to what an older cache's says.)
    cache = tmp_path / "cache"
    cache_features(target, load_token_records(tiny[2], None, 32), cache, (0, 2), batch_size=8, buckets=(32,),
                   top_k=4, progress=False)
    meta = json.loads((cache / "meta.json").read_text())
    assert meta["next_tokens"] and meta.pop("top_k") == 4
    (cache / "meta.json").write_text(json.dumps({**meta, "next_tokens": False}))
    with pytest.raises(ConfigError, match="lacks"):
        train(config_from_dict(settings(tiny, tmp_path / "e"), [f"data.path={cache}", "run.labels=target"]),
              target=target)
    assert not (tmp_path / "e").exists()
    # run.labels=distribution reads the target's top-k tokens, which a cache holds only with --top-k
    # (its meta.json then names it: here taken out, as a cache written without --top-k has it).
    (cache / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="--top-k 8 or more; this one has 0"):
        train(config_from_dict(settings(tiny, tmp_path / "f"), [f"data.path={cache}", "run.labels=distribution"]),
              target=target)
    assert not (tmp_path / "f").exists()


# Every config under configs/, subfolders included, resolved through its `base:` files. A base that
# only holds what its overlays share (configs/smollm2/base.yaml) names no data.path, so it is not a
# complete config by itself: it is checked with one supplied, the rest of its keys as they are.
PARTIAL_CONFIGS = {"smollm2/base.yaml": ["data.path=runs/features/any"]}


@pytest.mark.parametrize("name", sorted(p.relative_to(ROOT / "configs").as_posix()
                                        for p in (ROOT / "configs").rglob("*.yaml")))
def test_shipped_configs_are_valid(name):
    if name in PARTIAL_CONFIGS:
        with pytest.raises(ConfigError, match="path"):
            load_config(ROOT / "configs" / name)
    cfg = load_config(ROOT / "configs" / name, PARTIAL_CONFIGS.get(name, ()))
    assert cfg.run.steps > 0 and cfg.data.batch_size % cfg.optim.grad_accum == 0


def test_shipped_configs_include_the_smollm2_stages():
    names = {p.relative_to(ROOT / "configs").as_posix() for p in (ROOT / "configs").rglob("*.yaml")}
    assert {f"smollm2/stage{i}.yaml" for i in range(1, 7)} | set(PARTIAL_CONFIGS) <= names


def test_sliding_window_drafter_config(tiny, tmp_path):
    """model.sliding_window makes every drafter layer a sliding-window layer (config.json carries it)."""
    target = tiny[0]
    cfg = config_from_dict(settings(tiny, tmp_path / "w"), ["model.sliding_window=16"])
    dcfg = drafter_config_for(cfg, target)
    assert dcfg.layer_windows == (16,) and dcfg.to_hf_config()["layer_types"] == ["sliding_attention"]
    assert drafter_config_for(config_from_dict(settings(tiny, tmp_path / "f")), target).layer_windows == (0,)
    with pytest.raises(ConfigError, match="sliding_window"):
        config_from_dict(settings(tiny, tmp_path / "n"), ["model.sliding_window=-1"])
