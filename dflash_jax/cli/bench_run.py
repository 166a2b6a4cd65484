"""One benchmark run: every batch of prompts speculatively and autoregressively through
`dflash_jax.generate` (the first call of every compiled bucket is a warm-up, run again), the
timings of each call, and their summary (medians over batches)."""
from __future__ import annotations

import statistics
import time

from dflash_jax.cli.bench_memory import peak_rss_bytes, reset_peak_rss
from dflash_jax.cli.common import CLIError, drafting_kwargs, notice


def median(values):
    values = [v for v in values if v == v]  # drop NaN
    return statistics.median(values) if values else float("nan")


def rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("nan")


class Runner:
    """Runs one mode on one batch of prompts; the first call of every compiled bucket is a warm-up.
    Returns (result, peak host RSS of the measured call in bytes, or None where not measurable).
    process_start: the `time.perf_counter()` that time-to-first-result counts from."""

    def __init__(self, target, args, stop_token_ids=None, *, process_start: float):
        self.target, self.args, self.stop_token_ids = target, args, stop_token_ids
        self.process_start = process_start
        self.compiles: list[dict] = []
        self.first_result_seconds: float | None = None  # process start -> end of the first call

    def __call__(self, drafter, rows: list[list[int]], mode: str):
        from dflash_jax.engine.generator import generate

        a = self.args
        kwargs = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                      top_p=a.top_p, block_size=a.block_size if drafter is not None else None,
                      seed=a.seed, acceptance=a.acceptance, stop_token_ids=self.stop_token_ids,
                      **drafting_kwargs(a, drafter))
        reset = reset_peak_rss()
        result = generate(self.target, drafter, rows, **kwargs)
        if self.first_result_seconds is None:
            self.first_result_seconds = time.perf_counter() - self.process_start
        if result.compile_seconds > 0:  # a new shape bucket: this call was the warm-up
            self.compiles.append({"mode": mode, "batch": len(rows), "prompt_tokens": max(map(len, rows)),
                                  "compile_seconds": round(result.compile_seconds, 3)})
            reset = reset_peak_rss()
            result = generate(self.target, drafter, rows, **kwargs)
        return result, (peak_rss_bytes() if reset else None)


def mode_record(result, peak_rss_bytes: int | None, prompt_tokens: int, with_acceptance: bool) -> dict:
    """Timings of one generate call. Decode tokens exclude each row's first token (the prefill's)."""
    decode_tokens = sum(max(len(t) - 1, 0) for t in result.tokens)
    steps = max(result.num_cycles)
    record = {"new_tokens": [len(t) for t in result.tokens], "decode_tokens": decode_tokens,
              "cycles": result.num_cycles,
              "prefill_seconds": round(result.prefill_seconds, 5),
              "decode_seconds": round(result.decode_seconds, 5),
              "prefill_tokens_per_second": round(rate(prompt_tokens, result.prefill_seconds), 3),
              "decode_tokens_per_second": round(rate(decode_tokens, result.decode_seconds), 3),
              "seconds_per_step": round(rate(result.decode_seconds, steps), 6),
              "peak_rss_bytes": peak_rss_bytes}
    if with_acceptance:
        record["tau"] = round(result.tau, 4)
        record["acceptance_lengths"] = result.acceptance_lengths
    return record


def _batches(prompts: list[dict], size: int) -> list[list[dict]]:
    return [prompts[i:i + size] for i in range(0, len(prompts), size)]


