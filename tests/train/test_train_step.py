"""The drafter train step: online vs offline features, target and soft labels, reduced-vocabulary
loss, warm start, gradient accumulation."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import fitted_models
from dflash_jax.backends.cpu.layout import pack_layers
from dflash_jax.drafters import objective
from dflash_jax.drafters.drafter import DrafterSpec
from dflash_jax.models.target import init_target_params, Target
from train import drafter_init, step as step_lib

NUM_ANCHORS = 6


@pytest.fixture(scope="module")
def setup():
    target = Target(fitted_models.TARGET_CONFIG,
                    init_target_params(fitted_models.TARGET_CONFIG, jax.random.PRNGKey(0)))
    config = fitted_models.drafter_config(block_size=4)
    params = drafter_init.initial_params(config, target, target.params, jax.random.PRNGKey(1))
    rng = np.random.default_rng(0)
    tokens = fitted_models.pattern_batch(rng, 4, 24)
    loss_mask = np.ones(tokens.shape, bool)
    loss_mask[:, :5] = False  # a prompt
    loss_mask[1, 18:] = False  # a shorter row (padding)
    batch = {"tokens": tokens, "loss_mask": loss_mask, "lengths": np.asarray([24, 18, 24, 24], np.int32)}
    return target, config, params, batch


_STEPS = {}  # one jitted step per (target, config, spec): a setting the module uses again is traced once


def run_step(target, config, params, batch, frozen_extra=None, **spec_kwargs):
    spec = step_lib.StepSpec(num_anchors=NUM_ANCHORS, decay=4.0, **spec_kwargs)
    schedule = step_lib.learning_rate_schedule(1e-3, 10, 0.1)
    optimizer = step_lib.make_optimizer(schedule)
    state = step_lib.init_state(params, optimizer, seed=3)
    frozen = {"target": target.params, **(frozen_extra or {})}
    key = (id(target), config, spec)
    if key not in _STEPS:
        _STEPS[key] = (target, jax.jit(step_lib.make_train_step(target, config, spec, optimizer, schedule)))
    batch = jax.tree.map(jnp.asarray, batch)
    return _STEPS[key][1](state, frozen, batch)


_LOSSES = {}  # one jitted loss per (target, config, spec), as _STEPS


def run_loss(target, config, params, batch, frozen_extra=None, **spec_kwargs):
    """(loss, slot accuracy [G-1]) as run_step's step reports them (`step_lib.batch_loss` at the anchors its
    first step draws: init_state's key of seed 3 folded with step 0), without the step's gradients and update:
    a compiled forward, about a third of a step's compile. For checks that compare losses, not updates."""
    spec = step_lib.StepSpec(num_anchors=NUM_ANCHORS, decay=4.0, **spec_kwargs)
    key = (id(target), config, spec)
    if key not in _LOSSES:
        def loss(params, frozen, batch):
            anchors, valid = objective.sample_anchors(jax.random.fold_in(jax.random.PRNGKey(3), 0),
                                                      batch["loss_mask"], NUM_ANCHORS)
            value, slots = step_lib.batch_loss(target, config, spec, params, frozen,
                                               {**batch, "anchors": anchors, "valid": valid})
            return {"loss": value, "slot_accuracy": slots[1:]}

        _LOSSES[key] = (target, jax.jit(loss))
    frozen = {"target": target.params, **(frozen_extra or {})}
    return _LOSSES[key][1](params, frozen, jax.tree.map(jnp.asarray, batch))


def test_online_and_offline_features_give_the_same_step(setup):
    target, config, params, batch = setup
    features = step_lib.target_features(target, target.params, jnp.asarray(batch["tokens"]), config.target_layer_ids)
    online_state, online = run_step(target, config, params, batch)
    offline_state, offline = run_step(target, config, params, {**batch, "features": np.asarray(features)})
    np.testing.assert_allclose(online["loss"], offline["loss"], rtol=1e-6)
    assert float(online["loss"]) > 0 and online["slot_accuracy"].shape == (config.block_size - 1,)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 online_state.params, offline_state.params)
    assert int(online_state.step) == 1


