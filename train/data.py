"""Training batches for drafter training: tokenize with the target's chat template, mask the
assistant tokens, bucket by length, and serve static-shape batches through a grain pipeline.

Pipeline (all index based, so the iterator state is one integer and restores exactly):

    records (tokenized once, in memory; or a feature cache's memmaps)
    -> epoch plan: per (seed, epoch), records shuffled inside their length bucket, cut into global
       batches of cfg.batch_size, and the batches shuffled (a bucket's remainder sits out that epoch)
    -> grain.MapDataset over global batch indices (epoch = index // batches_per_epoch)
    -> per-process rows: process p takes rows [p * b, (p + 1) * b) of each global batch, so every
       process sees the same bucket T at every step and the processes' rows are disjoint
    -> padded numpy arrays -> to_iter_dataset (thread prefetch).

Put the iterator into an Orbax checkpoint with `grain.checkpoint.CheckpointSave(iterator)` /
`CheckpointRestore(iterator)` (one JSON file per process), or save `iterator.get_state()` yourself.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import grain
import jax
import numpy as np
from tqdm.auto import tqdm

from train.sources import read_records

META = "meta.json"


@dataclasses.dataclass(frozen=True)
class DataConfig:
    path: str | tuple[str, ...]     # regenerated JSONL dir/file, pre-tokenized JSONL, a feature-cache dir,
                                    # or a list of feature-cache dirs read as one corpus
    max_length: int = 2048          # truncate longer sequences
    batch_size: int = 8             # GLOBAL batch size (per process: batch_size // process_count)
    buckets: tuple[int, ...] = ()   # padded sequence lengths; () -> (max_length,)
    seed: int = 0                   # shuffle seed (reshuffled every epoch: seed, epoch)
    num_epochs: int | None = None   # None = repeat forever
    prefetch: int = 2
    min_loss_tokens: int = 2        # records with fewer assistant tokens are dropped

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.path,) if isinstance(self.path, str) else self.path

    def __post_init__(self):
        if not isinstance(self.path, str):
            object.__setattr__(self, "path", tuple(str(p) for p in self.path))
            if not self.path:
                raise ValueError("data.path is an empty list")
        object.__setattr__(self, "buckets", tuple(sorted(int(b) for b in self.buckets)) or (self.max_length,))
        if self.max_length < 2 or self.batch_size < 1 or self.prefetch < 0:
            raise ValueError(f"need max_length >= 2, batch_size >= 1, prefetch >= 0; got {self}")
        if self.buckets[-1] < self.max_length:
            raise ValueError(f"the largest bucket ({self.buckets[-1]}) must be >= max_length ({self.max_length})")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None, got {self.num_epochs}")


# ----------------------------------------------------------------------------------------------
# tokenization


def _render(tokenizer, messages, generation_prompt: bool) -> np.ndarray:
    ids = tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                        tokenize=True, add_generation_prompt=generation_prompt, return_dict=False)
    return np.asarray(ids, np.int32).reshape(-1)


def tokenize_conversation(tokenizer, messages, max_length) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32 [T], loss_mask bool [T]) with the target's chat template; mask = assistant tokens.

    An assistant turn's span is found by rendering the conversation prefix by prefix: the tokens
    after `messages[:i]` + generation prompt, up to `messages[:i + 1]`. Inside it, tokens after the
    last end-of-turn token (`tokenizer.eos_token_id`, e.g. ChatML's newline after <|im_end|>) are
    not the model's output and stay False; a turn marked "truncated" (it hit the generation cap)
    also leaves its end-of-turn token False. Leading assistant turns (before any user turn) are
    dropped. T = min(len, max_length).
    """
    messages = messages[next((i for i, m in enumerate(messages) if m["role"] != "assistant"), len(messages)):]
    tokens = _render(tokenizer, messages, False) if messages else np.zeros((0,), np.int32)
    mask = np.zeros(tokens.shape, bool)
    stop = getattr(tokenizer, "eos_token_id", None)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head, upto = _render(tokenizer, messages[:i], True), _render(tokenizer, messages[: i + 1], False)
        if not (np.array_equal(tokens[: len(upto)], upto) and np.array_equal(upto[: len(head)], head)):
            raise ValueError("the chat template does not render conversation prefixes as prefixes of the "
                             f"whole conversation (assistant turn {i}); cannot locate assistant tokens")
        end = len(upto)
        stops = np.flatnonzero(upto[len(head):] == stop) if stop is not None else []
        if len(stops):
            end = len(head) + stops[-1] + (0 if message.get("truncated") else 1)
        mask[len(head):end] = True
    return tokens[:max_length], mask[:max_length]


