"""`infer.benchmark --random-drafter`: random drafters of every generation (DFlash, DFlash2, DSpark)
with their published settings, run one after the other on the same random prompts and target; the
argument checks, the configs it builds, and a tiny run end to end."""
from __future__ import annotations

import json

import pytest

from dflash_jax.cli import benchmark
from dflash_jax.cli.bench_random import random_configs
from dflash_jax.drafters.config import DFlash2Config, DSparkConfig
from support.cli import TINY


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the benchmark gets as far as loading a model."""
    def refuse(args):
        raise AssertionError("the benchmark started working")

    monkeypatch.setattr(benchmark, "load_setup", refuse)


@pytest.mark.parametrize("argv, message", [
    (["--random-drafter", "dflash2"], "only with --random-target"),
    (["--random-target", "qwen3-8b", "--random-drafter", "dflash,eagle3"], "unknown generation 'eagle3'"),
    (["--random-target", "qwen3-8b", "--random-drafter", "dspark,dspark"], "names a generation twice"),
])
def test_bad_random_drafter_arguments_exit_2(argv, message, no_work, capsys):
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_each_generation_gets_its_published_settings():
    _, dflash = random_configs("qwen3-8b", None, None)
    assert dflash.architecture == "DFlashDraftModel" and dflash.block_size == 16 and dflash.proposals == 15
    _, dflash2 = random_configs("qwen3-8b", None, None, "dflash2")
    assert dflash2.architecture == "DFlash2DraftModel" and dflash2.block_size == 8
    assert dflash2.dflash2 == DFlash2Config(conv_kernel_size=2, conv_group_size=16, selector_rank=256,
                                            selector_top_k=16)
    _, dspark = random_configs("qwen3-8b", None, None, "dspark")
    assert dspark.architecture == "Qwen3DSparkModel" and dspark.block_size == 7 and dspark.proposals == 7
    assert dspark.dspark == DSparkConfig(markov_rank=256, enable_confidence_head=True,
                                         confidence_head_with_markov=True)
    # the backbone is the same for all three: the official DFlash shape of the target
    for cfg in (dflash2, dspark):
        assert (cfg.num_layers, cfg.hidden_size, cfg.target_layer_ids, cfg.mask_token_id) == (
            dflash.num_layers, dflash.hidden_size, dflash.target_layer_ids, dflash.mask_token_id)


def test_a_block_size_is_what_every_generation_verifies():
    for generation in ("dflash", "dflash2", "dspark"):
        _, cfg = random_configs("llama3-8b", 3, 6, generation)
        assert cfg.proposals + 1 == 6, generation
    with pytest.raises(ValueError, match="at least 3 tokens"):
        random_configs("llama3-8b", 3, 2, "dspark")
    with pytest.raises(ValueError, match="unknown drafter generation 'medusa'"):
        random_configs("llama3-8b", 3, None, "medusa")


def test_smollm2_preset_has_the_embedded_gguf_shapes():
    config, drafter = random_configs("smollm2-135m", None, None)
    assert (config.arch, config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads,
            config.num_kv_heads, config.head_dim, config.vocab_size, config.tie_word_embeddings) == (
        "llama", 30, 576, 1536, 9, 3, 64, 49152, True)
    assert drafter.mask_token_id == 2


@pytest.mark.slow  # three speculative runs end to end: `make test-all`
def test_every_generation_runs_on_the_same_prompts(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(benchmark.RANDOM_TARGETS, "tiny", TINY)
    out = tmp_path / "r.json"
    argv = ["--random-target", "tiny", "--layers", "2", "--num-prompts", "1", "--prompt-tokens", "9",
            "--max-new-tokens", "6", "--block-size", "4", "--dtype", "float32",
            "--random-drafter", "dflash,dflash2,dspark", "--no-compile-cache", "--out", str(out)]
    assert benchmark.main(argv) == 0
    text = capsys.readouterr().out
    assert "=== drafter generations (same prompts, same target) ===" in text
    for generation in ("dflash", "dflash2", "dspark"):
        assert f"=== attention: reference, drafter: random {generation} ===" in text, text
        assert f"| reference | {generation} | 4 |" in text, text
    runs = json.loads(out.read_text())["runs"]
    assert [r["summary"]["drafter_generation"] for r in runs] == ["dflash", "dflash2", "dspark"]
    prompts = {json.dumps(r["batches"][0]["prompt_ids"]) for r in runs}
    assert len(prompts) == 1  # the same prompt ids for every generation
    for run in runs:
        s = run["summary"]
        assert s["verify_block_size"] == 4 and s["greedy_identical"] is True  # lossless whatever drafts
        assert set(s["acceptance_histogram"]) == {"1", "2", "3", "4"}
