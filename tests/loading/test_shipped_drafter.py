"""The drafter shipped in checkpoints/smollm2-dflash/ (trained by this project, configs/smollm2/)
against the embedded SmolLM2-135M-Instruct target: it loads in the official layout, speculative greedy
decoding reproduces plain greedy decoding token for token, and it drafts well enough to be worth
shipping (tau above a quality floor; the benchmark, not this test, measures the real figures)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_jax.cli.common import encode_prompt, SHIPPED_DRAFTER_DIR, SHIPPED_DRAFTER_LOOKUP
from dflash_jax.engine.generator import generate
from train.config import load_config

# Chat prompts of the kind the drafter was trained on (not MT-Bench, whose first turns the benchmark uses).
PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a binary search does, in two sentences.",
)
MAX_NEW_TOKENS = 48

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "smollm2" / "stage6.yaml"  # its last stage

pytestmark = pytest.mark.skipif(not (SHIPPED_DRAFTER_DIR / "config.json").is_file(),
                                reason="no drafter ships in checkpoints/smollm2-dflash yet (issue #12)")


@pytest.fixture(scope="module")
def models():
    from dflash_jax.loading.drafter_io import load_drafter
    from dflash_jax.loading.target_loader import load_target

    target = load_target("smollm2", "float32")
    return target, load_drafter(SHIPPED_DRAFTER_DIR, target, "float32")


def test_ships_in_the_official_layout():
    config = json.loads((SHIPPED_DRAFTER_DIR / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    recipe = load_config(RECIPE).model  # resolved through `base:` (the shared values live in base.yaml)
    assert (config["num_hidden_layers"], config["sliding_window"], config["draft_vocab_size"]) == \
        (recipe.num_layers, recipe.sliding_window, recipe.draft_vocab_size)
    # exported with the block that paid on this CPU (train.export --block-size), at most the trained one
    assert 2 <= config["block_size"] <= recipe.block_size
    weights = SHIPPED_DRAFTER_DIR / "model.safetensors"
    assert weights.is_file() and weights.stat().st_size < 64 * 2**20  # a few tens of MB (bf16)


def test_greedy_equals_plain_decoding_and_tau_clears_the_floor(models):
    target, drafter = models
    prompts = [encode_prompt(target.tokenizer, p) for p in PROMPTS]
    plain = generate(target, None, prompts, max_new_tokens=MAX_NEW_TOKENS)
    spec = generate(target, drafter, prompts, max_new_tokens=MAX_NEW_TOKENS)
    assert spec.tokens == plain.tokens
    print(f"tau {spec.tau:.2f}, acceptance lengths {spec.acceptance_lengths}")
    # Issue #12 asks for tau > 1.5 with a block-16 drafter. The shipped one drafts one token per
    # cycle (block 2, tau <= 2), the block that pays on this CPU; it measured tau 1.30 on these
    # prompts and 1.39 on MT-Bench (stage 6, block 2; stage 5: 1.34 and 1.39). The floor below is
    # what an untrained drafter (tau ~1.0) fails; the 1.5 is not reached yet.
    assert spec.tau > 1.2
    # What the CLIs run with this drafter: its slots filled from the text where it repeats (with
    # the stage-3 drafter tau 1.36 against 1.32 on these prompts), the output still plain greedy
    # decoding's.
    looked_up = generate(target, drafter, prompts, max_new_tokens=MAX_NEW_TOKENS, lookup=SHIPPED_DRAFTER_LOOKUP)
    assert looked_up.tokens == plain.tokens
    assert looked_up.tau > 1.2


def test_demo_streams_and_compares_with_the_shipped_drafter(capsys):
    """`make demo` end to end (one short prompt): streamed text, then the measured comparison."""
    from dflash_jax.cli import demo

    assert demo.main(["--prompt", PROMPTS[0], "--max-new-tokens", "16", "--no-compile-cache"]) == 0
    out = capsys.readouterr().out
    assert f"drafter: {SHIPPED_DRAFTER_DIR}" in out
    assert "Paris" in out  # the streamed answer
    assert "outputs         : identical" in out
    assert "tau             :" in out and "acceptance hist :" in out
    assert "as fast as autoregressive decoding" in out or "SLOWER than autoregressive" in out


def test_demo_verdict_names_slower_and_noise_plainly():
    """The demo's last line never presents a loss, or a difference inside the noise, as a speedup."""
    from dflash_jax.cli.demo import _verdict

    assert "SLOWER" in _verdict(0.80, 1.0)
    assert "about as fast" in _verdict(0.97, 1.3) and "not a speedup" in _verdict(1.03, 1.3)
    fast = _verdict(1.40, 2.1)
    assert fast.startswith("speculative decoding is 1.40x as fast") and "noise" not in fast
