"""`python -m infer.benchmark`: argument checks that fail (or skip) before any work, the timing
arithmetic (decode tokens exclude the prefill's token; cycle cost), a random-target run end to end
on a tiny model, the transformers baseline against our greedy decoding, and the persistent
compilation cache (in a temporary directory; a second process compiles nothing)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import _compilation_cache as compilation_cache
from dflash_jax.cli import bench_concurrency, benchmark
from dflash_jax.engine.generator import GenerationResult
from support.cli import TINY

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the benchmark gets as far as loading a model."""
    def refuse(args):
        raise AssertionError("the benchmark started working")

    monkeypatch.setattr(benchmark, "load_setup", refuse)


# ------------------------------------------------------------------------------ argument checks


def test_plot_without_matplotlib_fails_before_any_work(monkeypatch, no_work, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert benchmark.main(["--smoke", "--plot", str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --plot needs matplotlib"), err
    assert "pip install matplotlib" in err[0] and not (tmp_path / "a.png").exists()


def test_baseline_without_torch_is_skipped_with_one_notice_first(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)
    seen = {}

    def stop(args):
        seen["baseline"] = args.baseline
        raise benchmark.CLIError("stopped before loading")

    monkeypatch.setattr(benchmark, "load_setup", stop)
    assert benchmark.main(["--smoke", "--baseline", "transformers", "--no-compile-cache"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert seen == {"baseline": None}  # the run goes on without it
    assert err[0] == ("note: --baseline transformers needs torch (pip install torch): running without "
                      "the baseline")


@pytest.mark.parametrize("argv, message", [
    (["--batch", "0"], "--batch must be >= 1"),
    (["--layers", "2"], "only with --random-target"),
    (["--attn-impl", "pallas"], "only with --random-target"),
    (["--random-target", "qwen3-8b", "--target", "x.gguf"], "builds its own models"),
    (["--random-target", "qwen3-8b", "--baseline", "transformers"], "needs real weights"),
    (["--random-target", "qwen3-8b", "--layers", "0"], "--layers must be >= 1"),
    (["--random-target", "llama3-70b"], "invalid choice"),
    (["--join", "1"], "--join must be >= 2"),
    (["--random-target", "qwen3-8b", "--join", "4"], "cannot be combined with --random-target"),
    (["--concurrency", "1,x"], "--concurrency: concurrency levels are integers >= 1"),
    (["--verify-budget", "8"], "apply with --concurrency"),
    (["--concurrency", "2", "--profile-verify", "c.json", "--baseline", "transformers"], "drop --baseline"),
])
def test_bad_arguments_exit_2(argv, message, no_work, capsys):
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_join_makes_long_input_prompts_from_every_k_of_the_set(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(7)))
    args = benchmark.build_parser().parse_args(["--prompts", str(path), "--join", "3"])
    name, prompts = benchmark.select_prompts(args)
    assert name.endswith("joined by 3") and [p["question_id"] for p in prompts] == ["join-1", "join-2"]
    assert prompts[1]["text"] == (benchmark.JOIN_HEAD + "question 3\n\nquestion 4\n\nquestion 5"
                                  + benchmark.JOIN_TAIL)  # the 7th question, short of a group, is dropped
    args = benchmark.build_parser().parse_args(["--prompts", str(path), "--join", "8"])
    with pytest.raises(benchmark.CLIError, match="needs at least 8 prompts"):
        benchmark.select_prompts(args)


# ------------------------------------------------------------------------------------- timing


def _result(tokens, acceptance, prefill=0.5, decode=2.0, block_size=4):
    return GenerationResult(tokens=tokens, acceptance_lengths=acceptance, prefill_seconds=prefill,
                            decode_seconds=decode, compile_seconds=0.0, block_size=block_size)


def test_decode_rate_excludes_the_prefill_token_and_cycle_cost_is_per_step():
    ar = benchmark._mode_record(_result([[5] * 9], [[1] * 8], decode=2.0, block_size=1), None, 40, False)
    assert ar["decode_tokens"] == 8 and ar["decode_tokens_per_second"] == 4.0  # not 9 / 2
    assert ar["prefill_tokens_per_second"] == 80.0 and ar["seconds_per_step"] == 0.25
    spec = benchmark._mode_record(_result([[5] * 9], [[3, 3, 2]], decode=0.9), None, 40, True)
    assert spec["tau"] == pytest.approx(8 / 3, abs=1e-4) and spec["seconds_per_step"] == 0.3
    # batch of two: steps = the longest row's cycles; decode tokens summed over rows
    batch = benchmark._mode_record(_result([[5] * 4, [5] * 7], [[2, 1], [3, 3]], decode=1.0), 123, 10, True)
    assert batch["decode_tokens"] == 3 + 6 and batch["seconds_per_step"] == 0.5
    assert batch["peak_rss_bytes"] == 123
    record = {"question_ids": [1], "autoregressive": ar, "speculative": spec,
              "cycle_cost": spec["seconds_per_step"] / ar["seconds_per_step"], "speedup": 1.0,
              "greedy_identical": True}
    summary = benchmark.summarize([record], np.bincount([3, 3, 2], minlength=5), speculative=True)
    assert summary["cycle_cost_median"] == pytest.approx(1.2)
    assert summary["acceptance_histogram"] == {"1": 0, "2": 1, "3": 2, "4": 0}


# --------------------------------------------------------------------------------- end to end


@pytest.mark.slow  # an end-to-end run: `make test-all`
def test_random_target_run_prints_the_table_and_writes_json(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(benchmark.RANDOM_TARGETS, "tiny", TINY)
    out = tmp_path / "r.json"
    argv = ["--random-target", "tiny", "--layers", "2", "--num-prompts", "1", "--prompt-tokens", "9",
            "--max-new-tokens", "6", "--block-size", "4", "--dtype", "float32", "--kv-cache-dtype", "float16",
            "--no-compile-cache", "--out", str(out)]
    assert benchmark.main(argv) == 0
    text = capsys.readouterr().out
    for line in ("float32 (KV cache float16)", "autoregressive decode tok/s", "speculative decode tok/s", "cycle cost",
                 "tau",
                 "peak RSS while generating", "compilation cache             : off"):
        assert line in text, text
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert run["summary"]["attention"] == "reference" and run["summary"]["num_prompts"] == 1
    assert run["summary"]["greedy_identical"] is True  # random weights, still lossless
    assert report["settings"]["kv_cache_dtype"] == "float16"
    for batch in run["batches"]:
        assert len(batch["prompt_ids"][0]) == 9
        assert batch["autoregressive"]["new_tokens"] == [6]  # no stop tokens for random weights
        assert batch["autoregressive"]["decode_tokens"] == 5
        assert sum(batch["speculative"]["acceptance_lengths"][0]) >= 5


def test_random_configs_have_the_official_shapes():
    config, drafter = benchmark.random_configs("qwen3-8b", None, None)
    assert (config.arch, config.num_layers, config.hidden_size, config.intermediate_size,
            config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size,
            config.tie_word_embeddings) == ("qwen3", 36, 4096, 12288, 32, 8, 128, 151936, False)
    assert (drafter.num_layers, drafter.hidden_size, drafter.intermediate_size, drafter.num_heads,
            drafter.num_kv_heads, drafter.head_dim, drafter.block_size, drafter.mask_token_id) == (
        5, 4096, 12288, 32, 8, 128, 16, 151669)
    assert drafter.target_layer_ids == (1, 9, 17, 25, 33)
    small, cut = benchmark.random_configs("llama3-8b", 3, 8)
    assert small.arch == "llama" and small.num_layers == 3 and small.hidden_size == 4096
    assert cut.num_layers == 3 and cut.target_layer_ids == (0, 1, 2) and cut.block_size == 8
    assert benchmark.random_configs("qwen3-4b", None, None)[0].tie_word_embeddings


def test_random_params_are_drawn_for_every_leaf():
    shapes = {"norm": {"scale": jax.ShapeDtypeStruct((4,), jnp.bfloat16)},
              "proj": {"kernel": jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)}}
    params = benchmark.random_params(shapes, seed=0)
    assert params["proj"]["kernel"].dtype == jnp.bfloat16 and params["proj"]["kernel"].shape == (4, 8)
    np.testing.assert_array_equal(np.asarray(params["norm"]["scale"], np.float32), np.ones(4))
    kernel = np.asarray(params["proj"]["kernel"], np.float32)
    assert 0 < kernel.std() < 0.1 and len(np.unique(kernel)) > 16


def test_transformers_baseline_decodes_like_our_greedy_loop(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from support.gguf import write_tiny_llama

    from dflash_jax.engine.generator import generate
    from dflash_jax.loading.target_loader import load_target

    gguf_file = write_tiny_llama(tmp_path / "tiny.gguf")
    monkeypatch.setenv("DFLASH_JAX_GGUF_CACHE", "0")  # nothing of this test in the user cache
    model = benchmark.load_transformers_model(gguf_file, "float32")
    rows = [[3, 5, 7, 11, 13], [2, 4, 6]]
    hf = benchmark.run_transformers(model, rows, max_new_tokens=6, stops=[], pad_id=0)
    assert hf["new_tokens"] == [6, 6] and hf["decode_tokens"] == 10
    # decode time is the whole run less a separate 1-token run: on a loaded machine the difference
    # can be <= 0, which the benchmark reports as nan rather than a negative rate
    assert hf["prefill_seconds"] > 0
    assert hf["decode_tokens_per_second"] > 0 or math.isnan(hf["decode_tokens_per_second"])
    target = load_target(gguf_file, "float32", tokenizer=False)
    ours = [generate(target, None, [r], max_new_tokens=6, stop_token_ids=()).tokens[0] for r in rows]
    assert hf["tokens"] == ours  # left padding, same weights, same greedy choices


# --------------------------------------------------------------------------- compilation cache


@pytest.fixture
def restore_jax_cache_config():
    names = ("jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes")
    saved = {n: getattr(jax.config, n) for n in names}
    yield
    compilation_cache.disable()
    for name, value in saved.items():
        jax.config.update(name, value)


def test_compilation_cache_enable_stores_executables(tmp_path, monkeypatch, restore_jax_cache_config):
    monkeypatch.setenv("DFLASH_JAX_CACHE_DIR", str(tmp_path / "root"))
    directory = compilation_cache.enable()
    assert directory == tmp_path / "root" / "jax-compilation" and directory.is_dir()
    assert compilation_cache.directory() == directory
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    jax.jit(lambda x: jnp.sin(x) * 3 + 1).lower(jnp.ones(7)).compile()  # ahead of time, like generate
    assert any(directory.iterdir())
    other = compilation_cache.enable(tmp_path / "explicit")
    assert other == tmp_path / "explicit" and compilation_cache.directory() == other
    jax.jit(lambda x: jnp.cos(x) - 2).lower(jnp.ones(5)).compile()
    assert any(other.iterdir())  # the cache follows the new directory
    compilation_cache.disable()
    assert compilation_cache.directory() is None


def test_compilation_cache_enable_names_an_unusable_directory(tmp_path, restore_jax_cache_config):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError, match="compilation cache directory .*file"):
        compilation_cache.enable(blocker / "sub")


@pytest.mark.slow
def test_second_process_compiles_nothing(tmp_path):
    """`--smoke` twice with a fresh cache root: the second process writes no new executables."""
    env = {**os.environ, "DFLASH_JAX_CACHE_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    reports = []
    for run in range(2):
        out = tmp_path / f"run{run}.json"
        done = subprocess.run([sys.executable, "-m", "infer.benchmark", "--smoke", "--num-prompts", "1",
                               "--max-new-tokens", "4", "--out", str(out)], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        reports.append(json.loads(out.read_text())["runs"][0]["summary"])
    first, second = reports
    assert first["compile_cache"]["entries_written"] > 0
    assert second["compile_cache"]["entries_written"] == 0
    assert second["compile"][0]["compile_seconds"] < first["compile"][0]["compile_seconds"]


def test_a_bad_mesh_is_refused_before_any_model_is_built(capsys):
    # one device here: tensor=2 does not fit it; "model" is no axis
    assert benchmark.main(["--random-target", "qwen3-8b", "--mesh", "model=2", "--no-compile-cache"]) == 2
    assert "--mesh model=2" in capsys.readouterr().err
    assert benchmark.main(["--random-target", "qwen3-8b", "--mesh", "tensor=2", "--no-compile-cache"]) == 2
    assert "does not divide the 1 devices" in capsys.readouterr().err


# newer-jax leg only (`one_leg`); both legs run the benchmark CLI (above) and the engine with a verify
# budget and cost table (test_engine.py::test_a_verify_budget_or_cost_table_changes_what_is_verified_not_the_tokens)
@pytest.mark.one_leg
def test_concurrency_runs_the_engine_and_profile_verify_writes_a_cost_table_it_reads(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(benchmark.RANDOM_TARGETS, "tiny", TINY)
    common = ["--random-target", "tiny", "--layers", "2", "--num-prompts", "3", "--prompt-tokens", "9",
              "--max-new-tokens", "6", "--block-size", "4", "--dtype", "float32", "--no-compile-cache"]
    costs = tmp_path / "costs.json"
    # profiled at the default level (1), run at level 2 only: the table's nearest level stands in, and
    # each engine (3 profiled widths, then autoregressive and speculative) compiles once, not at two levels
    assert benchmark.main([*common, "--profile-verify", str(costs)]) == 0
    table = json.loads(costs.read_text())
    assert table["block_size"] == 4 and set(table["cycle_seconds"]["1"]) == {"1", "2", "4"}
    assert all(s > 0 for s in table["cycle_seconds"]["1"].values())
    out = tmp_path / "c.json"
    assert benchmark.main([*common, "--concurrency", "2", "--verify-costs", str(costs), "--out", str(out)]) == 0
    text = capsys.readouterr()
    assert "concurrency   2: ar" in text.out and "no costs measured at concurrency 2" in text.err
    assert bench_concurrency.parse_levels("4, 1,2,1") == [1, 2, 4]  # several levels: ascending, once each
    report = json.loads(out.read_text())
    for record in report["concurrency"]:
        assert record["greedy_identical"] is True  # random weights, still lossless
        assert record["autoregressive"]["tokens"] == record["prompts"] * 6
        assert record["speculative"]["tau"] >= 1 and record["speculative"]["verified_per_cycle"] >= 1
