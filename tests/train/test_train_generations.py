"""Training the newer drafter generations: DFlash2 (the backbone loss plus the candidate selector's
teacher-forced K-way cross-entropy) and DSpark (DeepSpec's cross-entropy + L1 distance + confidence
BCE). Every term against a float64 numpy computation written here from the math; the batch losses
against the same from the drafter's hidden states; short runs on the fitted tiny target that lower
the loss, export to the official layout and reload with the same greedy traces."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import fitted_models
from support.devices import xla_flags
from dflash_jax import generate
from dflash_jax.drafters import dflash2, dspark, objective
from dflash_jax.drafters.config import DFlash2Config, DSparkConfig
from dflash_jax.drafters.drafter import Drafter, DrafterSpec
from dflash_jax.loading.drafter_io import load_drafter
from support.drafter_reference import random_drafter_params
from train import checkpointing, drafter_init, step as step_lib
from train.config import ConfigError, config_from_dict
from train.export import export
from train.train import drafter_config_for, step_spec, train

F64 = np.float64


def logsumexp(x, axis=-1):
    m = np.max(x, axis=axis, keepdims=True)
    return (m + np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)))[..., 0]


def softmax(x):
    return np.exp(x - logsumexp(x)[..., None])


# ---- each term against float64 numpy ------------------------------------------------------------------

def reference_selector_ce(p, hidden, logits, prev, labels, top_k):
    """Per position: candidates = the top K of the logits; a missing gold replaces the lowest;
    score = z[cand] + (P[prev] * (h W)) . S[cand]; -log softmax(score)[gold]."""
    out, contains = [], []
    for h, z, pr, y in zip(hidden, logits, prev, labels):
        cand = np.argsort(-z, kind="stable")[:top_k].copy()
        hit = y in cand
        if not hit:
            cand[-1] = y
        gold = int(np.flatnonzero(cand == y)[0])
        scores = z[cand] + (p["predecessor_codebook"][pr] * (h @ p["hidden_projection"]["kernel"])) @ \
            p["successor_codebook"][cand].T
        out.append(logsumexp(scores) - scores[gold])
        contains.append(hit)
    return np.asarray(out), np.asarray(contains)


def test_the_selector_cross_entropy_equals_the_float64_reference():
    rng = np.random.default_rng(0)
    m, v, d, r, k = 16, 20, 8, 3, 4
    p = {"predecessor_codebook": rng.standard_normal((v, r)), "successor_codebook": rng.standard_normal((v, r)),
         "hidden_projection": {"kernel": rng.standard_normal((d, r))}}
    hidden, logits = rng.standard_normal((m, d)), 2 * rng.standard_normal((m, v))
    prev = rng.integers(0, v, m)
    ranked = np.argsort(-logits, axis=-1)
    labels = np.where(np.arange(m) % 2 == 0, ranked[:, 1], ranked[:, k + 2])  # in the top K, and not
    labels[3] = ranked[3, k - 1]  # the lowest candidate itself
    want, hit = reference_selector_ce(p, hidden, logits, prev, labels, k)
    as32 = lambda x: jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), x)  # noqa: E731
    got, contains = dflash2.selector_cross_entropy(as32(p), as32(hidden), as32(logits), jnp.asarray(prev),
                                                   jnp.asarray(labels), k)
    np.testing.assert_array_equal(contains, hit)
    assert hit.sum() == 9 and (~hit).sum() == 7
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    candidates, index, _ = dflash2.training_candidates(jnp.asarray(logits), jnp.asarray(labels), k)
    np.testing.assert_array_equal(np.asarray(candidates)[np.arange(m), np.asarray(index)], labels)


@pytest.mark.parametrize("with_markov", [True, False])
def test_the_dspark_terms_equal_the_float64_reference(with_markov):
    rng = np.random.default_rng(1)
    m, v, d, r = 12, 24, 8, 4
    cfg = DSparkConfig(r, True, with_markov)
    p = {"markov_head": {"markov_w1": {"embedding": rng.standard_normal((v, r))},
                         "markov_w2": {"kernel": rng.standard_normal((r, v))}},
         "confidence_head": {"proj": {"kernel": rng.standard_normal((d + (r if with_markov else 0), 1)),
                                      "bias": rng.standard_normal((1,))}}}
    hidden, base, target_logits = rng.standard_normal((m, d)), rng.standard_normal((m, v)), rng.standard_normal((m, v))
    prev, labels = rng.integers(0, v, m), rng.integers(0, v, m)

    e = p["markov_head"]["markov_w1"]["embedding"][prev]
    logits = base + e @ p["markov_head"]["markov_w2"]["kernel"]
    features = np.concatenate([hidden, e], -1) if with_markov else hidden
    x = features @ p["confidence_head"]["proj"]["kernel"][:, 0] + p["confidence_head"]["proj"]["bias"][0]
    ce = logsumexp(logits) - logits[np.arange(m), labels]
    l1 = np.abs(softmax(logits) - softmax(target_logits)).sum(-1)
    c = np.clip(1 - 0.5 * l1, 0, 1)
    sig = 1 / (1 + np.exp(-x))
    bce = -(c * np.log(sig) + (1 - c) * np.log(1 - sig))

    as32 = lambda t: jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), t)  # noqa: E731
    got_logits, got_x = dspark.teacher_forced(cfg, as32(p), as32(hidden), as32(base), jnp.asarray(prev))
    got = dspark.loss_terms(got_logits, as32(target_logits), jnp.asarray(labels), got_x)
    for a, b in zip((got_logits, got_x, *got[:3]), (logits, x, ce, l1, bce)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[3], np.argmax(logits, -1) == labels)


def test_the_targets_of_proposals_and_the_predecessors_equal_a_loop():
    rng = np.random.default_rng(2)
    b, t, n, g, decay = 2, 14, 3, 4, 4.0
    tokens = rng.integers(0, 40, (b, t))
    loss_mask = np.ones((b, t), bool)
    loss_mask[:, :3] = False
    loss_mask[0, 9] = False  # a hole: the slots after it stop counting
    loss_mask[1, 12:] = False
    anchors, valid = np.asarray([[3, 6, 11], [4, 10, 0]]), np.asarray([[True, True, True], [True, True, False]])
    labels, previous, positions, weights = map(np.asarray, objective.proposal_targets(
        jnp.asarray(tokens), jnp.asarray(loss_mask), jnp.asarray(anchors), jnp.asarray(valid), g, decay))
    predecessors = np.asarray(objective.block_predecessors(jnp.asarray(tokens), jnp.asarray(anchors), g))
    for i in range(b):
        for j in range(n):
            a, alive = anchors[i, j], bool(valid[i, j])
            for s in range(g):
                alive = alive and a + s + 1 < t and bool(loss_mask[i, a + s + 1])
                assert weights[i, j, s] == pytest.approx(np.exp(-s / decay) if alive else 0.0)
                if a + s + 1 < t:
                    assert (labels[i, j, s], previous[i, j, s], positions[i, j, s]) == \
                        (tokens[i, a + s + 1], tokens[i, a + s], a + s)
                assert predecessors[i, j, s] == tokens[i, a + max(s - 1, 0)]
    assert weights[0, 1].tolist() == pytest.approx([1.0, np.exp(-1 / decay), 0.0, 0.0])  # 6+3 = 9 is the hole


# ---- the batch losses from the drafter's hidden states -----------------------------------------------

def _random_target():
    from dflash_jax.models.target import init_target_params, Target

    return Target(fitted_models.TARGET_CONFIG, init_target_params(fitted_models.TARGET_CONFIG, jax.random.PRNGKey(0)))


def _batch(block_size, num_anchors=3):
    rng = np.random.default_rng(3)
    tokens = fitted_models.pattern_batch(rng, 2, 16)
    loss_mask = np.ones(tokens.shape, bool)
    loss_mask[:, :4] = False
    loss_mask[1, 12:] = False
    batch = jax.tree.map(jnp.asarray, {"tokens": tokens, "loss_mask": loss_mask})
    anchors, valid = objective.sample_anchors(jax.random.PRNGKey(4), batch["loss_mask"], num_anchors)
    return {**batch, "anchors": anchors, "valid": valid}


def _as64(tree):
    return jax.tree.map(lambda a: np.asarray(a, F64), tree)


def test_the_dflash2_batch_loss_is_the_backbone_loss_plus_alpha_times_the_selector_term():
    target = _random_target()
    g, k = 4, 3
    config = dataclasses.replace(fitted_models.drafter_config(g), dflash2=DFlash2Config(2, 16, 5, k))
    params = random_drafter_params(config, seed=5)
    batch = _batch(g)
    spec = step_lib.StepSpec(num_anchors=3, decay=4.0, selector_alpha=0.7, logits_chunk=5)

    @jax.jit  # the batch loss and, for the reference, the drafter's hidden states: one compiled program
    def loss_and_hidden(params, target_params, batch):
        loss, _ = step_lib.batch_loss(target, config, spec, {"drafter": params}, {"target": target_params}, batch)
        _, features, _ = target.forward(target_params, batch["tokens"], capture=config.target_layer_ids)
        hidden = objective.drafter_block_hidden(DrafterSpec(config), target, params, target_params, features,
                                                batch["tokens"], batch["anchors"], batch["valid"])
        return loss, hidden, target.logits(target_params, hidden)

    loss, hidden, logits = loss_and_hidden(params, target.params, batch)
    logits = np.asarray(logits, F64)  # [B, N*G, V]
    hidden, tokens = np.asarray(hidden, F64), np.asarray(batch["tokens"])
    anchors, valid, mask = map(np.asarray, (batch["anchors"], batch["valid"], batch["loss_mask"]))
    sel = _as64(params["candidate_selector"])
    num = [0.0, 0.0]
    den = 0.0
    for i in range(2):
        for j in range(anchors.shape[1]):
            for s in range(1, g):
                a, at = anchors[i, j], j * g + s
                if not valid[i, j] or a + s >= tokens.shape[1] or not mask[i, a + s]:
                    continue
                w, y = np.exp(-(s - 1) / 4.0), tokens[i, a + s]
                num[0] += w * (logsumexp(logits[i, at]) - logits[i, at, y])
                num[1] += w * reference_selector_ce(sel, hidden[i, at][None], logits[i, at][None],
                                                    [tokens[i, a + s - 1]], [y], k)[0][0]
                den += w
    assert den > 0
    np.testing.assert_allclose(float(loss), (num[0] + 0.7 * num[1]) / den, rtol=1e-5)


@pytest.mark.parametrize("from_anchor", [True, False])
def test_the_dspark_batch_loss_equals_the_float64_reference(from_anchor):
    target = _random_target()
    g, r = 4, 6
    dc = DSparkConfig(r, True, True, sample_from_anchor=from_anchor)
    config = dataclasses.replace(fitted_models.drafter_config(g), dspark=dc)
    params = random_drafter_params(config, seed=6)
    batch = _batch(g)
    spec = step_lib.StepSpec(num_anchors=3, decay=4.0, ce_alpha=0.3, l1_alpha=0.5, confidence_alpha=0.2,
                             logits_chunk=7)

    @jax.jit  # the batch loss and, for the reference, the drafter's hidden states: one compiled program
    def loss_and_hidden(params, target_params, batch):
        loss, accuracy = step_lib.batch_loss(target, config, spec, {"drafter": params}, {"target": target_params},
                                             batch)
        target_hidden, features, _ = target.forward(target_params, batch["tokens"], capture=config.target_layer_ids)
        hidden = objective.drafter_block_hidden(DrafterSpec(config), target, params, target_params, features,
                                                batch["tokens"], batch["anchors"], batch["valid"],
                                                embed=lambda block: params["embed_tokens"]["embedding"][block])
        return loss, accuracy, hidden, target.logits(target_params, target_hidden)

    loss, accuracy, hidden, target_logits = loss_and_hidden(params, target.params, batch)
    assert accuracy.shape == (config.proposals,) == ((g,) if from_anchor else (g - 1,))
    target_logits = np.asarray(target_logits, F64)
    hidden, p = np.asarray(hidden, F64), _as64(params)
    tokens = np.asarray(batch["tokens"])
    anchors, valid, mask = map(np.asarray, (batch["anchors"], batch["valid"], batch["loss_mask"]))
    w1, w2 = p["markov_head"]["markov_w1"]["embedding"], p["markov_head"]["markov_w2"]["kernel"]
    proj = p["confidence_head"]["proj"]
    sums, den, t = np.zeros(3), 0.0, tokens.shape[1]
    for i in range(2):
        for j in range(anchors.shape[1]):
            a = anchors[i, j]
            for s in range(config.proposals):  # proposal s: slot s (+1 without sample_from_anchor)
                if not valid[i, j] or a + s + 1 >= t or not mask[i, a + s + 1]:
                    break
                h = hidden[i, j * g + s + (0 if from_anchor else 1)]
                e = w1[tokens[i, a + s]]
                z = h @ p["lm_head"]["kernel"] + e @ w2
                y, w = tokens[i, a + s + 1], np.exp(-s / 4.0)
                l1 = np.abs(softmax(z) - softmax(target_logits[i, a + s])).sum()
                c, x = np.clip(1 - l1 / 2, 0, 1), np.concatenate([h, e]) @ proj["kernel"][:, 0] + proj["bias"][0]
                bce = -(c * np.log(1 / (1 + np.exp(-x))) + (1 - c) * np.log(1 - 1 / (1 + np.exp(-x))))
                sums += w * np.asarray([logsumexp(z) - z[y], l1, bce])
                den += w
    assert den > 0
    np.testing.assert_allclose(float(loss), float(sums @ [0.3, 0.5, 0.2]) / den, rtol=1e-5)


# ---- runs on the fitted tiny target -------------------------------------------------------------------

STEPS = 60


@pytest.fixture(scope="module")
def data(tmp_path_factory, fitted_target):
    """(training JSONL of the fitted target's own continuations, held-out prompts)."""
    path = tmp_path_factory.mktemp("generations") / "train.jsonl"
    prompts = fitted_models.pattern_batch(np.random.default_rng(1), 72, 4).tolist()
    return path, fitted_models.write_self_continuations(fitted_target, path, prompts, 64, 28)


def settings(data, out_dir, generation, **run):
    own = {"dflash2": {"selector_rank": 8, "selector_top_k": 4}, "dspark": {"markov_rank": 8}}.get(generation, {})
    return {"model": {"target": "fitted", "num_layers": 1, "intermediate_size": 128, "block_size": 4,
                      "target_layer_ids": [0, 2], "mask_token_id": fitted_models.MASK, "generation": generation,
                      **own},
            "data": {"path": str(data[0]), "max_length": 32, "batch_size": 8, "seed": 3},
            "optim": {"learning_rate": 3e-3, "warmup_ratio": 0.05},
            "run": {"out_dir": str(out_dir), "steps": STEPS, "num_anchors": 8, "log_every": 1,
                    "checkpoint_every": STEPS, "async_checkpointing": False, **run}}


# on the newer-jax leg of `make test` only (`one_leg`): its parts run on both, a training run's export and
# resume (test_train_run.py), each generation's batch loss against float64 (above) and its greedy decoding
# (test_dflash2.py, test_dspark.py)
@pytest.mark.one_leg
@pytest.mark.parametrize("generation", ["dflash2", "dspark"])
def test_a_run_lowers_the_loss_and_its_export_reloads_with_the_same_greedy_traces(data, fitted_target, tmp_path,
                                                                                generation):
    target = fitted_target
    cfg = config_from_dict(settings(data, tmp_path / "run", generation))
    train(cfg, target=target)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == STEPS and np.all(np.isfinite(losses))
    assert np.mean(losses[-10:]) < 0.9 * np.mean(losses[:5]), losses
    terms = {"dflash2": {"selector_loss"}, "dspark": {"ce_loss", "l1_loss", "confidence_loss"}}[generation]
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert terms <= first.keys() and len(first["slot_accuracy"]) == 3 + (generation == "dspark")

    dcfg = drafter_config_for(cfg, target)
    assert (dcfg.dflash2 is not None, dcfg.dspark is not None) == (generation == "dflash2", generation == "dspark")
    _, params = checkpointing.restore_params(tmp_path / "run")
    if generation == "dspark":  # the drafter's own tables: the target's, untouched by training
        np.testing.assert_array_equal(params["drafter"]["embed_tokens"]["embedding"],
                                      target.params["embed_tokens"]["embedding"])
        np.testing.assert_array_equal(params["drafter"]["lm_head"]["kernel"],
                                      drafter_init.target_head_kernel(target, target.params))
    loaded = load_drafter(export(tmp_path / "run", tmp_path / "drafter", dtype="float32"), target=target)
    assert loaded.config == dcfg
    jax.tree.map(np.testing.assert_array_equal, loaded.params, params["drafter"])

    prompts = data[1]
    trained = generate(target, Drafter(dcfg, params["drafter"]), prompts, max_new_tokens=20, stop_token_ids=())
    reloaded = generate(target, loaded, prompts, max_new_tokens=20, stop_token_ids=())
    assert reloaded.tokens == trained.tokens
    assert reloaded.acceptance_lengths == trained.acceptance_lengths
    assert trained.tau > 1.0


@pytest.mark.slow  # three short runs: `make test-all`
def test_a_resumed_dspark_run_equals_an_uninterrupted_one(data, fitted_target, tmp_path):
    """The optimizer holds no state for the frozen tables; a checkpoint of that state restores."""
    target = fitted_target
    straight = config_from_dict(settings(data, tmp_path / "straight", "dspark", steps=4, checkpoint_every=4))
    train(straight, target=target)
    first = config_from_dict(settings(data, tmp_path / "resumed", "dspark", steps=2, checkpoint_every=2))
    train(first, target=target)
    train(dataclasses.replace(first, run=dataclasses.replace(first.run, steps=4, checkpoint_every=4)),
          resume=True, target=target)
    (step_a, a), (step_b, b) = (checkpointing.restore_params(tmp_path / n) for n in ("straight", "resumed"))
    assert step_a == step_b == 4
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_what_a_generation_cannot_train_with_fails_with_one_clear_error(data, fitted_target, tmp_path):
    base = lambda generation, *overrides: config_from_dict(  # noqa: E731
        settings(data, tmp_path / "x", generation), list(overrides))
    with pytest.raises(ConfigError, match="model.generation must be one of"):
        base("dflash3")
    with pytest.raises(ConfigError, match="draft_vocab_size: a dspark drafter drafts over the whole vocabulary"):
        base("dspark", "model.draft_vocab_size=16")
    with pytest.raises(ConfigError, match="run.labels must be 'tokens'"):
        base("dspark", "run.labels=target")
    with pytest.raises(ConfigError, match="confidence_head_with_markov needs a Markov head"):
        base("dspark", "model.markov_rank=0")
    with pytest.raises(ConfigError, match="model.markov_rank is a dspark drafter's field; model.generation is dflash2"):
        base("dflash2", "model.markov_rank=8")
    with pytest.raises(ConfigError, match="model.selector_top_k is a dflash2 drafter's field; model.generation is "
                                          "dflash$"):
        base("dflash", "model.selector_top_k=8")
    defaults = base("dflash2", "model.selector_rank=null", "model.selector_top_k=null").model
    assert [defaults.generation_field(n) for n in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                   "selector_top_k")] == [2, 16, 256, 16]
    with pytest.raises(ConfigError, match="run.selector_loss_alpha must be a finite number >= 0"):
        base("dflash2", "run.selector_loss_alpha=-1")
    with pytest.raises(ConfigError, match="run.l1_loss_alpha weighs a dspark drafter's loss; model.generation is "
                                          "dflash2"):
        base("dflash2", "run.l1_loss_alpha=0.5")
    dspark_run = base("dspark", "run.ce_loss_alpha=0.2")
    spec = step_spec(dspark_run, drafter_config_for(dspark_run, fitted_target))
    assert (spec.ce_alpha, spec.l1_alpha, spec.confidence_alpha, spec.decay) == (0.2, 0.9, 1.0, 4.0)
    assert step_spec(base("dflash2"), drafter_config_for(base("dflash2"), fitted_target)).selector_alpha == 1.0
    spec = step_lib.StepSpec(num_anchors=2, decay=4.0)
    config = dataclasses.replace(fitted_models.drafter_config(4), dspark=DSparkConfig(4, False))
    with pytest.raises(ValueError, match="DSpark drafter needs the target's whole distribution"):
        step_lib.batch_loss(fitted_target, config, spec, None, None, {"features": None})
    assert not (tmp_path / "x").exists()


