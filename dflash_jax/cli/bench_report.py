"""The benchmark's output: the summary table on the console, the acceptance histogram plot
(matplotlib) and the JSON report."""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from dflash_jax.cli.common import histogram_text


INT8_NOTE = (" (int8 activations: a slightly different model from the float32 one transformers runs, so "
             "outputs may differ)")

def _mb(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f} MB"


def plot_histogram(summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def print_summary(summary: dict) -> None:
    s = summary
    print("=== summary ===")
    print(f"prompts                       : {s['num_prompts']} in {s['num_batches']} batches of up to "
          f"{s['batch_size']} ({s['skipped_prompts']} skipped)")
    print(f"autoregressive decode tok/s   : {s['autoregressive_decode_tokens_per_second_median']:.1f} "
          f"(median; {1e3 * s['autoregressive_seconds_per_step_median']:.1f} ms per step)")
    print(f"autoregressive prefill tok/s  : {s['autoregressive_prefill_tokens_per_second_median']:.1f}")
    if "tau_median" in s:
        hist = s["acceptance_histogram"]
        print(f"speculative decode tok/s      : {s['speculative_decode_tokens_per_second_median']:.1f} "
              f"(median; {1e3 * s['speculative_seconds_per_cycle_median']:.1f} ms per cycle)")
        print(f"tau (median over batches)     : {s['tau_median']:.2f}  (over all cycles: {s['tau_overall']:.2f})")
        print(f"acceptance histogram          : {histogram_text([0] + list(hist.values()))}")
        print(f"cycle cost                    : {s['cycle_cost_median']:.2f} autoregressive steps "
              f"(median); tau / cycle cost = {s['tau_median'] / s['cycle_cost_median']:.2f}")
        print(f"speedup                       : {s['speedup']:.2f}x (ratio of medians; "
              f"median per-batch ratio {s['speedup_median_of_prompts']:.2f}x)")
        if s["greedy_identical"] is not None:
            print(f"greedy outputs identical      : {s['greedy_identical']}")
    if "transformers" in s:
        t = s["transformers"]
        print(f"transformers decode tok/s     : {t['decode_tokens_per_second_median']:.1f} (median, "
              f"{t['torch_threads']} torch threads); ours autoregressive / transformers = "
              f"{t['autoregressive_over_transformers']:.2f}x; identical outputs in "
              f"{t['identical_batches']}/{s['num_batches']} batches"
              f"{INT8_NOTE if t['decode_activations'] == 'int8' else ''}")
    if "llama_cpp" in s:
        t = s["llama_cpp"]
        print(f"llama.cpp decode tok/s        : {t['decode_tokens_per_second_median']:.1f} (median, "
              f"{t['threads']} threads, llama-cpp-python {t['version']}; prefill "
              f"{t['prefill_tokens_per_second_median']:.1f} tok/s); ours autoregressive / llama.cpp = "
              f"{t['autoregressive_over_llama_cpp']:.2f}x; identical outputs in "
              f"{t['identical_batches']}/{s['num_batches']} batches"
              + (f", the same first {min(t['common_prefix_tokens'])}-{max(t['common_prefix_tokens'])} tokens "
                 "per prompt" if t["common_prefix_tokens"] else ""))
    print(f"model load                    : {s['load_seconds']:.2f} s")
    for c in s["compile"]:
        print(f"compile ({c['mode']}, batch {c['batch']}, {c['prompt_tokens']}-token prompt): "
              f"{c['compile_seconds']:.2f} s (warm-up call, excluded)")
    cache = s["compile_cache"]
    if cache["directory"]:
        print(f"compilation cache             : {cache['directory']}, {cache['entries_written']} new "
              "entries (0: every executable came from the cache)")
    else:
        print("compilation cache             : off")
    print(f"first result after            : {s['time_to_first_result_seconds']:.2f} s from process start "
          "(imports, load, compile, first generate)")
    print(f"peak RSS while generating     : {_mb(s['peak_rss_bytes_while_generating'])} "
          f"(params {_mb(s['params_bytes'])}); device peak {_mb(s['device_peak_bytes'])}")
    if s.get("cache_bytes_per_token") is not None:
        print(f"target cache per token        : {s['cache_bytes_per_token']:,} bytes (every layer, one row)")


def print_generations(reports) -> None:
    """One line per speculative run of several drafter generations (`--random-drafter`): its verify
    block, tau, acceptance histogram, speculative and autoregressive decode tokens/s, the cycle cost
    and the speedup, all on the same prompts."""
    print("=== drafter generations (same prompts, same target) ===")
    print("| attention | drafter | verify block | tau | histogram (1..G) | spec tok/s | AR tok/s | ms per cycle "
          "| cycle cost (AR steps) | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for _, s in reports:
        hist = " ".join(str(c) for c in s["acceptance_histogram"].values())
        print(f"| {s['attention'] or '-'} | {s['drafter_generation']} | {s['verify_block_size']} | "
              f"{s['tau_median']:.2f} | {hist} | {s['speculative_decode_tokens_per_second_median']:.1f} | "
              f"{s['autoregressive_decode_tokens_per_second_median']:.1f} | "
              f"{1e3 * s['speculative_seconds_per_cycle_median']:.1f} | {s['cycle_cost_median']:.2f} | "
              f"{s['speedup']:.2f}x |")


def write_report(out: Path, args, reports, setup, device) -> None:
    """The JSON report: settings, machine and every run's summary and batches (`setup`: the
    CLI's `benchmark.Setup`)."""
    import jax

    drafter = setup.drafter
    settings = {"target": setup.target_name if args.random_target else str(setup.target_path),
                "drafter": setup.drafter_name, "prompt_set": setup.set_name,
                "max_new_tokens": args.max_new_tokens,
                "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                "acceptance": args.acceptance, "seed": args.seed, "dtype": args.dtype,
                "kv_cache_dtype": setup.target.spec.kv_cache_dtype.name,
                "decode_activations": setup.target.decode_activations,
                "drafter_weights": drafter.decode_weights if drafter else None,
                "block_size": (args.block_size or drafter.config.proposals + 1) if drafter else 1,
                "lookup": args.lookup if drafter else 0,
                "min_draft_probability": args.min_draft_probability if drafter else 0.0,
                "chat_template": not args.raw and not args.random_target, "batch_size": args.batch}
    machine = {"platform": device.platform, "device_kind": device.device_kind,
               "num_devices": jax.device_count(), "host": platform.node(), "cpus": os.cpu_count(),
               "python": platform.python_version(), "jax": jax.__version__}
    runs = [{"summary": summary, "batches": records} for records, summary in reports]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": settings, "machine": machine, "runs": runs}, indent=2) + "\n")
    print(f"wrote {out}")
