"""Reduced draft vocabulary: built from token counts, EAGLE-3 d2t/t2d convention, save/load."""
import numpy as np
import pytest

from dflash_jax.drafters.draft_vocab import build_draft_vocab, DraftVocab


def test_build_keeps_the_most_frequent_ids_and_the_forced_ones():
    counts = np.array([0, 50, 3, 3, 40, 0, 7, 1])
    vocab = build_draft_vocab(counts, 4, always_include=(5,))
    # 5 is forced; then 1 (50), 4 (40), 6 (7); ascending target ids.
    assert vocab.draft_to_target.tolist() == [1, 4, 5, 6] and vocab.draft_to_target.dtype == np.int32
    tie = build_draft_vocab(counts, 4)
    assert tie.draft_to_target.tolist() == [1, 2, 4, 6]   # the 3-3 tie goes to the lower id
    assert vocab.coverage(counts) == pytest.approx((50 + 40 + 0 + 7) / counts.sum())
    t2d = vocab.target_to_draft()
    assert t2d.tolist() == [-1, 0, -1, -1, 1, 2, 3, -1]
    assert np.array_equal(t2d[vocab.draft_to_target], np.arange(4))
    with pytest.raises(ValueError, match="size"):
        build_draft_vocab(counts, 9)
    with pytest.raises(ValueError, match="always_include"):
        build_draft_vocab(counts, 2, always_include=(0, 5, 7))


def test_eagle3_round_trip_and_convention():
    vocab = DraftVocab(np.array([0, 3, 4, 9]), 12)
    tables = vocab.to_eagle3()
    assert tables["d2t"].dtype == np.int64 and tables["t2d"].dtype == bool
    assert tables["d2t"].tolist() == [0, 2, 2, 6]   # target_id = draft_id + d2t[draft_id]
    assert np.flatnonzero(tables["t2d"]).tolist() == [0, 3, 4, 9] and tables["t2d"].shape == (12,)
    back = DraftVocab.from_eagle3(**tables)
    assert np.array_equal(back.draft_to_target, vocab.draft_to_target) and back.target_vocab_size == 12
    broken = dict(tables, t2d=np.roll(tables["t2d"], 1))
    with pytest.raises(ValueError, match="disagree"):
        DraftVocab.from_eagle3(**broken)
    with pytest.raises(ValueError, match="ascending"):
        DraftVocab(np.array([3, 1]), 12)


def test_save_load(tmp_path):
    vocab = build_draft_vocab(np.random.default_rng(0).integers(0, 100, 300), 64, always_include=(2,))
    vocab.save(tmp_path / "vocab.npz")
    loaded = DraftVocab.load(tmp_path / "vocab.npz")
    assert np.array_equal(loaded.draft_to_target, vocab.draft_to_target) and loaded.target_vocab_size == 300
    assert 2 in loaded.draft_to_target
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="not a draft vocabulary"):
        DraftVocab.load(tmp_path / "other.npz")