def sharded_steps(out: str, data: int, fsdp: int) -> None:
    """Two train steps of a DFlash2 and a DSpark drafter (weight decay 0.1) on a fixed batch over a
    (data, fsdp) mesh, the target sharded too; saves each generation's losses and params to `out`."""
    import pickle

    from dflash_jax import sharding

    target = _random_target()
    tokens = fitted_models.pattern_batch(np.random.default_rng(0), 8, 24)
    loss_mask = np.arange(24)[None].repeat(8, 0) >= np.arange(8)[:, None] % 5
    mesh = sharding.make_mesh(data=data, fsdp=fsdp)
    found = {}
    for name, extra in (("dflash2", {"dflash2": DFlash2Config(2, 16, 8, 4)}),
                        ("dspark", {"dspark": DSparkConfig(8, True, True)})):
        config = dataclasses.replace(fitted_models.drafter_config(block_size=4), **extra)
        schedule = step_lib.learning_rate_schedule(1e-3, 10, 0.1)
        optimizer = step_lib.make_optimizer(schedule, weight_decay=0.1, frozen=step_lib.frozen_paths(config))
        spec = step_lib.StepSpec(num_anchors=6, decay=4.0, grad_accum=2)
        state = step_lib.init_state(drafter_init.initial_params(config, target, target.params, jax.random.PRNGKey(1)),
                                    optimizer, seed=3)
        state_shardings = sharding.fsdp_shardings(mesh, state)
        frozen_shardings = sharding.fsdp_shardings(mesh, {"target": target.params}, shard=True)
        state = jax.device_put(state, state_shardings)
        frozen = jax.device_put({"target": target.params}, frozen_shardings)
        step = jax.jit(step_lib.make_train_step(target, config, spec, optimizer, schedule),
                       in_shardings=(state_shardings, frozen_shardings, sharding.train_batch_sharding(mesh)),
                       out_shardings=(state_shardings, sharding.replicated(mesh)))
        losses, batch = [], {"tokens": tokens, "loss_mask": loss_mask}
        for _ in range(2):
            state, metrics = step(state, frozen, sharding.global_batch(mesh, batch))
            losses.append(float(metrics["loss"]))
        params = jax.jit(lambda p: p, out_shardings=sharding.replicated(mesh))(state.params)
        found[name] = (losses, jax.device_get(params))
    with open(out, "wb") as f:
        pickle.dump(found, f)


