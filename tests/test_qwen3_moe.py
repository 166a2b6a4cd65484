"""Qwen3-MoE targets: the grouped expert matmul against a per-expert loop, parity with transformers'
Qwen3MoeForCausalLM, lossless speculative decoding with rejections at every block position, and
sampling."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from dflash_jax import _moe as moe
from dflash_jax._config import ModelConfig, MoEConfig
from dflash_jax._speculative import generate
from dflash_jax._target import Target, init_target_params
from support.tolerance import assert_model_close
from test_qwen3_5 import check_rejections_at_every_position, check_sampling_lossless, plain_greedy, tiny_drafter

HF = dict(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
          max_position_embeddings=256)


@pytest.mark.parametrize("form", ["auto", *moe.FORMS])
@pytest.mark.parametrize("n", [2, 13])
def test_grouped_experts_equal_a_loop_over_experts(n, form):
    """Every form, for fewer (token, expert) pairs than experts and more: the chosen experts'
    weights gathered, `ragged_dot` over the pairs sorted by expert, and "auto"
    (this platform's choice)."""
    rng = np.random.default_rng(0)
    d, i, e, k = 8, 6, 5, 2
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    gate, up = (jnp.asarray(rng.normal(size=(e, d, i)), jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.normal(size=(e, i, d)), jnp.float32)
    weights, experts = moe.route(jnp.asarray(rng.normal(size=(n, e)), jnp.float32), k, True)
    np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-6)
    got = moe.grouped_experts(x, experts, weights, gate, up, down, form=form)
    want = np.zeros((n, d), np.float32)
    for t in range(n):
        for j in range(k):
            ex = int(experts[t, j])
            h = jax.nn.silu(x[t] @ gate[ex]) * (x[t] @ up[ex])
            want[t] += float(weights[t, j]) * np.asarray(h @ down[ex])
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=[True, False], ids=["norm-topk", "raw-topk"])
def hf_pair(request, tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from dflash_jax import load_target

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**HF, norm_topk_prob=request.param))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1 + 0.1 * torch.randn_like(p)) if "norm" in name else 0.1 * torch.randn_like(p))
    model.eval()
    directory = tmp_path_factory.mktemp("qwen3-moe")
    model.save_pretrained(directory)  # per-expert tensors, as the released checkpoints hold them
    return torch, model, load_target(directory, tokenizer=False)


def test_logits_captured_layers_and_cached_rows_equal_transformers(hf_pair):
    torch, model, target = hf_pair
    assert target.config.num_experts == 8
    ids = np.random.default_rng(1).integers(0, 96, size=(3, 40))
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids), output_hidden_states=True)
    hidden, features, _ = target.forward(target.params, jnp.asarray(ids, jnp.int32), capture=(0, 1, 2))
    assert_model_close(np.asarray(target.logits(target.params, hidden)), out.logits.numpy(),
                       target.config, tokens=ids.shape[1])
    for j in range(3):
        assert_model_close(np.asarray(features[..., j * 32:(j + 1) * 32]), out.hidden_states[j + 1].numpy(),
                           target.config, tokens=ids.shape[1])
    # right-padded rows through the cache: each row's logits as alone
    lengths = [40, 17, 3]
    cached, _, _ = target.prefill(target.params, jnp.asarray(ids, jnp.int32), target.init_cache(3, 64),
                                  num_new=jnp.asarray(lengths))
    for row, n in enumerate(lengths):
        assert_model_close(np.asarray(target.logits(target.params, cached[row, :n])), out.logits.numpy()[row, :n],
                           target.config, tokens=ids.shape[1])
    prompt = [5, 17, 33, 2, 9]
    with torch.no_grad():
        expect = model.generate(torch.as_tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                pad_token_id=0)[0, len(prompt):].tolist()
    assert generate(target, None, [prompt], max_new_tokens=16, stop_token_ids=()).tokens[0] == expect


def tiny_moe(seed=0, vocab=48, scale=3.0):
    cfg = ModelConfig(arch="qwen3_moe", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                      moe=MoEConfig(num_experts=8, num_experts_per_tok=2, intermediate_size=16, norm_topk_prob=True))
    params = init_target_params(cfg, jax.random.PRNGKey(seed))
    return Target(cfg, jax.tree_util.tree_map(lambda x: x * scale if x.ndim >= 2 else x, params))


def test_speculative_greedy_with_rejections_at_every_position(monkeypatch):
    target = tiny_moe()
    rng = np.random.default_rng(2)
    prompts = [list(map(int, rng.integers(0, 40, size=n))) for n in (2, 11, 19)]
    check_rejections_at_every_position(target, tiny_drafter(target), prompts, 40, monkeypatch)


def test_speculative_greedy_with_a_random_drafter_equals_plain_decoding():
    target = tiny_moe(seed=1)
    drafter = tiny_drafter(target, block_size=4, seed=2)
    prompts = [[3, 9, 4], [7, 1, 2, 5, 8, 6, 11, 30], [12]]
    result = generate(target, drafter, prompts, max_new_tokens=30, stop_token_ids=())
    assert result.tokens == [plain_greedy(target, p, 30) for p in prompts]


def test_speculative_sampling_keeps_the_moe_targets_distribution():
    from test_sampling import V

    target = tiny_moe(seed=3, vocab=V + 1, scale=1.0)
    check_sampling_lossless(target, tiny_drafter(target, block_size=4, seed=5))