# ----------------------------------------------------------------------------------------------
# record stores: in-memory token records, or a feature cache on disk


@dataclasses.dataclass(frozen=True, eq=False)
class TokenRecords:
    """Variable-length records: tokens / loss_mask [N_tok] concatenated, offsets [N + 1]."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int, max_length: int) -> dict:
        lo, hi = self.offsets[i], min(self.offsets[i + 1], self.offsets[i] + max_length)
        return {"tokens": self.tokens[lo:hi], "loss_mask": self.loss_mask[lo:hi]}


def pack_records(rows: list[tuple[np.ndarray, np.ndarray]]) -> TokenRecords:
    offsets = np.zeros(len(rows) + 1, np.int64)
    offsets[1:] = np.cumsum([len(t) for t, _ in rows])
    cat = lambda i, dtype: np.concatenate([r[i] for r in rows]).astype(dtype) if rows else np.zeros(0, dtype)
    return TokenRecords(cat(0, np.int32), cat(1, bool), offsets)


def load_token_records(path, tokenizer, max_length: int, min_loss_tokens: int = 1, *,
                       progress: bool | None = None) -> TokenRecords:
    """Chat or pre-tokenized JSONL (see `train.sources`) -> TokenRecords, truncated to max_length,
    records with fewer than min_loss_tokens assistant tokens dropped. Raises ValueError naming the
    path when nothing usable is left."""
    rows, read = [], 0
    bar = tqdm(read_records(path), desc="tokenizing", unit="rec", disable=None if progress is None else not progress)
    for record in bar:
        read += 1
        if "tokens" in record:
            tokens = np.asarray(record["tokens"], np.int32)[:max_length]
            mask = np.asarray(record["loss_mask"], bool)[:max_length]
        elif tokenizer is None:
            raise ValueError(f"{path} holds chat records; tokenizing them needs the target's tokenizer")
        else:
            tokens, mask = tokenize_conversation(tokenizer, record["messages"], max_length)
        if mask.sum() >= min_loss_tokens:
            rows.append((tokens, mask))
    if read == 0:
        raise ValueError(f"no records in {path}")
    if not rows:
        raise ValueError(f"none of the {read} records in {path} has >= {min_loss_tokens} assistant "
                         f"(loss) tokens within max_length {max_length}: no assistant turns?")
    return pack_records(rows)


@dataclasses.dataclass(frozen=True, eq=False)
class FeatureRecords:
    """A feature cache written by `train.cache_features`: per shard TokenRecords + features memmap."""

    shards: tuple[TokenRecords, ...]
    features: tuple[np.ndarray, ...]   # bfloat16 [N_tok, n * D] per shard (memory-mapped)
    meta: dict
    next_tokens: tuple[np.ndarray, ...] = ()   # int32 [N_tok] per shard: the target's greedy next token
    top_ids: tuple[np.ndarray, ...] = ()       # int32 [N_tok, K] per shard: its K likeliest next tokens
    top_logits: tuple[np.ndarray, ...] = ()    # float32 [N_tok, K] per shard: their logits

    @functools.cached_property
    def _index(self) -> np.ndarray:   # [N, 2]: (shard, record within shard)
        return np.concatenate([np.stack([np.full(len(s), k), np.arange(len(s))], 1)
                               for k, s in enumerate(self.shards)]).astype(np.int64)

    @property
    def lengths(self) -> np.ndarray:
        return np.concatenate([s.lengths for s in self.shards])

    def __len__(self) -> int:
        return len(self._index)

    def row(self, i: int, max_length: int) -> dict:
        k, j = self._index[i]
        shard = self.shards[k]
        out = shard.row(j, max_length)
        lo = shard.offsets[j]
        out["features"] = self.features[k][lo:lo + len(out["tokens"])]
        for key in ("next_tokens", "top_ids", "top_logits"):
            if getattr(self, key):
                out[key] = getattr(self, key)[k][lo:lo + len(out["tokens"])]
        return out


def is_feature_cache(path) -> bool:
    return (Path(path) / META).is_file()


def is_offline(cfg: DataConfig) -> bool:
    """Whether cfg.path names feature caches (offline mode); several paths must all be caches."""
    caches = [is_feature_cache(p) for p in cfg.paths]
    if len(caches) > 1 and not all(caches):
        raise ValueError(f"several data paths must all be feature caches (written by train.cache_features); "
                         f"{[p for p, c in zip(cfg.paths, caches) if not c]} are not")
    return caches[0]


def _cache_metas(paths) -> list[tuple[Path, dict]]:
    """(directory, meta.json) of one feature cache or of each of several: every one complete, and
    all agreeing on the layers, width and dtype of their features."""
    paths = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    metas = []
    for path in paths:
        if not is_feature_cache(path):
            raise FileNotFoundError(f"{path} is not a feature cache (no {META}; write one with train.cache_features)")
        meta = json.loads((path / META).read_text())
        if not meta.get("complete"):
            raise ValueError(f"feature cache {path} is incomplete "
                             "(rerun `python -m train.cache_features` to finish it)")
        for key in ("target_layer_ids", "hidden_size", "feature_dtype"):
            if metas and meta.get(key) != metas[0][1].get(key):
                raise ValueError(f"feature caches {paths[0]} and {path} differ in {key}: "
                                 f"{metas[0][1].get(key)} against {meta.get(key)}")
        metas.append((path, meta))
    return metas


def _combined_meta(metas: list[tuple[Path, dict]]) -> dict:
    """One cache's meta as it is; several read as one corpus: next tokens when every cache has
    them, the smallest top-k of them."""
    if len(metas) == 1:
        return metas[0][1]
    first = metas[0][1]
    return {**{k: first[k] for k in ("target_layer_ids", "hidden_size", "feature_dtype")},
            "next_tokens": all(m.get("next_tokens") for _, m in metas),
            "top_k": min(m.get("top_k", 0) for _, m in metas),
            "num_records": sum(m.get("num_records", 0) for _, m in metas),
            "num_tokens": sum(m.get("num_tokens", 0) for _, m in metas),
            "caches": [str(p) for p, _ in metas], "complete": True}


def load_feature_cache(paths) -> FeatureRecords:
    """One feature cache (a directory), or several read as one corpus (a list of directories)."""
    import ml_dtypes

    metas = _cache_metas(paths)
    meta = _combined_meta(metas)
    top_k = meta.get("top_k", 0)
    shards, features, next_tokens, top_ids, top_logits = [], [], [], [], []
    for path, own in metas:
        for name in own["shards"]:
            d = path / name
            load = lambda f: np.load(d / f, mmap_mode="r")
            shards.append(TokenRecords(load("tokens.npy"), load("loss_mask.npy"), np.load(d / "offsets.npy")))
            features.append(load("features.npy").view(ml_dtypes.bfloat16))
            if meta.get("next_tokens"):  # caches written before next tokens were stored have none
                next_tokens.append(load("next_tokens.npy"))
            if top_k:  # only caches written with --top-k > 0 have these (sorted, likeliest first)
                top_ids.append(load("top_ids.npy")[:, :top_k])
                top_logits.append(load("top_logits.npy")[:, :top_k])
    if sum(len(s) for s in shards) == 0:
        raise ValueError(f"feature cache {', '.join(str(p) for p, _ in metas)} holds no records")
    return FeatureRecords(tuple(shards), tuple(features), meta, tuple(next_tokens), tuple(top_ids),
                          tuple(top_logits))


def load_records(cfg: DataConfig, tokenizer=None):
    if is_offline(cfg):
        return load_feature_cache(cfg.paths)
    return load_token_records(cfg.path, tokenizer, cfg.max_length, cfg.min_loss_tokens)


def count_tokens(cfg: DataConfig, tokenizer, vocab_size, *, records=None) -> np.ndarray:
    """int64 [vocab_size]: how often each token id is a loss-masked (assistant) token in the data
    (`records` from `load_records` skips loading them again)."""
    records = load_records(cfg, tokenizer) if records is None else records
    shards = records.shards if isinstance(records, FeatureRecords) else (records,)
    counts = np.zeros(vocab_size, np.int64)
    for s in shards:
        lengths = np.minimum(s.lengths, cfg.max_length)
        keep = np.concatenate([np.arange(lo, lo + n) for lo, n in zip(s.offsets[:-1], lengths)]).astype(np.int64)
        ids = np.asarray(s.tokens)[keep][np.asarray(s.loss_mask)[keep]]
        counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


# ----------------------------------------------------------------------------------------------
# batching


def bucket_of(lengths: np.ndarray, buckets: tuple[int, ...]) -> np.ndarray:
    """Index of the smallest bucket that holds each length (lengths already <= buckets[-1])."""
    return np.searchsorted(np.asarray(buckets), lengths, side="left")


@dataclasses.dataclass(frozen=True, eq=False)
class EpochPlan:
    """Which records form each global batch, reshuffled per epoch from (seed, epoch)."""

    bucket: np.ndarray          # int [N]: bucket index per record
    buckets: tuple[int, ...]
    batch_size: int
    seed: int

    @functools.cached_property
    def batches_per_epoch(self) -> int:
        return int(sum(np.sum(self.bucket == k) // self.batch_size for k in range(len(self.buckets))))

    @functools.lru_cache(maxsize=2)
    def epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows int [num_batches, batch_size] record ids, T int [num_batches])."""
        rng = np.random.default_rng([self.seed, epoch])
        rows, lengths = [], []
        for k, t in enumerate(self.buckets):
            members = rng.permutation(np.flatnonzero(self.bucket == k))
            full = len(members) // self.batch_size * self.batch_size
            rows.append(members[:full].reshape(-1, self.batch_size))
            lengths.append(np.full(full // self.batch_size, t))
        rows, lengths = np.concatenate(rows), np.concatenate(lengths)
        order = rng.permutation(len(rows))
        return rows[order], lengths[order]


def _assemble(records, plan: EpochPlan, max_length: int, first_row: int, per_process: int,
              index: int) -> dict:
    """Global batch `index` -> this process's padded arrays (see make_iterator for the layout)."""
    rows, lengths = plan.epoch(index // plan.batches_per_epoch)
    j = index % plan.batches_per_epoch
    t = int(lengths[j])
    parts = [records.row(int(r), max_length) for r in rows[j, first_row:first_row + per_process]]
    out = {"tokens": np.zeros((per_process, t), np.int32), "loss_mask": np.zeros((per_process, t), bool),
           "lengths": np.asarray([len(p["tokens"]) for p in parts], np.int32)}
    if "features" in parts[0]:
        out["features"] = np.zeros((per_process, t, parts[0]["features"].shape[-1]), parts[0]["features"].dtype)
    for key in ("next_tokens", "top_ids", "top_logits"):
        if key in parts[0]:
            out[key] = np.zeros((per_process, t, *parts[0][key].shape[1:]), parts[0][key].dtype)
    for b, part in enumerate(parts):
        for key, value in part.items():
            out[key][b, : len(value)] = value
    return out


def make_iterator(cfg: DataConfig, tokenizer=None, *, process_index=None, process_count=None,
                  records=None):
    """A grain DatasetIterator (get_state() / set_state(state)) yielding dicts:
       tokens    int32 [B, T]  (padded with 0)
       loss_mask bool  [B, T]  (True on assistant tokens; False on padding)
       lengths   int32 [B]     (real tokens per row)
       features  bfloat16 [B, T, n*D]  only when cfg.path is a feature cache (offline mode)
       next_tokens int32 [B, T]  the target's greedy next token after each position (a feature
                 cache that stores them; `run.labels: target`)
       top_ids int32 [B, T, K], top_logits float32 [B, T, K]  the target's K likeliest next tokens
                 and their logits (a cache written with --top-k K; `run.labels: distribution`)
    B = cfg.batch_size // process_count; T in cfg.buckets. tokenizer is needed only for chat
    records; `records` (from `load_records`) skips loading them again.
    """
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if cfg.batch_size % process_count:
        raise ValueError(f"batch_size {cfg.batch_size} is not divisible by the {process_count} processes")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    records = load_records(cfg, tokenizer) if records is None else records
    lengths = np.minimum(records.lengths, cfg.max_length)
    plan = EpochPlan(bucket_of(lengths, cfg.buckets), cfg.buckets, cfg.batch_size, cfg.seed)
    if plan.batches_per_epoch == 0:
        raise ValueError(f"{cfg.path}: no length bucket of {cfg.buckets} holds batch_size={cfg.batch_size} "
                         f"records ({len(records)} records); lower batch_size or merge buckets")
    per_process = cfg.batch_size // process_count
    ds = grain.MapDataset.range(plan.batches_per_epoch)
    ds = ds.repeat(cfg.num_epochs)
    ds = ds.map_with_index(lambda i, _: _assemble(records, plan, cfg.max_length, process_index * per_process,
                                                  per_process, i))
    options = grain.ReadOptions(num_threads=min(cfg.prefetch, 1), prefetch_buffer_size=cfg.prefetch)
    return iter(ds.to_iter_dataset(options))
