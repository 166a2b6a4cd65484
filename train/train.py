"""Train a DFlash drafter for a frozen target.

    python -m train.train --config configs/tiny_cpu.yaml [section.key=value ...]
    python -m train.train --resume RUN_DIR [section.key=value ...]      # continue a run as it was started
    python -m train.train --config configs/qwen3_8b.yaml --coordinator HOST:PORT --num-processes 4 --process-id 0

Writes RUN_DIR (= run.out_dir): config.yaml, drafter/config.json (the drafter's official config),
draft_vocab.npz (reduced vocabulary only), metrics.jsonl (one line per log step), checkpoints/.
Online mode runs the target inside the step; offline mode reads cached features (data.path is a
feature cache written by `python -m train.cache_features`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from tqdm.auto import tqdm

from dflash_jax import sharding
from dflash_jax.drafters import generations
from dflash_jax.drafters.draft_vocab import build_draft_vocab, DraftVocab
from dflash_jax.drafters.drafter import Drafter
from dflash_jax.engine.generator import generate
from dflash_jax.loading.target_loader import load_target
from train import checkpointing, data as data_lib, drafter_init, step as step_lib
from train.config import ConfigError, TrainConfig, load_config

log = logging.getLogger("train")
VOCAB_FILE = "draft_vocab.npz"


def load_target_model(cfg: TrainConfig):
    if cfg.model.target == "smollm2":
        from dflash_jax._resources import smollm2_gguf_path

        return load_target(smollm2_gguf_path(), dtype=cfg.model.target_dtype, layout="stacked")
    return load_target(cfg.model.target, dtype=cfg.model.target_dtype, layout="stacked")


def generation_configs(m) -> dict:
    """model.generation's own drafter config fields (`Generation.train_fields`): {"dflash2":
    DFlash2Config} or {"dspark": DSparkConfig}, or {} for a DFlash drafter."""
    return generations.get(m.generation).train_fields(m.generation_field)


def drafter_config_for(cfg: TrainConfig, target):
    m = cfg.model
    return drafter_init.build_drafter_config(target, num_layers=m.num_layers, block_size=m.block_size,
                                             intermediate_size=m.intermediate_size,
                                             target_layer_ids=m.target_layer_ids, mask_token_id=m.mask_token_id,
                                             sliding_window=m.sliding_window, is_causal=m.is_causal,
                                             **generation_configs(m))


def step_spec(cfg: TrainConfig, drafter_config) -> step_lib.StepSpec:
    """The train step's static settings from the run's config (decay None: the generation's default:
    DeepSpec's 4.0 for DSpark, the paper's value for the block size otherwise:
    `Generation.default_decay`)."""
    r = cfg.run
    generation = generations.of(drafter_config)
    decay = r.decay or generation.default_decay(drafter_config)
    weights = generation.loss_weights(cfg.loss_weight)
    return step_lib.StepSpec(num_anchors=r.num_anchors, decay=decay, logits_chunk=r.logits_chunk,
                             compute_dtype=r.compute_dtype, grad_accum=cfg.optim.grad_accum,
                             anchor_chunk=r.anchor_chunk, target_labels=r.labels != "tokens",
                             label_top_k=r.label_top_k if r.labels == "distribution" else 0, **weights)


def check_feature_cache(cfg: TrainConfig, drafter_config, meta: dict) -> None:
    """Offline mode: the cache(s) (`meta`, FeatureRecords.meta) must hold the features of the
    drafter's target layers, and the labels the run learns."""
    if tuple(meta["target_layer_ids"]) != drafter_config.target_layer_ids or \
            meta["hidden_size"] != drafter_config.hidden_size:
        raise ConfigError(f"{cfg.data.path}: feature cache has layers {meta['target_layer_ids']} of width "
                          f"{meta['hidden_size']}; the drafter needs layers {list(drafter_config.target_layer_ids)} "
                          f"of width {drafter_config.hidden_size} (rerun train.cache_features or set "
                          f"model.target_layer_ids)")
    if cfg.run.labels != "tokens" and not meta.get("next_tokens"):
        raise ConfigError(f"{cfg.data.path}: run.labels={cfg.run.labels} needs the target's next tokens, which "
                          f"this feature cache (written before they were stored) lacks; rerun "
                          f"train.cache_features into a new directory, or use run.labels=tokens")
    if cfg.run.labels == "distribution" and meta.get("top_k", 0) < cfg.run.label_top_k:
        raise ConfigError(f"{cfg.data.path}: run.labels=distribution with run.label_top_k={cfg.run.label_top_k} "
                          f"needs a feature cache written with train.cache_features --top-k "
                          f"{cfg.run.label_top_k} or more; this one has {meta.get('top_k', 0)}")


