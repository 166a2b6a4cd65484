"""The training objective: anchors, block targets and weights, chunked cross-entropy, soft labels."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dflash_jax.drafters.objective import (block_distributions, block_inputs, block_targets, chunked_cross_entropy,
                                  default_decay, draft_distributions, greedy_and_top_tokens, greedy_tokens,
                                  sample_anchors)


def test_anchor_candidates_are_distinct_sorted_and_inside_the_mask():
    draw = jax.jit(sample_anchors, static_argnums=2)  # compiled once a shape (as a train step runs it), not op by op
    mask = np.zeros((3, 20), bool)
    mask[0, 5:15] = True  # candidates 5..13
    mask[1, [2, 3, 10]] = True  # candidate 2 only
    anchors, valid = draw(jax.random.PRNGKey(0), jnp.asarray(mask), 4)
    anchors, valid = np.asarray(anchors), np.asarray(valid)
    assert valid[0].all() and len(set(anchors[0])) == 4 and (np.diff(anchors[0]) > 0).all()
    assert all(mask[0, a] and mask[0, a + 1] for a in anchors[0])
    assert valid[1].tolist() == [True, False, False, False] and anchors[1, 0] == 2
    assert not valid[2].any()
    # Fresh draws differ; over many draws every candidate appears (uniform over candidates).
    seen = set()
    for seed in range(30):
        a, _ = draw(jax.random.PRNGKey(seed), jnp.asarray(mask[:1]), 2)
        seen.update(np.asarray(a)[0].tolist())
    assert seen == set(range(5, 14))


def test_block_targets_labels_weights_and_padding():
    tokens = jnp.arange(10)[None] + 100
    loss_mask = jnp.asarray([[0, 0, 1, 1, 1, 1, 1, 0, 1, 1]], bool)
    anchors = jnp.asarray([[2, 8, 0]])
    valid = jnp.asarray([[True, True, False]])
    # each compiled once (as a train step runs them), not op by op
    labels, weights = jax.jit(block_targets, static_argnums=(4, 5))(tokens, loss_mask, anchors, valid, 4, 2.0)
    assert np.asarray(labels)[0, 0].tolist() == [102, 103, 104, 105]
    w = np.asarray(weights)[0]
    np.testing.assert_allclose(w[0], [0, 1, np.exp(-0.5), np.exp(-1.0)], rtol=1e-6)
    np.testing.assert_allclose(w[1], [0, 1, 0, 0])  # labels past the end get weight 0
    np.testing.assert_allclose(w[2], 0)  # padding block
    assert np.asarray(jax.jit(block_inputs, static_argnums=(2, 3))(tokens, anchors, 4, 7))[0, :4].tolist() == \
        [102, 7, 7, 7]
    assert default_decay(16) == 7 and default_decay(10) == 5 and default_decay(8) == 4


def test_target_labels_follow_the_targets_greedy_chain():
    # text 100..109; the target would emit text[p + 1] after p, except after 4 (it says 7) and 7 (says 3).
    tokens = jnp.arange(10)[None] + 100
    next_tokens = np.append(np.arange(101, 110), 0)[None].copy()
    next_tokens[0, 4], next_tokens[0, 7] = 7, 3
    loss_mask = jnp.ones((1, 10), bool)
    anchors, valid = jnp.asarray([[2, 4, 6]]), jnp.asarray([[True, True, True]])
    labels, weights = block_targets(tokens, loss_mask, anchors, valid, 4, 2.0, jnp.asarray(next_tokens))
    labels, w = np.asarray(labels)[0], np.asarray(weights)[0] > 0
    # anchor 2: the text follows the target at 3, 4 but not at 5: slots 1, 2 count, slot 3's label
    # (the target after text 104) is 7, and it counts since slots 1, 2 agreed with the text.
    assert labels[0, 1:].tolist() == [103, 104, 7] and w[0].tolist() == [False, True, True, True]
    # anchor 4: slot 1's label is the target's 7 (the text says 105): slot 2 onward is a different
    # context from the target's chain, so it does not count.
    assert labels[1, 1].item() == 7 and w[1].tolist() == [False, True, False, False]
    # anchor 6: slot 1 (text 107 agrees), slot 2's label is the target's 3, slot 3 does not count.
    assert labels[2, 1:3].tolist() == [107, 3] and w[2].tolist() == [False, True, True, False]
    # Without next tokens, the labels are the text's.
    text_labels, _ = block_targets(tokens, loss_mask, anchors, valid, 4, 2.0)
    assert np.asarray(text_labels)[0, 1, 1:].tolist() == [105, 106, 107]


def test_greedy_tokens_in_chunks_equal_the_dense_argmax():
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.normal(size=(8, 50)).astype(np.float32))
    hidden = jnp.asarray(rng.normal(size=(2, 13, 8)).astype(np.float32))
    np.testing.assert_array_equal(greedy_tokens(lambda h: h @ w, hidden, chunk=4), jnp.argmax(hidden @ w, -1))


def test_chunked_cross_entropy_equals_dense_with_gradients():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(8, 50)).astype(np.float32))
    hidden = jnp.asarray(rng.normal(size=(2, 13, 8)).astype(np.float32))
    labels = jnp.asarray(rng.integers(0, 50, size=(2, 13)))

    def dense(h):
        return optax.softmax_cross_entropy_with_integer_labels(h @ w, labels)

    # the values and the gradients as a train step takes them: one compiled program, not op by op
    @jax.jit
    def both(h):
        ce, correct = chunked_cross_entropy(lambda x: x @ w, h, labels, chunk=4)
        g1 = jax.grad(lambda h: chunked_cross_entropy(lambda x: x @ w, h, labels, 4)[0].sum())(h)
        g2 = jax.grad(lambda h: dense(h).sum())(h)
        return ce, correct, dense(h), jnp.argmax(h @ w, -1) == labels, g1, g2

    ce, correct, want, want_correct, g1, g2 = both(hidden)
    np.testing.assert_allclose(ce, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(correct, want_correct)
    np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-6)


def test_greedy_and_top_tokens_in_chunks_equal_the_dense_ones():
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.normal(size=(8, 50)).astype(np.float32))
    hidden = jnp.asarray(rng.normal(size=(2, 13, 8)).astype(np.float32))
    greedy, ids, values = greedy_and_top_tokens(lambda h: h @ w, hidden, 5, chunk=4)
    want_values, want_ids = jax.lax.top_k(hidden @ w, 5)
    np.testing.assert_array_equal(greedy, jnp.argmax(hidden @ w, -1))
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(values, want_values)
    assert ids.dtype == jnp.int32 and values.shape == (2, 13, 5)
    np.testing.assert_array_equal(ids[..., 0], greedy)


def test_soft_cross_entropy_equals_dense_with_gradients():
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.normal(size=(8, 50)).astype(np.float32))
    hidden = jnp.asarray(rng.normal(size=(2, 13, 8)).astype(np.float32))
    labels = jnp.asarray(rng.integers(0, 50, size=(2, 13)))
    ids = jnp.asarray(rng.integers(0, 50, size=(2, 13, 4)))
    probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(2, 13, 4)).astype(np.float32)), -1)
    probs = probs.at[1, 3].set(0.0)  # a position that does not count

    def dense(h):
        log_p = jax.nn.log_softmax(h @ w, -1)
        return -jnp.sum(probs * jnp.take_along_axis(log_p, ids, -1), -1)

    point = (labels[..., None], jnp.ones(labels.shape + (1,), jnp.float32))

    # the values and the gradients as a train step takes them: one compiled program, not op by op
    @jax.jit
    def both(h):
        ce, correct = chunked_cross_entropy(lambda x: x @ w, h, labels, 4, soft=(ids, probs))
        g1 = jax.grad(lambda h: chunked_cross_entropy(lambda x: x @ w, h, labels, 4, soft=(ids, probs))[0].sum())(h)
        g2 = jax.grad(lambda h: dense(h).sum())(h)
        on_point = chunked_cross_entropy(lambda x: x @ w, h, labels, 4, soft=point)[0]
        hard = chunked_cross_entropy(lambda x: x @ w, h, labels, 4)[0]
        return ce, correct, dense(h), jnp.argmax(h @ w, -1) == labels, g1, g2, on_point, hard

    ce, correct, want, want_correct, g1, g2, on_point, hard = both(hidden)
    np.testing.assert_allclose(ce, want, rtol=1e-5, atol=1e-6)
    assert float(ce[1, 3]) == 0.0
    np.testing.assert_array_equal(correct, want_correct)  # against the hard labels
    np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-6)
    # A point mass on the label is the hard cross-entropy, bit for bit.
    np.testing.assert_array_equal(on_point, hard)


def test_block_distributions_read_the_position_before_each_slot():
    t = 10
    positions = np.arange(t)[None, :, None]
    top_ids = jnp.asarray(positions + np.asarray([100, 200, 300]))  # [1, T, 3]
    top_logits = jnp.asarray(positions + np.asarray([2.0, 1.0, 0.0]), jnp.float32)
    anchors = jnp.asarray([[2, 5]])
    distributions = jax.jit(block_distributions, static_argnums=(3, 4))  # compiled, not op by op
    ids, probs = distributions(top_ids, top_logits, anchors, 3)
    assert ids.shape == (1, 2, 3, 3)
    # slot k of the block at anchor a learns what the target said after position a + k - 1
    assert np.asarray(ids)[0, 0, 1].tolist() == [102, 202, 302] and np.asarray(ids)[0, 1, 2].tolist() == [106, 206, 306]
    softmax = lambda x: np.exp(x - np.max(x)) / np.sum(np.exp(x - np.max(x)))  # noqa: E731
    np.testing.assert_allclose(np.asarray(probs)[0, 1, 2], softmax(np.asarray([2.0, 1.0, 0.0])), rtol=1e-6)
    ids2, probs2 = distributions(top_ids, top_logits, anchors, 3, 2)
    assert np.asarray(ids2)[0, 0, 1].tolist() == [102, 202]
    np.testing.assert_allclose(np.asarray(probs2)[0, 0, 1], softmax(np.asarray([2.0, 1.0])), rtol=1e-6)


def test_draft_distributions_drop_ids_outside_the_draft_vocabulary():
    target_to_draft = jnp.asarray([-1, 0, -1, 1, 2], jnp.int32)  # target ids 1, 3, 4 are draft ids 0, 1, 2
    ids = jnp.asarray([[[[1, 2, 3]], [[0, 2, 0]]]])  # [B=1, N=2, G=1, K=3]
    probs = jnp.asarray([[[[0.5, 0.3, 0.2]], [[0.6, 0.3, 0.1]]]])
    weights = jnp.asarray([[[1.0], [1.0]]])
    draft_ids, draft_probs, draft_weights = draft_distributions(ids, probs, weights, target_to_draft)
    assert np.asarray(draft_ids)[0, 0, 0, [0, 2]].tolist() == [0, 1]
    np.testing.assert_allclose(draft_probs[0, 0, 0], [0.5 / 0.7, 0.0, 0.2 / 0.7], rtol=1e-6)
    # no candidate has a draft id: the slot weighs nothing
    assert np.asarray(draft_weights).tolist() == [[[1.0], [0.0]]]