def run_benchmark(target, drafter, prompts: list[dict], args, stop_token_ids=None, *, process_start: float):
    """(records, summary, runner): one record per batch of `args.batch` prompts (each with "ids");
    process_start: see `Runner`."""
    runner = Runner(target, args, stop_token_ids, process_start=process_start)
    records, histogram, skipped = [], None, 0
    batches = _batches(prompts, args.batch)
    for i, batch in enumerate(batches):
        rows = [p["ids"] for p in batch]
        prompt_tokens = sum(map(len, rows))
        record = {"question_ids": [p["question_id"] for p in batch],
                  "categories": [p["category"] for p in batch], "prompt_ids": rows}
        try:
            if drafter is not None:
                spec, spec_peak = runner(drafter, rows, "speculative")
            base, base_peak = runner(None, rows, "autoregressive")
        except ValueError as e:  # prompt too long for the target
            notice(f"skipping prompts {record['question_ids']}: {e}")
            skipped += len(batch)
            continue
        record["autoregressive"] = ar = mode_record(base, base_peak, prompt_tokens, False)
        record["tokens"] = base.tokens
        line = (f"[{i + 1}/{len(batches)}] {prompt_tokens:5d} prompt tok  "
                f"ar {ar['decode_tokens_per_second']:7.1f} tok/s")
        if drafter is not None:
            record["speculative"] = sp = mode_record(spec, spec_peak, prompt_tokens, True)
            record["speedup"] = round(sp["decode_tokens_per_second"] / ar["decode_tokens_per_second"], 4)
            record["cycle_cost"] = round(sp["seconds_per_step"] / ar["seconds_per_step"], 4)
            record["greedy_identical"] = spec.tokens == base.tokens if args.temperature == 0 else None
            counts = spec.histogram()
            histogram = counts if histogram is None else histogram + counts
            line += (f"  spec {sp['decode_tokens_per_second']:7.1f} tok/s  tau {spec.tau:5.2f}  "
                     f"cycle {record['cycle_cost']:4.2f} ar steps  x{record['speedup']:.2f}")
            if record["greedy_identical"] is False:
                line += "  OUTPUTS DIFFER"
        print(line, flush=True)
        records.append(record)
    if not records:
        raise CLIError("every prompt was skipped")
    summary = summarize(records, histogram, drafter is not None)
    summary["skipped_prompts"] = skipped
    return records, summary, runner


def summarize(records: list[dict], histogram, speculative: bool) -> dict:
    def median_of(mode: str, key: str) -> float:
        return round(median([r[mode][key] for r in records if mode in r]), 6)

    peaks = [r[m]["peak_rss_bytes"] for r in records for m in ("autoregressive", "speculative")
             if m in r and r[m]["peak_rss_bytes"] is not None]
    summary = {"num_batches": len(records), "num_prompts": sum(len(r["question_ids"]) for r in records),
               "autoregressive_decode_tokens_per_second_median":
                   median_of("autoregressive", "decode_tokens_per_second"),
               "autoregressive_prefill_tokens_per_second_median":
                   median_of("autoregressive", "prefill_tokens_per_second"),
               "autoregressive_seconds_per_step_median": median_of("autoregressive", "seconds_per_step"),
               "peak_rss_bytes_while_generating": max(peaks) if peaks else None}
    if speculative:
        taus = [r["speculative"]["tau"] for r in records]
        cycles = sum(sum(r["speculative"]["cycles"]) for r in records)
        emitted = sum(sum(map(sum, r["speculative"]["acceptance_lengths"])) for r in records)
        spec = median_of("speculative", "decode_tokens_per_second")
        summary.update(
            tau_median=round(median(taus), 4),
            tau_overall=round(emitted / cycles, 4) if cycles else float("nan"),
            acceptance_histogram={str(k): int(c) for k, c in enumerate(histogram) if k >= 1},
            speculative_decode_tokens_per_second_median=spec,
            speculative_prefill_tokens_per_second_median=median_of("speculative", "prefill_tokens_per_second"),
            speculative_seconds_per_cycle_median=median_of("speculative", "seconds_per_step"),
            cycle_cost_median=round(median([r["cycle_cost"] for r in records]), 4),
            speedup=round(spec / summary["autoregressive_decode_tokens_per_second_median"], 4),
            speedup_median_of_prompts=round(median([r["speedup"] for r in records]), 4),
            greedy_identical=None if records[0]["greedy_identical"] is None
            else all(r["greedy_identical"] for r in records))
    return summary