def draft_vocabulary(cfg: TrainConfig, run_dir: Path, target, records, init=None) -> DraftVocab | None:
    """The run's draft vocabulary: RUN_DIR's (on resume), that of the drafter the run starts from
    (`init`), model.draft_vocab_path, or built from the loss-masked token counts of the training
    data (the target's stop tokens always kept)."""
    size = cfg.model.draft_vocab_size
    if not size:
        return None
    saved = run_dir / VOCAB_FILE
    if saved.is_file():
        vocab = DraftVocab.load(saved)
    elif init is not None:
        vocab = init.draft_vocab
        if vocab is None:
            raise ConfigError(f"model.init_from: {cfg.model.init_from} has no draft vocabulary; set "
                              "model.draft_vocab_size to 0 to continue it")
    elif cfg.model.draft_vocab_path:
        vocab = DraftVocab.load(cfg.model.draft_vocab_path)
    else:
        counts = data_lib.count_tokens(cfg.data, target.tokenizer, target.config.vocab_size)
        vocab = build_draft_vocab(counts, size, always_include=target.config.eos_token_ids)
    if vocab.size != size or vocab.target_vocab_size != target.config.vocab_size:
        raise ConfigError(f"draft vocabulary has {vocab.size} of {vocab.target_vocab_size} ids; the config asks "
                          f"for {size} of the target's {target.config.vocab_size}")
    return vocab


def initial_drafter(cfg: TrainConfig, target, drafter_config):
    """model.init_from loaded against the target (None without it). Every shape must match the
    config's drafter; the block size and the attention window may differ (masks, not weight
    shapes: a run may continue a drafter with a larger block or a wider window), and the config
    may ask for more layers (`drafter_init.grow` stacks them on top, each an identity at first)."""
    if not cfg.model.init_from:
        return None
    from dflash_jax.loading.drafter_io import load_drafter

    drafter = load_drafter(cfg.model.init_from, target, "float32")
    # masks, not weights; the vocabulary: below
    may_differ = {"block_size", "layer_types", "sliding_window", "is_causal", "draft_vocab_size"}
    have, want = drafter.config, drafter_config
    diff = {f.name: (getattr(have, f.name), getattr(want, f.name)) for f in dataclasses.fields(want)
            if f.name not in may_differ and getattr(have, f.name) != getattr(want, f.name)}
    if have.num_layers < want.num_layers:
        diff.pop("num_layers")  # grown in fresh_state (drafter_init.grow)
    if diff:
        raise ConfigError(f"model.init_from: {cfg.model.init_from} does not fit the configured drafter "
                          f"(field: (its value, the config's)): {diff}")
    if (drafter.config.draft_vocab_size or 0) != cfg.model.draft_vocab_size:
        raise ConfigError(f"model.init_from: {cfg.model.init_from} drafts over "
                          f"{drafter.config.draft_vocab_size or 'the full'} vocabulary; the config asks for "
                          f"model.draft_vocab_size={cfg.model.draft_vocab_size}")
    return drafter


def eval_prompts(path: str, count: int) -> list[list[int]]:
    """Held-out prompts: each pre-tokenized record's tokens before its first loss-masked token."""
    prompts = []
    with open(path) as f:
        for line in f:
            if line.strip() and len(prompts) < count:
                record = json.loads(line)
                mask = np.asarray(record["loss_mask"], bool)
                start = int(np.argmax(mask)) if mask.any() else len(mask)
                prompts.append([int(t) for t in record["tokens"][:max(start, 1)]])
    return prompts


def measure_tau(target, drafter_config, params, prompts, max_new_tokens: int,
                vocab: DraftVocab | None = None) -> float:
    """Greedy tau through `generate` on the prompts; params: the trainable params ({"drafter": ...},
    plus {"draft_head": kernel [D, Vd]} with the run's draft vocabulary `vocab`)."""
    params = jax.device_get(params)
    drafter = Drafter(drafter_config, params["drafter"])
    if "draft_head" in params:
        drafter = drafter.with_draft_vocab(params["draft_head"], vocab)
    return generate(target, drafter, prompts, max_new_tokens=max_new_tokens).tau


