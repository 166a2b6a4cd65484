"""What the command-line programs share: path checks, model loading, prompt encoding, incremental
detokenization, streaming an answer to stdout, result statistics, the output comparison and the
CLI runner (`run_cli`: a CLIError becomes one `error:` line and exit code 2) and the fast exit of a
finished program (`exit_process`)."""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from pathlib import Path
from typing import NoReturn, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here ever reaches a model hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from dflash_jax.models.cache import KV_CACHE_DTYPE_NAMES  # noqa: E402  (the package is imported already)
from dflash_jax.drafters.drafter import DECODE_WEIGHTS  # noqa: E402
from dflash_jax.backends import ACTIVATIONS  # noqa: E402
from dflash_jax.engine.text import IncrementalDetokenizer  # noqa: E402  (the CLIs' streamed text)

EXIT_ERROR = 2
REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout, for an editable or in-repo run
SHIPPED_DRAFTER_DIR = REPO_ROOT / "checkpoints" / "smollm2-dflash"
DTYPE_CHOICES = ("float32", "bfloat16")
# The CLIs' drafting defaults with the shipped SmolLM2 drafter (0 with any other drafter) unless
# --lookup / --min-draft-probability say otherwise. Both made that drafter's decoding faster on
# MT-Bench with the same outputs, and 0.3 was the fastest of the thresholds tried; a stronger
# drafter may gain nothing from either (docs/performance.md, "The speed knobs and what they
# measured").
SHIPPED_DRAFTER_LOOKUP = 3
SHIPPED_DRAFTER_MIN_DRAFT_PROBABILITY = 0.3
# drafter weights ("stored" with any other drafter): Q8_0 blocks of the shipped drafter's bfloat16
# weights stream fewer bytes per cycle, and their drafts are accepted about as often, so its cycles
# get cheaper with the same outputs (docs/performance.md, "Q8_0 drafter weights").
SHIPPED_DRAFTER_WEIGHTS = "q8_0"


class CLIError(Exception):
    """A user-facing problem: printed as one `error:` line, exit code 2."""


