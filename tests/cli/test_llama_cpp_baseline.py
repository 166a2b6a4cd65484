"""`infer.benchmark --baseline llama.cpp`: the argument checks (a missing llama-cpp-python is an error
naming the install command, a non-GGUF target is refused) before any work, the timing of llama.cpp's
greedy decoding, and the run wired end to end: our autoregressive decoding, then the same ids through
llama.cpp in the same run, reported side by side. llama-cpp-python compiles llama.cpp, so these tests
inject a stand-in `llama_cpp` module instead of the real one."""
from __future__ import annotations

import json
import sys
import time
import types

import pytest

from dflash_jax.cli import bench_baseline, benchmark

VOCAB = 64


class FakeLlama:
    """llama_cpp.Llama's surface the baseline uses: reset, eval, sample(top_k, temp). Greedy
    "decoding" of a fixed rule: the next token is (last token * 7 + 3) % VOCAB; an evaluation takes 1 ms."""

    instances: list = []

    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, seed, verbose):
        self.model_path, self.n_ctx, self.threads = model_path, n_ctx, (n_threads, n_threads_batch)
        self.history: list[int] = []
        self.evals: list[list[int]] = []
        FakeLlama.instances.append(self)

    def reset(self):
        self.history = []

    def eval(self, tokens):
        tokens = list(tokens)
        assert len(self.history) + len(tokens) <= self.n_ctx, "past the context"
        self.evals.append(tokens)
        self.history += tokens
        time.sleep(0.001)  # a measurable evaluation

    def sample(self, top_k, temp):
        assert (top_k, temp) == (1, 0.0)  # greedy
        return (self.history[-1] * 7 + 3) % VOCAB


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    FakeLlama.instances = []
    module = types.ModuleType("llama_cpp")
    module.Llama = FakeLlama
    module.__version__ = "0.0-fake"
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    return module


@pytest.fixture
def no_work(monkeypatch):
    def refuse(args):
        raise AssertionError("the benchmark started working")

    monkeypatch.setattr(benchmark, "load_setup", refuse)


def test_missing_llama_cpp_is_an_error_naming_the_install_command(monkeypatch, no_work, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    assert benchmark.main(["--smoke", "--baseline", "llama.cpp", "--no-compile-cache"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --baseline llama.cpp needs llama-cpp-python"), err
    assert "pip install 'llama-cpp-python>=0.3'" in err[0] and ".[llamacpp]" in err[0]


def test_a_llama_cpp_whose_library_does_not_load_is_an_error_naming_the_reinstall(monkeypatch, no_work, capsys):
    import builtins

    real_import = builtins.__import__

    def broken(name, *args, **kwargs):
        if name == "llama_cpp":
            raise RuntimeError("Failed to load shared library 'libllama.so'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    monkeypatch.setattr(builtins, "__import__", broken)
    assert benchmark.main(["--smoke", "--baseline", "llama.cpp", "--no-compile-cache"]) == 2
    err = capsys.readouterr().err
    assert "installed but does not load (Failed to load shared library 'libllama.so')" in err
    assert "pip install 'llama-cpp-python>=0.3'" in err


def test_a_target_that_is_not_a_gguf_file_is_refused(fake_llama_cpp, no_work, capsys, tmp_path):
    assert benchmark.main(["--target", str(tmp_path), "--baseline", "llama.cpp", "--no-compile-cache"]) == 2
    assert "runs a GGUF file; the target" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--random-target", "qwen3-8b", "--baseline", "llama.cpp"], "needs real weights"),
    (["--llama-cpp-threads", "2"], "applies only with --baseline llama.cpp"),
    (["--baseline", "llama.cpp", "--llama-cpp-threads", "0"], "takes a count >= 1"),
])
def test_bad_llama_cpp_arguments_exit_2(argv, message, no_work, capsys):
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def _next(token: int) -> int:
    return (token * 7 + 3) % VOCAB


def test_llama_cpp_decodes_each_row_greedily_and_times_prefill_apart(fake_llama_cpp):
    model = FakeLlama("m.gguf", 64, 2, 2, 0, False)
    rows = [[5, 6, 7], [9]]
    out = bench_baseline.run_llama_cpp(model, rows, max_new_tokens=4, stops=[_next(9)])
    chain = [_next(7)]
    for _ in range(3):
        chain.append(_next(chain[-1]))
    assert out["tokens"] == [chain, [_next(9)]]  # a stop token ends its row, kept
    assert out["new_tokens"] == [4, 1] and out["decode_tokens"] == 3  # first tokens excluded
    # the prompt in one evaluation, then one token at a time; every row from a fresh context
    assert model.evals[:2] == [[5, 6, 7], [chain[0]]] and model.evals[-1] == [9]
    assert out["prefill_seconds"] > 0 and out["prefill_tokens_per_second"] > 0


def test_the_baseline_runs_beside_ours_in_the_same_run(fake_llama_cpp, monkeypatch, capsys, tmp_path):
    from support.gguf import write_tiny_llama

    from dflash_jax.loading.target_loader import load_target

    monkeypatch.setenv("DFLASH_JAX_GGUF_CACHE", "0")
    gguf_file = write_tiny_llama(tmp_path / "tiny.gguf")
    target = load_target(gguf_file, "float32", tokenizer=False)
    prompts = [{"ids": [3, 5, 7, 11], "question_id": 1, "category": "x"},
               {"ids": [2, 4], "question_id": 2, "category": "y"}]

    def setup(args):
        return benchmark.Setup(target, None, prompts, "two prompts", "tiny", None, gguf_file, 0.0)

    monkeypatch.setattr(benchmark, "load_setup", setup)
    monkeypatch.setattr(benchmark, "default_stop_ids", lambda t: [])
    out = tmp_path / "r.json"
    argv = ["--target", str(gguf_file), "--no-draft-only", "--max-new-tokens", "5", "--baseline", "llama.cpp",
            "--llama-cpp-threads", "1", "--no-compile-cache", "--out", str(out)]
    assert benchmark.main(argv) == 0
    text = capsys.readouterr().out
    assert "[1/2] llama.cpp" in text and "[2/2] llama.cpp" in text
    assert "llama.cpp decode tok/s        :" in text and "1 threads, llama-cpp-python 0.0-fake" in text
    assert "ours autoregressive / llama.cpp =" in text and "identical outputs in 0/2 batches" in text
    (model,) = FakeLlama.instances
    assert model.model_path == str(gguf_file) and model.n_ctx >= 4 + 5 and model.threads == (1, 1)
    assert [3, 5, 7, 11] in model.evals and [2, 4] in model.evals  # the same ids as ours
    summary = json.loads(out.read_text())["runs"][0]["summary"]["llama_cpp"]
    assert summary["version"] == "0.0-fake" and summary["decode_tokens_per_second_median"] > 0
    assert summary["identical_batches"] == 0  # the stand-in's rule is not the tiny model's
    batches = json.loads(out.read_text())["runs"][0]["batches"]
    assert [b["llama_cpp"]["new_tokens"] for b in batches] == [[5], [5]]
    assert all(b["llama_cpp_identical"] is False for b in batches)
    assert summary["common_prefix_tokens"] == [b["llama_cpp_common_prefix"][0] for b in batches]
