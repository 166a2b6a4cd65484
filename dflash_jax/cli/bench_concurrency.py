"""`infer.benchmark --concurrency 1,4,16,32`: the batch engine (`dflash_jax.engine.batch`) at each
concurrency (slots decoded together, refilled from the prompt queue), speculative and autoregressive
in the same run: tokens/s of each, the speedup, tau, and the tokens the target verified per cycle.
`--profile-verify costs.json` measures the seconds of a cycle at each verify width for each
concurrency (the cost table `--verify-costs` reads back, and `generate(verify_costs=...)` takes)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from dflash_jax.cli.common import CLIError, drafting_kwargs, notice


def parse_levels(text: str) -> list[int]:
    """'1,4,16,32' -> [1, 4, 16, 32] (ascending, each >= 1); ValueError naming the bad entry."""
    levels = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"concurrency levels are integers >= 1 separated by commas, got {part!r} in {text!r}")
        levels.append(int(part))
    return sorted(set(levels))


def _options(args, stops, drafter, widths: bool = False) -> dict:
    """The engine's options for these flags (widths: the cycle's verify width is chosen by a budget or a
    cost table, which the draft gate cannot join: it is left off)."""
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   top_k=args.top_k, seed=args.seed, stop_token_ids=stops)
    if drafter is not None:
        options.update(block_size=args.block_size, acceptance=args.acceptance, **drafting_kwargs(args, drafter))
        if widths and options.get("min_draft_probability"):
            chooser = "--profile-verify" if args.profile_verify else "--verify-budget / --verify-costs"
            notice(f"{chooser} chooses the verify width: drafts are not gated by --min-draft-probability "
                   f"{options['min_draft_probability']:g}")
            options["min_draft_probability"] = 0.0
    return options


def _timed(generator, rows, slots: int, options: dict):
    """(results, stats, seconds, compile seconds) of the engine's second run over rows (the first
    compiles and warms up)."""
    engine = generator.engine(slots=slots, max_prompt_tokens=max(map(len, rows)), **options)
    engine.generate(rows)
    compile_seconds = engine.stats.compile_seconds
    start = time.perf_counter()
    results = engine.generate(rows)
    return results, engine.stats, time.perf_counter() - start, compile_seconds


def _mode(results, stats, seconds, compile_seconds) -> dict:
    tokens = sum(len(r.tokens) for r in results)
    cycles = [n for r in results for n in r.acceptance_lengths]
    return {"tokens": tokens, "seconds": round(seconds, 4), "tokens_per_second": round(tokens / seconds, 2),
            "tau": round(float(np.mean(cycles)), 4) if cycles else None, "batch_cycles": stats.cycles,
            "verified_per_cycle": round(stats.verified_per_cycle, 2), "host_returns": stats.returns,
            "host_seconds_per_return": round(stats.seconds_per_return, 6),
            "prefill_seconds": round(stats.prefill_seconds, 4), "decode_seconds": round(stats.decode_seconds, 4),
            "compile_seconds": round(compile_seconds, 3)}


def _rows_for(prompts: list[dict], level: int) -> list[list[int]]:
    rows = [p["ids"] for p in prompts]
    if len(rows) < level:
        notice(f"{len(rows)} prompts for concurrency {level}: the set is repeated to {level} prompts")
        rows = [rows[i % len(rows)] for i in range(level)]
    return rows


def load_costs(path: Path, block_size: int) -> dict:
    """A --profile-verify file -> {concurrency: {width: seconds}}; CLIError naming a bad file, or one
    measured for another block size."""
    try:
        table = json.loads(Path(path).read_text())
        costs = {int(c): {int(w): float(s) for w, s in widths.items()} for c, widths in table["cycle_seconds"].items()}
        if table["block_size"] != block_size:
            raise CLIError(f"--verify-costs {path}: measured for blocks of {table['block_size']}, this run verifies "
                           f"blocks of {block_size} (measure again with --profile-verify)")
        return costs
    except FileNotFoundError as e:
        raise CLIError(f"--verify-costs {path}: no such file (write one with --profile-verify)") from e
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CLIError(f"--verify-costs {path}: not a --profile-verify cost table ({e})") from e


def _costs_for(table: dict, level: int) -> dict:
    """The table's costs at the measured concurrency nearest to `level`."""
    nearest = min(table, key=lambda c: (abs(c - level), c))
    if nearest != level:
        notice(f"--verify-costs: no costs measured at concurrency {level}; using those of {nearest}")
    return table[nearest]


