"""Offline mode: run the frozen target once over the tokenized training data and store the selected
layers' features, so that drafter training never reruns the target.

    python -m train.cache_features --data runs/data/smollm2-sharegpt --out runs/features/smollm2 --num-draft-layers 3

Layout of OUT (read by `train.data` when DataConfig.path names it, alone or in a list of caches):
    meta.json                 {"target_layer_ids", "hidden_size", "feature_dtype": "bfloat16",
                               "num_records", "num_tokens", "shards": [...], "complete", ...}
    shard-00000/tokens.npy    int32 [N_tok]        the shard's records concatenated
    shard-00000/loss_mask.npy bool  [N_tok]
    shard-00000/features.npy  bfloat16 bits as uint16 [N_tok, len(layers) * D]
    shard-00000/next_tokens.npy int32 [N_tok]      the target's greedy (argmax) next token after each
                                                   position: labels for `run.labels: target`
    shard-00000/top_ids.npy   int32 [N_tok, K]     with --top-k K > 0 (meta "top_k"): the ids and
    shard-00000/top_logits.npy float32 [N_tok, K]  logits of the target's K likeliest next tokens,
                                                   largest first: `run.labels: distribution`
    shard-00000/offsets.npy   int64 [N + 1]        record i = [offsets[i], offsets[i + 1])
Each shard directory appears complete or not at all (written under a temporary name, then renamed);
a rerun skips the shards meta.json lists.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from dflash_jax.decode.loop import cache_tile
from dflash_jax.drafters.objective import greedy_and_top_tokens, greedy_tokens
from dflash_jax.kernels import round_up
from train.data import META, TokenRecords, bucket_of, load_token_records
from train.regenerate import write_atomic


@dataclasses.dataclass
class CacheStats:
    records: int = 0
    tokens: int = 0            # tokens run through the target in this call (skipped shards excluded)
    bytes: int = 0
    shards_skipped: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


LOGITS_ROWS = 256  # rows (batch x positions) of logits formed at a time for the greedy next tokens


def _feature_fn(target, layer_ids: tuple[int, ...], logits_rows: int = LOGITS_ROWS, top_k: int = 0):
    """tokens [B, T] -> (features bfloat16 [B, T, n*D], greedy next tokens int32 [B, T]), and with
    top_k > 0 the top_k likeliest next tokens' ids int32 and logits float32 [B, T, top_k].

    The target runs as `generate`'s prefill does (`Target.prefill`: 256 tokens at a time through
    a cache, the attention reading only the filled slots, with the CPU kernels where they apply)
    rather than one causal pass over all T, and the logits are formed about logits_rows rows at a
    time (B x chunk x V, not B x T x V). The next tokens are the same as one pass's, and it is
    faster: one causal pass with 512-position logit chunks writes a [B x 512, V] block of logits
    to memory and reads it back per chunk (the figures: docs/performance.md, "Why the code is
    shaped this way (measured)")."""
    def features(params, tokens):
        b, t = tokens.shape
        cache = target.init_cache(b, round_up(t, cache_tile()))
        hidden, feats, _ = target.prefill(params, tokens, cache, capture=layer_ids)
        head, chunk = (lambda h: target.logits(params, h)), max(1, logits_rows // b)
        if top_k:
            return (feats.astype(jnp.bfloat16), *greedy_and_top_tokens(head, hidden, top_k, chunk))
        return feats.astype(jnp.bfloat16), greedy_tokens(head, hidden, chunk)
    return jax.jit(features)


def _write_shard(directory: Path, records: TokenRecords, lo: int, hi: int, run, batch_size: int,
                 buckets: tuple[int, ...], width: int, top_k: int, bar) -> int:
    """Records [lo, hi) -> a complete shard directory; returns bytes written."""
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    offsets = records.offsets[lo:hi + 1] - records.offsets[lo]
    span = slice(records.offsets[lo], records.offsets[hi])
    np.save(tmp / "tokens.npy", records.tokens[span])
    np.save(tmp / "loss_mask.npy", records.loss_mask[span])
    np.save(tmp / "offsets.npy", offsets)
    feats = np.lib.format.open_memmap(tmp / "features.npy", mode="w+", dtype=np.uint16,
                                      shape=(int(offsets[-1]), width))
    next_tokens = np.zeros(int(offsets[-1]), np.int32)
    top_ids = np.zeros((int(offsets[-1]), top_k), np.int32)
    top_logits = np.zeros((int(offsets[-1]), top_k), np.float32)
    lengths = np.diff(offsets)
    order = np.argsort(lengths, kind="stable")
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        t = buckets[bucket_of(lengths[rows].max(keepdims=True), buckets)[0]]
        tokens = np.zeros((batch_size, t), np.int32)   # a static batch: the last one is padded with rows of 0
        for b, r in enumerate(rows):
            tokens[b, : lengths[r]] = records.tokens[span][offsets[r]:offsets[r + 1]]
        out, predicted, *top = jax.device_get(run(tokens))
        out = np.asarray(out).view(np.uint16)
        for b, r in enumerate(rows):
            span_r = slice(offsets[r], offsets[r + 1])
            feats[span_r] = out[b, : lengths[r]]
            next_tokens[span_r] = predicted[b, : lengths[r]]
            if top_k:
                top_ids[span_r], top_logits[span_r] = top[0][b, : lengths[r]], top[1][b, : lengths[r]]
        bar.update(int(lengths[rows].sum()))
    feats.flush()
    del feats
    np.save(tmp / "next_tokens.npy", next_tokens)
    if top_k:
        np.save(tmp / "top_ids.npy", top_ids)
        np.save(tmp / "top_logits.npy", top_logits)
    size = sum(f.stat().st_size for f in tmp.iterdir())
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return size


def cache_features(target, records: TokenRecords, out_dir, layer_ids, *, batch_size: int = 8,
                   buckets: tuple[int, ...] = (256, 512, 1024, 2048), shard_records: int = 256,
                   source: str = "", top_k: int = 0, progress: bool | None = None) -> CacheStats:
    """Run `target` over `records` and store its features at `layer_ids`, its greedy next tokens
    and, with top_k > 0, its top_k likeliest next tokens (see the module docstring).
    Resumes from out_dir/meta.json when it was written with the same settings."""
    out_dir = Path(out_dir)
    layer_ids = tuple(int(i) for i in layer_ids)
    buckets = tuple(sorted(buckets))
    if top_k < 0 or top_k > target.config.vocab_size:
        raise ValueError(f"top_k {top_k} is not in [0, vocab size {target.config.vocab_size}]")
    if int(records.lengths.max()) > buckets[-1]:
        raise ValueError(f"records up to {int(records.lengths.max())} tokens do not fit the largest "
                         f"bucket {buckets[-1]}")
    settings = {"target_layer_ids": list(layer_ids), "hidden_size": target.config.hidden_size,
                "feature_dtype": "bfloat16", "next_tokens": True, "num_records": len(records),
                "num_tokens": int(records.offsets[-1]), "shard_records": shard_records, "source": source}
    if top_k:  # only then, so that caches written before top-k tokens were stored still resume
        settings["top_k"] = top_k
    meta_file = out_dir / META
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {**settings, "shards": []}
    if {k: meta.get(k) for k in settings} != settings:
        raise ValueError(f"{meta_file} was written with other settings; use a new --out directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    run = lambda tokens, fn=_feature_fn(target, layer_ids, top_k=top_k): fn(target.params, jnp.asarray(tokens))
    width = len(layer_ids) * target.config.hidden_size
    stats = CacheStats()
    bounds = [(lo, min(lo + shard_records, len(records))) for lo in range(0, len(records), shard_records)]
    done_tokens = sum(int(records.offsets[hi] - records.offsets[lo]) for k, (lo, hi) in enumerate(bounds)
                      if f"shard-{k:05d}" in meta["shards"])
    start = time.perf_counter()
    with tqdm(total=int(records.offsets[-1]), initial=done_tokens, unit="tok", unit_scale=True,
              desc="caching features", disable=None if progress is None else not progress) as bar:
        for k, (lo, hi) in enumerate(bounds):
            name = f"shard-{k:05d}"
            if name in meta["shards"] and (out_dir / name).is_dir():
                stats.shards_skipped += 1
                continue
            stats.bytes += _write_shard(out_dir / name, records, lo, hi, run, batch_size, buckets, width, top_k, bar)
            stats.records += hi - lo
            stats.tokens += int(records.offsets[hi] - records.offsets[lo])
            meta["shards"] = sorted({*meta["shards"], name})
            meta["complete"] = len(meta["shards"]) == len(bounds)
            write_atomic(meta_file, json.dumps(meta, indent=1))
    stats.seconds = time.perf_counter() - start
    return stats


def resolve_layer_ids(num_target_layers: int, layers: str | None, num_draft_layers: int,
                      drafter: str | None) -> tuple[int, ...]:
    """--layers "1,14,27", else a drafter config.json's target_layer_ids, else the official rule."""
    if layers:
        return tuple(int(x) for x in layers.split(","))
    if drafter:
        from dflash_jax.drafters.config import DrafterConfig
        from dflash_jax.models.config import read_config_json

        return DrafterConfig.from_hf_config(read_config_json(Path(drafter))).target_layer_ids
    from dflash_jax.drafters.config import default_target_layer_ids

    return default_target_layer_ids(num_target_layers, num_draft_layers)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.cache_features", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="regenerated chat JSONL dir/file or pre-tokenized JSONL")
    p.add_argument("--out", required=True, help="feature cache directory")
    p.add_argument("--target", help="HF model directory or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="target compute dtype")
    p.add_argument("--layers", help="comma-separated target layer ids to capture (overrides the next two)")
    p.add_argument("--drafter", help="a drafter directory whose config.json gives target_layer_ids")
    p.add_argument("--num-draft-layers", type=int, default=5, help="for the official layer-selection rule")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--min-loss-tokens", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--buckets", default="256,512,1024,2048", help="comma-separated padded lengths")
    p.add_argument("--shard-records", type=int, default=256, help="records per shard")
    p.add_argument("--top-k", type=int, default=8,
                   help="also store the target's K likeliest next tokens and their logits (64 bytes per "
                        "token at 8), for run.labels=distribution; 0 = only the greedy next token")
    args = p.parse_args(argv)
    try:
        from dflash_jax._resources import smollm2_gguf_path
        from dflash_jax.loading.target_loader import load_target

        buckets = tuple(int(b) for b in args.buckets.split(","))
        target = load_target(args.target or smollm2_gguf_path(), args.dtype)
        records = load_token_records(args.data, target.tokenizer, min(args.max_length, max(buckets)),
                                     args.min_loss_tokens)
        layer_ids = resolve_layer_ids(target.config.num_layers, args.layers, args.num_draft_layers, args.drafter)
        stats = cache_features(target, records, args.out, layer_ids, batch_size=args.batch_size, buckets=buckets,
                               shard_records=args.shard_records, source=str(Path(args.data).resolve()),
                               top_k=args.top_k)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    per_token = stats.bytes / max(stats.tokens, 1)
    print(f"cached {stats.records} records, {stats.tokens} tokens of layers {list(layer_ids)} into {args.out} in "
          f"{stats.seconds:.1f} s = {stats.tokens_per_second:.1f} tokens/s, {per_token:.0f} bytes/token "
          f"({stats.shards_skipped} shards already done)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