class MetricsLog:
    """metrics.jsonl, a line on the terminal per logged step (process 0 only), and the progress bar's
    postfix."""

    def __init__(self, run_dir: Path, bar, enabled: bool, total_steps: int):
        self.path, self.bar, self.enabled, self.total = run_dir / "metrics.jsonl", bar, enabled, total_steps

    def write(self, record: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            tqdm.write(progress_line(record, self.total), file=sys.stderr)
        self.bar.set_postfix({k: f"{v:.3g}" for k, v in record.items()
                              if k in ("loss", "tau_estimate", "tau", "tokens_per_s")}, refresh=False)


def progress_line(record: dict, total_steps: int) -> str:
    """'step 20/100  loss 3.214  tau~ 1.41  812 tokens/s  0.52 s/step  41 s left' for a logged step."""
    left = record["step_time"] * (total_steps - record["step"])
    parts = [f"step {record['step']}/{total_steps}", f"loss {record['loss']:.4g}",
             f"tau~ {record['tau_estimate']:.3g}"]
    if "tau" in record:
        parts.append(f"tau {record['tau']:.3g}")
    parts += [f"{record['tokens_per_s']:.0f} tokens/s", f"{record['step_time']:.3g} s/step",
              f"{left:.0f} s left" if left < 120 else f"{left / 60:.1f} min left"]
    return "  ".join(parts)


def prepare_run_dir(cfg: TrainConfig, run_dir: Path, resume: bool, drafter_config) -> None:
    has_checkpoints = checkpointing.checkpoint_dir(run_dir).is_dir() and \
        any(checkpointing.checkpoint_dir(run_dir).iterdir())
    if resume and not has_checkpoints:
        raise checkpointing.CheckpointError(f"--resume: no checkpoints in {checkpointing.checkpoint_dir(run_dir)}")
    if not resume and has_checkpoints:
        raise ConfigError(f"{run_dir} already holds checkpoints: pass --resume, or a new run.out_dir")
    if jax.process_index() == 0:
        (run_dir / "drafter").mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        (run_dir / "drafter" / "config.json").write_text(
            json.dumps(drafter_config.to_hf_config(), indent=2, sort_keys=True) + "\n")


def train(cfg: TrainConfig, *, resume: bool = False, target=None) -> dict:
    """Run (or resume) training; returns the last logged metrics. `target` skips loading it."""
    run_dir = Path(cfg.run.out_dir)
    target = load_target_model(cfg) if target is None else target
    drafter_config = drafter_config_for(cfg, target)
    try:
        offline = data_lib.is_offline(cfg.data)
        records = data_lib.load_records(cfg.data, target.tokenizer)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"data.path: {e}") from e
    if offline:
        if generations.of(drafter_config).trains_own_loss:
            raise ConfigError(f"data.path: {cfg.data.path} is a feature cache; a {drafter_config.generation} drafter "
                              "trains online (its loss reads the target's whole distribution at every proposal)")
        check_feature_cache(cfg, drafter_config, records.meta)
    prepare_run_dir(cfg, run_dir, resume, drafter_config)
    init = initial_drafter(cfg, target, drafter_config)
    vocab = draft_vocabulary(cfg, run_dir, target, records, init)
    if vocab is not None and jax.process_index() == 0:
        vocab.save(run_dir / VOCAB_FILE)

    mesh = sharding.make_mesh(data=cfg.run.mesh_data, fsdp=cfg.run.mesh_fsdp)
    schedule = step_lib.learning_rate_schedule(cfg.optim.learning_rate, cfg.run.steps, cfg.optim.warmup_ratio,
                                               cfg.optim.final_lr_ratio)
    optimizer = step_lib.make_optimizer(schedule, clip_norm=cfg.optim.clip_norm,
                                        weight_decay=cfg.optim.weight_decay, b1=cfg.optim.b1, b2=cfg.optim.b2,
                                        frozen=step_lib.frozen_paths(drafter_config))
    spec = step_spec(cfg, drafter_config)

    frozen = {"target": target.params}
    if vocab is not None:
        frozen["target_to_draft"] = jnp.asarray(vocab.target_to_draft())
    frozen_shardings = sharding.fsdp_shardings(mesh, frozen, shard=cfg.run.shard_target)
    frozen = jax.device_put(frozen, frozen_shardings)

    start = None  # model.init_from's weights: an argument of fresh_state, never a compiled-in constant
    if init is not None:
        start = {"drafter": jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), init.params)}
        if vocab is not None:
            start["draft_head"] = jnp.asarray(init.draft_head["kernel"], jnp.float32)

    growing = init is not None and init.config.num_layers < drafter_config.num_layers

    def fresh_state(target_params, start):
        params = start
        if start is None or growing:
            params = drafter_init.initial_params(
                drafter_config, target, target_params, jax.random.PRNGKey(cfg.run.seed),
                warm=cfg.model.warm_start, warm_layers=cfg.model.warm_start_layers, fc_init=cfg.model.fc_init,
                draft_to_target=None if vocab is None else vocab.draft_to_target)
            if growing:
                params = drafter_init.grow(start, params)
        return step_lib.init_state(params, optimizer, cfg.run.seed)

    abstract = jax.eval_shape(fresh_state, frozen["target"], start)
    state_shardings = sharding.fsdp_shardings(mesh, abstract)
    iterator = data_lib.make_iterator(cfg.data, target.tokenizer, records=records)
    manager = checkpointing.make_manager(run_dir, cfg.run.keep_checkpoints, cfg.run.async_checkpointing)
    if resume:
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                abstract, state_shardings)
        state, iterator = checkpointing.restore(manager, abstract, iterator)
    else:
        state = jax.jit(fresh_state, out_shardings=state_shardings)(frozen["target"], start)

    train_step = jax.jit(step_lib.make_train_step(target, drafter_config, spec, optimizer, schedule),
                         in_shardings=(state_shardings, frozen_shardings, sharding.train_batch_sharding(mesh)),
                         out_shardings=(state_shardings, sharding.replicated(mesh)), donate_argnums=(0,))
    prompts = eval_prompts(cfg.run.eval_path, cfg.run.eval_prompts) if cfg.run.eval_every else []
    start = int(jax.device_get(state.step))
    if resume and jax.process_index() == 0:
        tqdm.write(f"resuming {run_dir} from step {start} (its latest checkpoint) to step {cfg.run.steps}",
                   file=sys.stderr)
    last: dict = {}
    with tqdm(total=cfg.run.steps, initial=start, desc="train", unit="step", disable=None) as bar:
        metrics_log = MetricsLog(run_dir, bar, jax.process_index() == 0, cfg.run.steps)
        clock, tokens, blocks = time.perf_counter(), 0, 0
        for step in range(start + 1, cfg.run.steps + 1):
            try:
                local = next(iterator)
            except StopIteration:
                log.info("data exhausted after %d epochs at step %d", cfg.data.num_epochs, step - 1)
                break
            batch = sharding.global_batch(mesh, local)
            state, metrics = train_step(state, frozen, batch)
            tokens += int(np.sum(local["lengths"])) * jax.process_count()
            blocks += cfg.data.batch_size * cfg.run.num_anchors * drafter_config.block_size
            bar.update()
            if step % cfg.run.log_every == 0 or step == cfg.run.steps:
                metrics = jax.device_get(metrics)
                elapsed = time.perf_counter() - clock
                steps_done = step - (last.get("step", start))
                last = {"step": step, "loss": float(metrics["loss"]), "tau_estimate": float(metrics["tau_estimate"]),
                        "slot_accuracy": [round(float(a), 5) for a in metrics["slot_accuracy"]],
                        "grad_norm": float(metrics["grad_norm"]), "learning_rate": float(metrics["learning_rate"]),
                        "step_time": elapsed / steps_done, "tokens_per_s": tokens / elapsed,
                        "block_tokens_per_s": blocks / elapsed,
                        **{k: float(v) for k, v in metrics.items() if k.endswith("_loss")}}  # the loss's terms
                if cfg.run.eval_every and step % cfg.run.eval_every == 0:
                    last["tau"] = measure_tau(target, drafter_config, state.params, prompts,
                                              cfg.run.eval_max_new_tokens, vocab)
                metrics_log.write(last)
                clock, tokens, blocks = time.perf_counter(), 0, 0
            if step % cfg.run.checkpoint_every == 0 or step == cfg.run.steps:
                checkpointing.save(manager, state, iterator)
    manager.wait_until_finished()
    manager.close()
    return last


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m train.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="YAML file (see configs/); not needed with --resume RUN_DIR")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.learning_rate=1e-3 run.steps=100")
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="RUN_DIR",
                   help="continue from the latest checkpoint: of RUN_DIR with the configuration it was started "
                        "with (its config.yaml; overrides apply on top), or alone with --config, of its "
                        "run.out_dir")
    p.add_argument("--coordinator", help="HOST:PORT of process 0 for multi-process runs")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    return p.parse_args(argv)


def run_config(args) -> Path:
    """The config file a run reads: --config, or with `--resume RUN_DIR` the run's own config.yaml (the
    configuration it was started with, overrides included)."""
    if isinstance(args.resume, str):
        saved = Path(args.resume) / "config.yaml"
        if not saved.is_file():
            raise ConfigError(f"--resume {args.resume}: no run there ({saved} does not exist)")
        if args.config:
            raise ConfigError("--resume RUN_DIR reads the run's own config.yaml: leave --config out (or pass "
                              "--config with a bare --resume)")
        return saved
    if not args.config:
        raise ConfigError("--config FILE is required (or --resume RUN_DIR to continue a run)")
    return Path(args.config)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sharding.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    try:
        cfg = load_config(run_config(args), args.overrides)
        last = train(cfg, resume=bool(args.resume))
    except (ConfigError, checkpointing.CheckpointError, drafter_init.DrafterFitError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(last))
    return 0


if __name__ == "__main__":
    sys.exit(main())