def run_concurrency(target, drafter, prompts: list[dict], args, stops) -> dict:
    """Speculative and autoregressive through the batch engine at each of args.concurrency's levels."""
    from dflash_jax.engine.generator import Generator

    levels = parse_levels(args.concurrency)
    ar_generator = Generator(target, None)
    spec_generator = Generator(target, drafter) if drafter is not None else None
    costs = None
    if args.verify_costs and drafter is not None:
        from dflash_jax.engine.generator import _block_size

        costs = load_costs(args.verify_costs, _block_size(drafter, args.block_size))
    ar_options = _options(args, stops, None)
    spec_options = _options(args, stops, drafter, widths=bool(args.verify_budget or costs)) if drafter else None
    out = []
    for level in levels:
        rows = _rows_for(prompts, level)
        record = {"concurrency": level, "prompts": len(rows)}
        base = _timed(ar_generator, rows, level, ar_options)
        record["autoregressive"] = _mode(*base)
        line = f"concurrency {level:3d}: ar {record['autoregressive']['tokens_per_second']:8.1f} tok/s"
        if spec_generator is not None:
            options = dict(spec_options)
            if args.verify_budget:
                options["verify_budget"] = args.verify_budget
            if costs is not None:
                options["verify_costs"] = _costs_for(costs, level)
            spec = _timed(spec_generator, rows, level, options)
            record["speculative"] = sp = _mode(*spec)
            record["speedup"] = round(sp["tokens_per_second"] / record["autoregressive"]["tokens_per_second"], 4)
            if args.temperature == 0:
                record["greedy_identical"] = [r.tokens for r in spec[0]] == [r.tokens for r in base[0]]
            line += (f"  spec {sp['tokens_per_second']:8.1f} tok/s  x{record['speedup']:.2f}  tau {sp['tau']:.2f}  "
                     f"verified/cycle {sp['verified_per_cycle']:.1f}")
            if record.get("greedy_identical") is False:
                line += "  OUTPUTS DIFFER"
        print(line, flush=True)
        out.append(record)
    return {"concurrency": out}


def profile_verify(target, drafter, prompts: list[dict], args, stops, path: Path) -> dict:
    """Seconds of a cycle verifying each width (`verify_widths_for` the block) at each concurrency: the
    decode seconds of a run that always verifies that width, over its cycles. Written to `path`."""
    import jax

    from dflash_jax.engine.generator import _block_size, Generator, verify_widths_for

    if drafter is None:
        raise CLIError("--profile-verify times the verify of a drafter's blocks: it needs a drafter")
    generator = Generator(target, drafter)
    widths = verify_widths_for(_block_size(drafter, args.block_size))
    base = _options(args, stops, drafter, widths=True)
    table = {}
    for level in parse_levels(args.concurrency or "1"):
        rows = _rows_for(prompts, level)
        table[str(level)] = {}
        for width in widths:
            options = {**base, "verify_costs": {width: 1.0}}
            _, stats, _, _ = _timed(generator, rows, level, options)
            seconds = stats.decode_seconds / max(stats.cycles, 1)
            table[str(level)][str(width)] = round(seconds, 6)
            print(f"profile-verify: concurrency {level:3d}, width {width:2d}: {seconds * 1e3:8.3f} ms per cycle",
                  flush=True)
    device = jax.devices()[0]
    report = {"device": f"{device.platform}:{device.device_kind}", "block_size": widths[-1],
              "max_new_tokens": args.max_new_tokens, "cycle_seconds": table}
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return report


def plot_speedup(report: dict, path: Path, title: str) -> None:
    """Speedup (speculative / autoregressive tokens/s) against concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in report["concurrency"] if "speedup" in r]
    if not records:
        notice(f"no speculative runs, no speedup to plot: not writing {path}")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["concurrency"] for r in records], [r["speedup"] for r in records], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (slots)")
    ax.set_ylabel("speedup over autoregressive (tokens/s)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")
