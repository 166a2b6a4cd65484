"""Parity of the target model against Hugging Face transformers on tiny random models."""
import numpy as np
import pytest
import jax.numpy as jnp

torch = pytest.importorskip("torch")

from dflash_jax.loading.target_loader import load_target  # noqa: E402
from tiny_models import make_hf_model  # noqa: E402

CASES = {
    "qwen3": ("qwen3", {}),
    "qwen3-sliding-yarn": ("qwen3", dict(
        layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=5, use_sliding_window=True,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "rope_theta": 10000.0})),
    "llama": ("llama", {}),
    "llama3-rope": ("llama", dict(rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 500000.0})),
}


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / (np.abs(b).max() + 1e-12)


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    kind, overrides = CASES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(kind, d, **overrides)
    return hf, d


def test_logits_and_hidden_states_f32(pair):
    hf, d = pair
    target = load_target(d, "float32")
    tokens = np.random.default_rng(0).integers(0, 128, size=(2, 24))
    with torch.no_grad():
        out = hf(torch.tensor(tokens), output_hidden_states=True)
    last = target.config.num_layers - 1
    capture = (1, 0, 1, last)  # any order, repeats, and the last layer (post-norm in HF)
    hidden, feats, _ = target.forward(target.params, jnp.asarray(tokens), capture=capture)
    logits = target.logits(target.params, hidden)
    assert rel_err(logits, out.logits.numpy()) <= 1e-5
    want = np.concatenate([out.hidden_states[i + 1].numpy() for i in capture], -1)
    assert feats.shape == want.shape
    assert rel_err(feats, want) <= 1e-5


def test_bf16_close(pair):
    hf, d = pair
    target = load_target(d, "bfloat16")
    tokens = np.random.default_rng(1).integers(0, 128, size=(1, 16))
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    hidden, _, _ = target.forward(target.params, jnp.asarray(tokens))
    logits = np.asarray(target.logits(target.params, hidden))
    assert rel_err(logits, want) <= 3e-2
