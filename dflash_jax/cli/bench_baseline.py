"""The baselines: `--baseline transformers`, the same weights in transformers' greedy `generate`
(torch, CPU), and `--baseline llama.cpp`, the same GGUF in llama.cpp (`llama-cpp-python`) decoding
greedily; both on the same token ids, timed like our own runs."""
from __future__ import annotations

import os
import time
from pathlib import Path

from dflash_jax.cli.bench_run import median, rate
from dflash_jax.cli.common import CLIError


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
    from dflash_jax.formats.gguf_reader import read_gguf

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
            "prefill_tokens_per_second": round(rate(sum(map(len, rows)), prefill_seconds), 3),
            "decode_tokens_per_second": round(rate(decode_tokens, decode_seconds), 3)}


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
    ours = median([r["autoregressive"]["decode_tokens_per_second"] for r in records])
    theirs = median([r["transformers"]["decode_tokens_per_second"] for r in records])
    return {"load_seconds": round(load_seconds, 3), "torch_threads": os.cpu_count(),
            "decode_tokens_per_second_median": round(theirs, 3),
            "prefill_tokens_per_second_median":
                round(median([r["transformers"]["prefill_tokens_per_second"] for r in records]), 3),
            "autoregressive_over_transformers": round(ours / theirs, 4),
            "identical_batches": sum(bool(r["transformers_identical"]) for r in records),
            "decode_activations": args.decode_activations}


LLAMA_CPP_INSTALL = "pip install 'llama-cpp-python>=0.3' (or pip install -e '.[llamacpp]'; it compiles llama.cpp)"


def check_llama_cpp(target_path: Path) -> None:
    """Before any work: CLIError naming the install command when llama_cpp cannot be imported, or
    naming the target when it is not a GGUF file (llama.cpp reads GGUF only)."""
    if target_path.suffix != ".gguf":
        raise CLIError(f"--baseline llama.cpp runs a GGUF file; the target {target_path} is not one "
                       "(convert it with llama.cpp's convert_hf_to_gguf.py and pass the .gguf as --target)")
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        raise CLIError("--baseline llama.cpp needs llama-cpp-python, which is not installed: "
                       + LLAMA_CPP_INSTALL) from e
    except (OSError, RuntimeError) as e:  # installed, but its compiled library does not load
        raise CLIError(f"--baseline llama.cpp: llama-cpp-python is installed but does not load ({e}); "
                       f"reinstall it: {LLAMA_CPP_INSTALL}") from e


def load_llama_cpp_model(target_path: Path, context: int, threads: int | None = None):
    """The GGUF in llama.cpp on `threads` CPU threads for decoding and for the prompt (None: this
    machine's os.cpu_count()), a context of `context` tokens, no console output."""
    import llama_cpp

    threads = threads or os.cpu_count() or 1
    return llama_cpp.Llama(model_path=str(target_path), n_ctx=context, n_threads=threads,
                           n_threads_batch=threads, seed=0, verbose=False)


def run_llama_cpp(model, rows: list[list[int]], max_new_tokens: int, stops: list[int]) -> dict:
    """Greedy decoding of every row, one after the other (llama-cpp-python decodes one sequence):
    the prefill is the prompt's evaluation and the choice of the first token; decode is every later
    token's evaluation and choice. Decode tokens exclude each row's first token."""
    stop_set = set(stops)
    tokens, prefill_seconds, decode_seconds = [], 0.0, 0.0
    for row in rows:
        model.reset()
        start = time.perf_counter()
        model.eval(row)
        token = int(model.sample(top_k=1, temp=0.0))
        first = time.perf_counter()
        out = [token]
        while len(out) < max_new_tokens and token not in stop_set:
            model.eval([token])
            token = int(model.sample(top_k=1, temp=0.0))
            out.append(token)
        prefill_seconds += first - start
        decode_seconds += time.perf_counter() - first
        tokens.append(out)
    decode_tokens = sum(len(t) - 1 for t in tokens)
    return {"tokens": tokens, "new_tokens": [len(t) for t in tokens], "decode_tokens": decode_tokens,
            "prefill_seconds": round(prefill_seconds, 5), "decode_seconds": round(decode_seconds, 5),
            "prefill_tokens_per_second": round(rate(sum(map(len, rows)), prefill_seconds), 3),
            "decode_tokens_per_second": round(rate(decode_tokens, decode_seconds), 3)}


def run_llama_cpp_baseline(target_path: Path, records: list[dict], args, stops: list[int]) -> dict:
    """Adds "llama_cpp" to every record (same ids, same max_new_tokens, greedy); returns its summary."""
    import llama_cpp

    context = max(len(r) for record in records for r in record["prompt_ids"]) + args.max_new_tokens + 1
    threads = args.llama_cpp_threads or os.cpu_count() or 1
    start = time.perf_counter()
    model = load_llama_cpp_model(target_path, context, threads)
    load_seconds = time.perf_counter() - start
    run_llama_cpp(model, records[0]["prompt_ids"][:1], 2, stops)  # warm-up, not measured
    for i, record in enumerate(records):
        record["llama_cpp"] = lc = run_llama_cpp(model, record["prompt_ids"], args.max_new_tokens, stops)
        theirs = lc.pop("tokens")
        greedy = args.temperature == 0
        record["llama_cpp_identical"] = theirs == record["tokens"] if greedy else None
        # its quantized arithmetic (Q8 activations) differs from ours: where the outputs part
        record["llama_cpp_common_prefix"] = [_common_prefix(a, b) for a, b in zip(theirs, record["tokens"])] \
            if greedy else None
        print(f"[{i + 1}/{len(records)}] llama.cpp {lc['decode_tokens_per_second']:7.1f} tok/s", flush=True)
    ours = median([r["autoregressive"]["decode_tokens_per_second"] for r in records])
    theirs = median([r["llama_cpp"]["decode_tokens_per_second"] for r in records])
    return {"version": getattr(llama_cpp, "__version__", None), "load_seconds": round(load_seconds, 3),
            "threads": threads,
            "decode_tokens_per_second_median": round(theirs, 3),
            "prefill_tokens_per_second_median":
                round(median([r["llama_cpp"]["prefill_tokens_per_second"] for r in records]), 3),
            "autoregressive_over_llama_cpp": round(ours / theirs, 4),
            "identical_batches": sum(bool(r["llama_cpp_identical"]) for r in records),
            "common_prefix_tokens": [n for r in records for n in r["llama_cpp_common_prefix"] or ()]}


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two outputs share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