def notice(message: str) -> None:
    print(f"note: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------- paths


def shipped_drafter_dir() -> Path | None:
    """The DFlash drafter for the embedded SmolLM2 target, when the repository ships one."""
    return SHIPPED_DRAFTER_DIR if (SHIPPED_DRAFTER_DIR / "config.json").is_file() else None


def add_target_flags(parser) -> None:
    """--kv-cache-dtype and --decode-activations (what `load_models` passes to `load_target`)."""
    parser.add_argument("--kv-cache-dtype", choices=("auto", *KV_CACHE_DTYPE_NAMES), default="auto",
                        help="what the target's KV cache stores: auto = --dtype (default); float16 under "
                             "float32 halves the cache and the bytes a decode step reads from it, at "
                             "float16's precision for keys and values (plain and speculative decoding "
                             "still agree exactly)")
    add_decode_activations_flag(parser)


def add_decode_activations_flag(parser) -> None:
    """--decode-activations (what `load_models` passes to `load_target`)."""
    parser.add_argument("--decode-activations", choices=ACTIVATIONS, default="float32",
                        help="how a CPU multiplies a GGUF target's Q4_1 weights: float32 (default) the "
                             "activations as they are; int8 rounds each row of them to 8 bits per block "
                             "of 32, as llama.cpp does: decoding 15-28%% faster here, a verify of 2 tokens "
                             "about as fast as one, but the logits change slightly and near-ties can "
                             "flip, so the output is that model's (exactly, also when drafting), not the "
                             "float32 one's")


def add_drafting_flags(parser) -> None:
    """--lookup, --min-draft-probability, --draft-context and --confidence-threshold (what
    `drafting_kwargs` passes to `generate`) and
    --drafter-weights (what `load_models` passes to `load_drafter`)."""
    parser.add_argument("--lookup", type=int, metavar="N",
                        help="where the row's last 2..N tokens occurred earlier in its prompt or answer, "
                             "draft the tokens that followed them instead of the drafter's (lossless; "
                             f"0 = off; default: {SHIPPED_DRAFTER_LOOKUP} with the shipped SmolLM2 "
                             "drafter, 0 with any other)")
    parser.add_argument("--min-draft-probability", type=float, metavar="P",
                        help="verify a cycle's drafts only when the drafter gave its first draft at least "
                             "probability P (a looked-up draft counts as 1), else decode that cycle's "
                             "token alone, as a plain autoregressive step (lossless; 0 = always verify; "
                             f"default: {SHIPPED_DRAFTER_MIN_DRAFT_PROBABILITY} with the shipped SmolLM2 "
                             "drafter, 0 with any other)")
    parser.add_argument("--draft-context", type=int, default=0, metavar="N",
                        help="the drafter sees only each row's last N positions, its context cache a ring "
                             "buffer of N slots: bounded memory and drafting cost for long contexts "
                             "(lossless; 0 = the whole context, the default)")
    parser.add_argument("--confidence-threshold", type=float, default=0.0, metavar="C",
                        help="with a DSpark drafter that has a confidence head: each cycle verifies the drafts "
                             "up to the first whose predicted confidence is below C (lossless; 0 = verify "
                             "them all, the default)")
    parser.add_argument("--drafter-weights", choices=DECODE_WEIGHTS,
                        help="the drafter weights a CPU drafts with: 'stored' as loaded (bfloat16 panels for a "
                             "bfloat16 checkpoint), 'q8_0' 8 bits and a scale per 32 weights, fewer bytes "
                             "to read every cycle (the drafts may differ slightly; the output does not: "
                             f"lossless; default: {SHIPPED_DRAFTER_WEIGHTS} with the shipped SmolLM2 "
                             "drafter, stored with any other)")


def check_drafting_flags(parser, args) -> None:
    if args.lookup is not None and (args.lookup < 0 or args.lookup == 1):
        parser.error("--lookup must be 0 (off) or >= 2 (the longest run of tokens to match)")
    if args.min_draft_probability is not None and not 0 <= args.min_draft_probability <= 1:
        parser.error("--min-draft-probability must be in [0, 1] (0 = always verify the drafts)")
    if args.draft_context < 0:
        parser.error("--draft-context must be >= 0 (0 = the whole context)")
    if not 0 <= getattr(args, "confidence_threshold", 0.0) <= 1:
        parser.error("--confidence-threshold must be in [0, 1] (0 = verify every draft)")


def _flag_for(value, drafter_path: Path | None, shipped_default, flag: str):
    """A drafting flag's value for `generate`: as given, else its default for this drafter (0 with
    no drafter, where a given value is ignored with a note)."""
    if drafter_path is None:
        if value:
            notice(f"{flag} only applies with a drafter: ignored")
        return type(shipped_default)(0)
    if value is not None:
        return value
    return shipped_default if drafter_path == shipped_drafter_dir() else type(shipped_default)(0)


def lookup_for(args, drafter_path: Path | None) -> int:
    """What `generate(lookup=...)` gets: --lookup, else its default for this drafter."""
    return _flag_for(args.lookup, drafter_path, SHIPPED_DRAFTER_LOOKUP, "--lookup")


def min_draft_probability_for(args, drafter_path: Path | None) -> float:
    """What `generate(min_draft_probability=...)` gets: --min-draft-probability, else its default
    for this drafter."""
    return _flag_for(args.min_draft_probability, drafter_path, SHIPPED_DRAFTER_MIN_DRAFT_PROBABILITY,
                     "--min-draft-probability")


def drafter_weights_for(args, drafter_path: Path | None) -> str:
    """What `load_drafter(decode_weights=...)` gets: --drafter-weights, else its default for this
    drafter."""
    if args.drafter_weights is not None:
        if drafter_path is None:
            notice("--drafter-weights only applies with a drafter: ignored")
        return args.drafter_weights
    return SHIPPED_DRAFTER_WEIGHTS if drafter_path is not None and drafter_path == shipped_drafter_dir() else "stored"


def resolve_drafting(args, drafter_path: Path | None) -> None:
    """Sets args.lookup, args.min_draft_probability and args.drafter_weights to what `generate` and
    `load_drafter` get with this drafter."""
    args.lookup = lookup_for(args, drafter_path)
    args.min_draft_probability = min_draft_probability_for(args, drafter_path)
    args.drafter_weights = drafter_weights_for(args, drafter_path)


def drafting_kwargs(args, drafter) -> dict:
    """`generate`'s lookup and min_draft_probability (both off without a drafter), and where given,
    draft_context and a DSpark drafter's confidence_threshold (off by default); after
    `resolve_drafting`."""
    if drafter is None:
        return dict(lookup=0, min_draft_probability=0.0)
    kwargs = dict(lookup=args.lookup, min_draft_probability=args.min_draft_probability)
    for name in ("draft_context", "confidence_threshold"):
        if getattr(args, name, 0):
            kwargs[name] = getattr(args, name)
    return kwargs


def decoding_mode(drafter, lookup: int, min_draft_probability: float = 0.0) -> str:
    """How a run decodes, as the CLIs print it."""
    if drafter is None:
        return "autoregressive"
    extras = ([f"lookup {lookup}"] if lookup else []) + (
        [f"drafts verified from p >= {min_draft_probability:g}"] if min_draft_probability else []) + (
        [f"drafter weights {drafter.decode_weights}"] if drafter.decode_weights != "stored" else [])
    return f"speculative (DFlash{', ' if extras else ''}{', '.join(extras)})"


def resolve_target_path(path: str | None) -> tuple[Path, bool]:
    """(path, is_the_embedded_default). Fails early, before anything heavy is imported."""
    if path is None:
        from dflash_jax._resources import smollm2_gguf_path

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
            raise CLIError(f"drafter must be a directory (config.json + model.safetensors or "
                           f"pytorch_model.bin), got the file {p}")
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


def load_models(target_path: Path, drafter_path: Path | None, dtype: str, kv_cache_dtype: str = "auto",
                drafter_weights: str = "stored", decode_activations: str = "float32", mesh=None):
    """(target, drafter or None), placed on `mesh` when given; every loader failure (missing or
    damaged file, bad config.json, a .bin without torch, a drafter for another target, a mesh
    the model cannot be split over) becomes one CLIError."""
    from dflash_jax._errors import DrafterMismatchError
    from dflash_jax.loading.drafter_io import load_drafter
    from dflash_jax.loading.target_loader import load_target

    try:
        target = load_target(target_path, dtype, kv_cache_dtype=kv_cache_dtype, decode_activations=decode_activations,
                             mesh=mesh)
    except (OSError, ValueError) as e:  # ValueError covers ConfigError, CheckpointError, TorchRequiredError
        raise CLIError(f"cannot load target {target_path}: {e}") from e
    if target.tokenizer is None:
        raise CLIError(f"target {target_path} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    drafter = None
    if drafter_path is not None:
        try:
            drafter = load_drafter(drafter_path, target, dtype, decode_weights=drafter_weights, mesh=mesh)
        except DrafterMismatchError as e:
            raise CLIError(f"{drafter_path}: {e} (target {target_path})") from e
        except (OSError, ValueError) as e:
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


# ------------------------------------------------------------------------------------ results


def histogram_text(counts) -> str:
    """'1:5 2:3 ...' for acceptance lengths 1 .. block size (counts[k] = cycles emitting k)."""
    return " ".join(f"{k}:{int(c)}" for k, c in enumerate(counts) if k >= 1)


def stop_reason(tokens: Sequence[int], stops: Sequence[int]) -> str:
    return "stop token" if tokens and tokens[-1] in set(stops) else "max new tokens"


def default_stop_ids(target) -> list[int]:
    """The stop tokens generate() uses by default (target EOS ids plus the tokenizer's EOS)."""
    from dflash_jax.models.config import default_stop_token_ids

    return default_stop_token_ids(target.config, target.tokenizer)


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
              f"decode          : {result.decode_seconds:.3f} s = {result.decode_tokens_per_second:.1f} tokens/s "
              f"(decode-loop tokens; the first token comes from the prefill)",
              f"compile         : {result.compile_seconds:.2f} s (excluded from the times above)"]
    return lines


def generate_measured(target, drafter, ids: list[int], warmup: bool, **kwargs):
    """generate() for one prompt; with warmup, run it once unmeasured first (the compile time of
    that run is reported). A ValueError (prompt too long, bad block size, ...) becomes a CLIError."""
    from dflash_jax.engine.generator import generate

    try:
        compile_seconds = generate(target, drafter, [ids], **kwargs).compile_seconds if warmup else None
        result = generate(target, drafter, [ids], **kwargs)
    except ValueError as e:
        raise CLIError(str(e)) from e
    if compile_seconds is not None:
        result.compile_seconds = compile_seconds
    return result


@dataclasses.dataclass
class StreamedAnswer:
    """What `stream_answer` printed, as the host loop saw it."""
    tokens: list[int]
    per_cycle: list[int]      # tokens committed by each cycle (the prefill's first token excluded)
    first_text_seconds: float  # call to first printed text (prefill, compile included)
    rate: float | None         # tokens/s after the first cycle (None when too short to tell)


def stream_answer(target, drafter, ids: list[int], **kwargs) -> StreamedAnswer:
    """Print one prompt's answer as generate_stream commits it (incremental detokenizing).
    A ValueError (prompt too long, bad block size, ...) becomes a CLIError."""
    from dflash_jax.engine.generator import generate_stream

    detok = IncrementalDetokenizer(target.tokenizer)
    per_cycle, stamps = [], []
    start = time.perf_counter()
    try:  # a bad argument or prompt may be reported by the call or by the first step
        stream = generate_stream(target, drafter, [ids], **kwargs)
        for step, new in enumerate(stream):
            stamps.append(time.perf_counter())
            if step > 0:
                per_cycle.append(len(new[0]))
            print(detok.push(new[0]), end="", flush=True)
    except ValueError as e:
        raise CLIError(str(e)) from e
    print(detok.flush(), flush=True)
    rate = None
    if len(stamps) > 2:  # cycle 1 includes compiling the step; measure from its end
        rate = sum(per_cycle[1:]) / (stamps[-1] - stamps[1])
    return StreamedAnswer(detok.ids, per_cycle, stamps[0] - start, rate)


def compare_outputs(speculative: Sequence[int], baseline: Sequence[int], temperature: float, dtype: str) -> str:
    """One line on whether speculative and plain decoding emitted the same tokens, and if not, where
    they first differ and whether that is expected."""
    if list(speculative) == list(baseline):
        return "identical"
    first = next((i for i, (a, b) in enumerate(zip(speculative, baseline)) if a != b),
                 min(len(speculative), len(baseline)))
    where = f"different from new token {first} on"
    if temperature > 0:
        return f"{where} (sampling: the outputs are identically distributed, not identical)"
    if dtype == "bfloat16":
        return (f"{where}: expected in bfloat16, where verifying a block rounds differently from "
                "decoding one token at a time, so near-tied tokens can flip (use float32 for identical text)")
    return f"{where}: greedy float32 outputs should be identical (a near-tie or a bug)"


# --------------------------------------------------------------------------------------- CLI


def add_compile_cache_flag(parser) -> None:
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="do not use JAX's persistent compilation cache (on by default, in the user "
                             "cache directory; $DFLASH_JAX_CACHE_DIR moves it)")


def enable_compile_cache(args) -> Path | None:
    """Turn JAX's persistent compilation cache on unless --no-compile-cache; its directory or None."""
    if args.no_compile_cache:
        return None
    from dflash_jax import _compilation_cache as compilation_cache

    try:
        return compilation_cache.enable()
    except OSError as e:
        notice(f"{e}: running without the persistent compilation cache")
        return None


def run_cli(build_parser, check_args, run, argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Parse, check, run; a CLIError becomes one `error:` line and exit code 2 (shared by the CLIs).
    `prog` names the program in usage lines (`python -m infer.generate` or `dflash-generate`)."""
    parser = build_parser()
    if prog is not None:
        parser.prog = prog
    args = parser.parse_args(argv)
    check_args(parser, args)
    try:
        return run(args)
    except CLIError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR


def exit_process(code: int) -> NoReturn:
    """End the process of a finished program with exit status `code`, without the interpreter's
    teardown: once jax and a model are loaded, freeing them and running the exit hooks is a
    noticeable part of a short CLI run, and `os._exit` skips both. Python's output streams and
    logging are flushed first; a program's files are closed by the time it returns, and JAX
    writes its compilation cache as it compiles. A script's last line
    only: nothing runs after it, atexit hooks included."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)