def test_target_labels_online_equal_cached_next_tokens(setup):
    target, config, params, batch = setup
    tokens = jnp.asarray(batch["tokens"])
    features, next_tokens = step_lib.target_features(target, target.params, tokens, config.target_layer_ids,
                                                     next_tokens=True, logits_chunk=5)
    hidden, _, _ = target.forward(target.params, tokens)
    np.testing.assert_array_equal(next_tokens, jnp.argmax(target.logits(target.params, hidden), -1))
    # the losses a step reports (run_loss: what is compared is the loss, not an update; a step's online and
    # offline updates are compared in the test above and the next)
    online = run_loss(target, config, params, batch, target_labels=True)
    offline = run_loss(target, config, params, {**batch, "features": np.asarray(features),
                                                "next_tokens": np.asarray(next_tokens)}, target_labels=True)
    np.testing.assert_allclose(online["loss"], offline["loss"], rtol=1e-6)
    # A random target's greedy choices are not the text: the labels (and so the loss) differ.
    text = run_loss(target, config, params, batch)
    assert abs(float(online["loss"]) - float(text["loss"])) > 1e-3
    with pytest.raises(ValueError, match="next_tokens"):
        run_loss(target, config, params, {**batch, "features": np.asarray(features)}, target_labels=True)


def test_soft_labels_online_equal_offline_and_their_top_1_is_the_target_labels(setup):
    target, config, params, batch = setup
    tokens = jnp.asarray(batch["tokens"])
    features, next_tokens, top_ids, top_logits = step_lib.target_features(
        target, target.params, tokens, config.target_layer_ids, next_tokens=True, top_k=3, logits_chunk=5)
    np.testing.assert_array_equal(top_ids[..., 0], next_tokens)
    cached = {**batch, "features": np.asarray(features), "next_tokens": np.asarray(next_tokens),
              "top_ids": np.asarray(top_ids), "top_logits": np.asarray(top_logits)}
    online_state, online = run_step(target, config, params, batch, target_labels=True, label_top_k=3)
    offline_state, offline = run_step(target, config, params, cached, target_labels=True, label_top_k=3)
    np.testing.assert_allclose(online["loss"], offline["loss"], rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 online_state.params, offline_state.params)
    # The target-label loss on the cache without its top-k (the batch test_target_labels' offline loss
    # reads: the same program, so no new compile; at the anchors of the step above): the top-k is what
    # changes the loss.
    hard_cached = {key: cached[key] for key in ("tokens", "loss_mask", "lengths", "features", "next_tokens")}
    hard = run_loss(target, config, params, hard_cached, target_labels=True)
    assert abs(float(offline["loss"]) - float(hard["loss"])) > 1e-3  # a distribution is another loss
    np.testing.assert_array_equal(offline["slot_accuracy"], hard["slot_accuracy"])  # scored on the same labels
    # The top 1 is a point mass on the greedy label: the target-label loss, with the full head and
    # with a reduced draft vocabulary (where top-1 labels outside it weigh 0 as hard labels do). The
    # losses a step reports, without the steps' gradients (run_loss).
    top1 = run_loss(target, config, params, cached, target_labels=True, label_top_k=1)
    np.testing.assert_allclose(top1["loss"], hard["loss"], rtol=1e-6)
    keep = np.asarray([0, 2, 3, 5, 8, 13, 21, 34], np.int32)
    target_to_draft = np.full((config.vocab_size,), -1, np.int32)
    target_to_draft[keep] = np.arange(len(keep))
    reduced = drafter_init.initial_params(config, target, target.params, jax.random.PRNGKey(1), draft_to_target=keep)
    extra = {"target_to_draft": jnp.asarray(target_to_draft)}
    top1 = run_loss(target, config, reduced, cached, extra, target_labels=True, label_top_k=1)
    hard = run_loss(target, config, reduced, cached, extra, target_labels=True)
    np.testing.assert_allclose(top1["loss"], hard["loss"], rtol=1e-6)
    np.testing.assert_array_equal(top1["slot_accuracy"], hard["slot_accuracy"])
    with pytest.raises(ValueError, match="--top-k 3"):
        run_step(target, config, params, {**cached, "top_ids": np.asarray(top_ids)[..., :2]},
                 target_labels=True, label_top_k=3)
    with pytest.raises(ValueError, match="label_top_k"):
        step_lib.StepSpec(num_anchors=NUM_ANCHORS, decay=4.0, label_top_k=2)


