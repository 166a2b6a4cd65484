"""A reduced draft vocabulary: the drafter predicts only the Vd most frequent target tokens.

The target still verifies over its full vocabulary, so output stays exactly the target's; a draft id
maps back to a target id through `draft_to_target`. Saved and exported in EAGLE-3's convention, as
vLLM and SpecForge read it: `d2t` int64 [Vd] with target_id = draft_id + d2t[draft_id], and `t2d`
bool [V] marking the target ids that the draft vocabulary holds.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class DraftVocab:
    draft_to_target: np.ndarray    # int32 [Vd], ascending target ids
    target_vocab_size: int

    def __post_init__(self):
        ids = np.asarray(self.draft_to_target)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"draft_to_target must be a non-empty 1-D array, got shape {ids.shape}")
        if np.any(np.diff(ids) <= 0) or ids[0] < 0 or ids[-1] >= self.target_vocab_size:
            raise ValueError(f"draft_to_target must be strictly ascending ids in [0, {self.target_vocab_size})")
        object.__setattr__(self, "draft_to_target", ids.astype(np.int32))

    @property
    def size(self) -> int:
        return len(self.draft_to_target)

    def target_to_draft(self) -> np.ndarray:
        """int32 [V]: the draft id of each target id, -1 where the draft vocabulary lacks it."""
        out = np.full(self.target_vocab_size, -1, np.int32)
        out[self.draft_to_target] = np.arange(self.size, dtype=np.int32)
        return out

    def to_eagle3(self) -> dict[str, np.ndarray]:
        """{"d2t": int64 [Vd] = target_id - draft_id, "t2d": bool [V]}."""
        t2d = np.zeros(self.target_vocab_size, bool)
        t2d[self.draft_to_target] = True
        return {"d2t": self.draft_to_target.astype(np.int64) - np.arange(self.size, dtype=np.int64), "t2d": t2d}

    @classmethod
    def from_eagle3(cls, d2t, t2d) -> "DraftVocab":
        d2t, t2d = np.asarray(d2t, np.int64), np.asarray(t2d, bool)
        ids = d2t + np.arange(len(d2t), dtype=np.int64)
        if not np.array_equal(np.flatnonzero(t2d), ids):
            raise ValueError("d2t and t2d disagree: t2d must be True exactly at target ids draft_id + d2t[draft_id]")
        return cls(ids, len(t2d))

    def save(self, path) -> None:
        """One .npz holding d2t and t2d."""
        np.savez(Path(path), **self.to_eagle3())

    @classmethod
    def load(cls, path) -> "DraftVocab":
        with np.load(Path(path)) as f:
            if "d2t" not in f or "t2d" not in f:
                raise ValueError(f"{path} is not a draft vocabulary (needs arrays d2t and t2d)")
            return cls.from_eagle3(f["d2t"], f["t2d"])

    def coverage(self, token_counts: np.ndarray) -> float:
        """Fraction of the counted tokens that the draft vocabulary holds."""
        counts = np.asarray(token_counts, np.int64)
        return float(counts[self.draft_to_target].sum() / max(counts.sum(), 1))


def build_draft_vocab(token_counts: np.ndarray, size: int, always_include=()) -> DraftVocab:
    """The `size` most frequent ids of token_counts (int [V]; ties broken by lower id), always
    including `always_include` (e.g. the end-of-turn and mask ids)."""
    counts = np.asarray(token_counts, np.int64)
    forced = np.unique(np.asarray(always_include, np.int64))
    if not 0 < size <= len(counts):
        raise ValueError(f"draft vocabulary size must lie in [1, {len(counts)}], got {size}")
    if len(forced) > size or (forced.size and (forced.min() < 0 or forced.max() >= len(counts))):
        raise ValueError(f"always_include {forced.tolist()} must be at most {size} ids in [0, {len(counts)})")
    score = counts.astype(np.float64)
    score[forced] = np.inf
    order = np.lexsort((np.arange(len(counts)), -score))   # by score descending, then id ascending
    return DraftVocab(np.sort(order[:size]), len(counts))