@pytest.mark.slow  # two subprocesses, one of 8 simulated devices: `make test-all`
def test_a_sharded_step_equals_one_device_and_keeps_the_frozen_tables(tmp_path):
    import os
    import pickle
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    runs = {}
    for devices, data, fsdp in ((1, 1, 1), (8, 4, 2)):
        env = {**os.environ, "XLA_FLAGS": xla_flags(devices),
               "JAX_PLATFORMS": "cpu",
               "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests"), str(Path(__file__).parent)])}
        out = tmp_path / f"{devices}.pkl"
        code = f"import test_train_generations as t; t.sharded_steps({str(out)!r}, {data}, {fsdp})"
        done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        runs[devices] = pickle.loads(out.read_bytes())
    target = _random_target()
    for name in ("dflash2", "dspark"):
        (losses_1, params_1), (losses_8, params_8) = runs[1][name], runs[8][name]
        np.testing.assert_allclose(losses_1, losses_8, rtol=2e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), params_1, params_8)
    tables = runs[8]["dspark"][1]["drafter"]
    np.testing.assert_array_equal(tables["embed_tokens"]["embedding"], target.params["embed_tokens"]["embedding"])
    np.testing.assert_array_equal(tables["lm_head"]["kernel"], drafter_init.target_head_kernel(target, target.params))