def test_gradient_accumulation_equals_one_big_batch(setup):
    target, config, params, batch = setup
    full = {**batch, "loss_mask": np.ones_like(batch["loss_mask"])}  # equal weight sums per micro-batch
    one_state, one = run_step(target, config, params, full)
    two_state, two = run_step(target, config, params, full, grad_accum=2)
    np.testing.assert_allclose(one["loss"], two["loss"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 one_state.params, two_state.params)


def test_reduced_vocabulary_loss_equals_a_hand_computed_reference(setup):
    target, config, params, batch = setup
    keep = np.asarray([0, 2, 3, 5, 8, 13, 21, 34], np.int32)  # draft id -> target id
    target_to_draft = np.full((config.vocab_size,), -1, np.int32)
    target_to_draft[keep] = np.arange(len(keep))
    params = drafter_init.initial_params(config, target, target.params, jax.random.PRNGKey(1),
                                         draft_to_target=keep)
    head = np.asarray(params["draft_head"])
    np.testing.assert_array_equal(head, np.asarray(target.params["lm_head"]["kernel"])[:, keep])
    tokens, mask = jnp.asarray(batch["tokens"]), jnp.asarray(batch["loss_mask"])
    spec = step_lib.StepSpec(num_anchors=NUM_ANCHORS, decay=2.0)
    frozen = {"target": target.params, "target_to_draft": jnp.asarray(target_to_draft)}

    @jax.jit  # one compiled program (as a train step runs these), not op by op
    def loss_and_hidden(params, frozen, tokens, mask):
        anchors, valid = objective.sample_anchors(jax.random.PRNGKey(5), mask, NUM_ANCHORS)
        features = step_lib.target_features(target, frozen["target"], tokens, config.target_layer_ids)
        micro = {"tokens": tokens, "loss_mask": mask, "features": features, "anchors": anchors, "valid": valid}
        loss, slots = step_lib.batch_loss(target, config, spec, params, frozen, micro)
        hidden = objective.drafter_block_hidden(DrafterSpec(config), target, params["drafter"], frozen["target"],
                                                features, tokens, anchors, valid)
        return loss, slots, hidden, anchors, valid

    loss, slots, hidden, anchors, valid = loss_and_hidden(params, frozen, tokens, mask)
    logits = np.asarray(hidden, np.float64) @ head.astype(np.float64)  # [B, N*G, Vd]
    tokens, mask, anchors, valid = map(np.asarray, (tokens, mask, anchors, valid))
    g, total, weight_sum = config.block_size, 0.0, 0.0
    hits, counts = np.zeros(g), np.zeros(g)
    for b in range(tokens.shape[0]):
        for j in range(NUM_ANCHORS):
            for k in range(1, g):
                pos = anchors[b, j] + k
                if not valid[b, j] or pos >= tokens.shape[1] or not mask[b, pos]:
                    continue
                row = logits[b, j * g + k]
                counts[k] += 1
                draft_id = target_to_draft[tokens[b, pos]]
                if draft_id < 0:
                    continue  # weight 0, and counts as a miss
                w = np.exp(-(k - 1) / 2.0)
                log_z = np.log(np.sum(np.exp(row - row.max()))) + row.max()
                total += w * (log_z - row[draft_id])
                weight_sum += w
                hits[k] += row.argmax() == draft_id
    assert weight_sum > 0 and counts[1:].min() > 0 and (target_to_draft[tokens] < 0).any()
    np.testing.assert_allclose(float(loss), total / weight_sum, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(slots)[1:], hits[1:] / counts[1:], rtol=1e-6)


def test_warm_start_copies_the_targets_top_layers():
    llama = dataclasses.replace(fitted_models.TARGET_CONFIG, arch="llama", qk_norm=False, num_layers=4,
                                layer_types=())
    # random values in the shapes init_target_params gives (what is checked is which of them are copied where:
    # jax.eval_shape compiles nothing, the init itself would compile a program for this config alone)
    rng = np.random.default_rng(2)
    target = Target(llama, jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype),
                                        jax.eval_shape(lambda: init_target_params(llama, jax.random.PRNGKey(2)))))
    config = dataclasses.replace(fitted_models.drafter_config(), num_layers=2, num_target_layers=4,
                                 layer_types=())
    params = drafter_init.initial_params(config, target, target.params, jax.random.PRNGKey(1), warm=True,
                                         fc_init="last_feature")["drafter"]
    src, dst = target.params["layers"], params["layers"]
    for path in (("self_attn", "q_proj", "kernel"), ("self_attn", "o_proj", "kernel"), ("mlp", "down_proj", "kernel"),
                 ("input_layernorm", "scale"), ("post_attention_layernorm", "scale")):
        get = lambda tree: tree[path[0]][path[1]] if len(path) == 2 else tree[path[0]][path[1]][path[2]]
        np.testing.assert_array_equal(get(dst), get(src)[2:4])
    np.testing.assert_array_equal(params["layers"]["self_attn"]["q_norm"]["scale"], 1.0)  # llama has none
    np.testing.assert_array_equal(params["norm"]["scale"], target.params["norm"]["scale"])
    d = config.hidden_size
    kernel = np.asarray(params["fc"]["kernel"])
    np.testing.assert_array_equal(kernel[d:], np.eye(d))
    np.testing.assert_array_equal(kernel[:d], 0)
    narrow = dataclasses.replace(config, intermediate_size=32)
    with pytest.raises(drafter_init.DrafterFitError, match="intermediate_size"):
        drafter_init.initial_params(narrow, target, target.params, jax.random.PRNGKey(1), warm=True)
    bottom = drafter_init.initial_params(config, target, target.params, jax.random.PRNGKey(1), warm=True,
                                         warm_layers=(0, 3))["drafter"]["layers"]
    np.testing.assert_array_equal(bottom["mlp"]["up_proj"]["kernel"],
                                  np.asarray(src["mlp"]["up_proj"]["kernel"])[[0, 3]])
    with pytest.raises(drafter_init.DrafterFitError, match="cannot copy target layers"):
        drafter_init.initial_params(config, target, target.params, jax.random.PRNGKey(1), warm=True,
                                    warm_layers=(0, 4))
    with pytest.raises(drafter_init.DrafterFitError, match="layout=\"stacked\""):  # a CPU load's default
        drafter_init.initial_params(config, target, pack_layers(target.params), jax.random.PRNGKey(1),
                                    warm=True)


def test_attending_in_anchor_groups_gives_the_same_hidden_states(setup):
    target, config, params, batch = setup
    tokens, mask = jnp.asarray(batch["tokens"]), jnp.asarray(batch["loss_mask"])
    anchors, valid = objective.sample_anchors(jax.random.PRNGKey(7), mask, NUM_ANCHORS)
    features = step_lib.target_features(target, target.params, tokens, config.target_layer_ids)
    run = jax.jit(lambda chunk: objective.drafter_block_hidden(
        DrafterSpec(config), target, params["drafter"], target.params, features, tokens, anchors, valid, chunk),
        static_argnums=0)
    np.testing.assert_allclose(run(2), run(0), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of anchor_chunk"):
        run(4)
