"""Qwen3.5-MoE / Qwen3.6-MoE targets (the Qwen3.5 hybrid whose every MLP is an MoE block with a
sigmoid-gated shared expert): parity with transformers' Qwen3_5MoeForCausalLM and the text model of
Qwen3_5MoeForConditionalGeneration, loading (per-expert tensors as save_pretrained writes them, fused
ones as released, and the name table's export), lossless speculative decoding with rejections at every
block position, and sampling. Only the parity and loading tests need torch."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax._config import LinearAttentionConfig, ModelConfig, MoEConfig
from dflash_jax._errors import ConfigError
from dflash_jax._speculative import generate
from dflash_jax._target import Target, init_target_params
from support.tolerance import assert_model_close
from test_qwen3_5 import check_rejections_at_every_position, check_sampling_lossless, tiny_drafter


def _hf():
    """(torch, transformers), or a skip (the jax-latest leg has no torch)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3_5MoeForCausalLM"):
        pytest.skip("this transformers has no Qwen3_5Moe")
    return torch, transformers


TEXT = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12,
            shared_expert_intermediate_size=20, rms_norm_eps=1e-6, max_position_embeddings=512)
VARIANTS = {
    # Qwen3.5-MoE's default pattern (3 linear, 1 full); GQA 2:1 in both kinds of layer
    "causal-lm": dict(kind="causal", text={}),
    # the text model of a multimodal checkpoint (its vision tower is not read): every other layer
    # full, 3 experts per token, tied head
    "conditional-generation": dict(kind="conditional", text=dict(full_attention_interval=2, num_experts_per_tok=3,
                                                                 tie_word_embeddings=True)),
}


def make_hf(kind, text, out_dir, seed=0):
    torch, transformers = _hf()
    torch.manual_seed(seed)
    text = {**TEXT, **text}
    if kind == "conditional":
        config = transformers.Qwen3_5MoeConfig(
            text_config=text, tie_word_embeddings=text.get("tie_word_embeddings", False),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32))
        model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    else:
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**text))
    with torch.no_grad():  # every weight random; the routers' wider, so that their logits spread
        for name, p in model.named_parameters():
            p.copy_((0.1 if "norm" in name else 0.08) * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.mul_(5.0)
            if "A_log" in name:
                p.uniform_(-2.0, 1.0)
    model.eval()
    model.save_pretrained(out_dir)  # per-expert tensors: what transformers writes for this class
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def hf_pair(request, tmp_path_factory):
    from dflash_jax import load_target

    variant = VARIANTS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    model = make_hf(variant["kind"], variant["text"], directory)
    return model, load_target(directory, tokenizer=False), directory


def hf_outputs(model, ids):
    """(logits, hidden states, the smallest gap between a router's k-th and (k+1)-th largest logit
    over every token and layer: where it is far above float32 rounding, both sides choose the same
    experts)."""
    torch, _ = _hf()
    gaps = []

    def router_gap(module, args, out):
        logits = out[0].float().sort(-1, descending=True).values
        gaps.append(float((logits[:, module.top_k - 1] - logits[:, module.top_k]).min()))

    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    hooks = [m.register_forward_hook(router_gap) for m in routers]
    try:
        with torch.no_grad():
            out = model(input_ids=torch.as_tensor(ids), output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    assert len(gaps) == len(routers)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states], min(gaps)


def test_logits_and_captured_layers_of_padded_cached_rows_equal_transformers(hf_pair):
    """Right-padded rows through the cached prefill (100 tokens: two chunks of the chunked delta rule,
    the experts as `ragged_dot`, each row's recurrent state stopping at its own length) give each
    row's logits and captured layers (both kinds, and the last) alone; the next cached step (one
    token per row: the gathered-experts form) continues them."""
    model, target, _ = hf_pair
    cfg = target.config
    assert cfg.arch == "qwen3_5_moe" and cfg.num_experts == 8 and cfg.moe.shared_expert_intermediate_size == 20
    rng = np.random.default_rng(1)
    lengths = [100, 41, 5]
    ids = rng.integers(0, cfg.vocab_size, size=(3, 101))
    capture = (0, cfg.num_layers - 3, cfg.num_layers - 1)
    hidden, features, cache = target.prefill(target.params, jnp.asarray(ids[:, :100], jnp.int32),
                                             target.init_cache(3, 128), capture=capture, num_new=jnp.asarray(lengths))
    assert list(np.asarray(cache.lengths)) == lengths
    nxt = ids[np.arange(3), lengths]
    step, _, _ = target.forward(target.params, jnp.asarray(nxt[:, None], jnp.int32), cache)
    d = cfg.hidden_size
    for row, n in enumerate(lengths):
        logits, hidden_states, gap = hf_outputs(model, np.concatenate([ids[row, :n], nxt[row:row + 1]])[None])
        assert gap > 1e-4  # no top-k choice that float rounding could flip
        assert_model_close(np.asarray(target.logits(target.params, hidden[row, :n])), logits[0, :n],
                           target.config, tokens=ids.shape[1])
        assert_model_close(np.asarray(target.logits(target.params, step[row, 0])), logits[0, n],
                           target.config, tokens=ids.shape[1])
        for j, layer in enumerate(capture):
            assert_model_close(np.asarray(features[row, :n, j * d:(j + 1) * d]), hidden_states[layer + 1][0, :n],
                               target.config, tokens=ids.shape[1], err_msg=f"row {row}, layer {layer}")


@pytest.mark.parametrize("hf_pair", ["causal-lm"], indirect=True)
def test_speculative_greedy_with_a_random_drafter_equals_transformers_generate(hf_pair):
    """Ragged prompts decoded speculatively with a random drafter (drafts rejected at every kind of
    place, the state rolled back each cycle) give transformers' greedy generate of each prompt."""
    model, target, _ = hf_pair
    torch, _ = _hf()
    rng = np.random.default_rng(6)
    prompts = [list(map(int, rng.integers(0, 90, size=n))) for n in (1, 6, 13)]
    with torch.no_grad():
        expect = [model.generate(torch.as_tensor([p]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                 pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    drafter = tiny_drafter(target, block_size=4, seed=3)
    assert generate(target, drafter, prompts, max_new_tokens=24, stop_token_ids=()).tokens == expect


def test_fused_experts_and_the_exported_names_load_the_same(hf_pair, tmp_path, caplog):
    """The released checkpoints hold each layer's experts fused (`mlp.experts.gate_up_proj` [E, 2I, D],
    `mlp.experts.down_proj` [E, D, I]: transformers' own parameters): they load to the same params as
    save_pretrained's per-expert tensors. The name table's export (`params_to_hf`) gives back
    save_pretrained's tensors bit for bit, and the vision tower is not read."""
    import logging
    import shutil

    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    from dflash_jax import load_target
    from dflash_jax.loading.names import params_to_hf, target_rules

    model, target, directory = hf_pair
    saved = load_file(directory / "model.safetensors")
    prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in saved) else "model."
    exported = params_to_hf(target_rules(target.config, prefix), target.params, target.config.num_layers)
    text = {n: v for n, v in saved.items() if not n.startswith("model.visual.")}
    if target.config.tie_word_embeddings:
        text.pop("lm_head.weight", None)
    assert sorted(exported) == sorted(text)
    for name, value in exported.items():
        np.testing.assert_array_equal(value, text[name], err_msg=name)

    state = {n: p.detach().contiguous() for n, p in model.state_dict().items()}
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in state)
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(directory / "config.json", fused / "config.json")
    if target.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="dflash_jax"):
        loaded = load_target(fused, tokenizer=False)
    assert ("vision tower" in caplog.text) == (prefix == "model.language_model.")
    jax.tree_util.tree_map(np.testing.assert_array_equal, loaded.params, target.params)


def test_config_reads_the_text_config_and_refuses_a_bad_one():
    hf = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
          "tie_word_embeddings": False,
          "text_config": {**TEXT, "model_type": "qwen3_5_moe_text",
                          "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                              "mrope_section": [11, 11, 10]}}}
    cfg = ModelConfig.from_hf_config(hf)
    assert (cfg.arch, cfg.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.intermediate_size) == ("qwen3_5_moe", 8,
                                                                                                     2, 12)
    assert cfg.moe.shared_expert_intermediate_size == 20 and cfg.moe.norm_topk_prob and cfg.is_hybrid_arch
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) and cfg.rotary_dim == 4
    bad = {**hf, "text_config": {**hf["text_config"], "num_experts_per_tok": 9}}
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelConfig.from_hf_config(bad)
    fields = _tiny_config_fields()
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        ModelConfig(**{**fields, "moe": dataclasses.replace(fields["moe"], shared_expert_intermediate_size=0)})
    with pytest.raises(ValueError, match="norm_topk_prob"):
        ModelConfig(**{**fields, "moe": dataclasses.replace(fields["moe"], norm_topk_prob=False)})


def test_random_benchmark_target_has_the_released_shapes():
    from dflash_jax.cli.bench_random import random_configs

    config, drafter = random_configs("qwen3.5-35b-a3b", None, None)
    assert (config.arch, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
            config.vocab_size, config.rotary_dim) == ("qwen3_5_moe", 40, 2048, 16, 2, 256, 248320, 64)
    assert (config.num_experts, config.moe.num_experts_per_tok, config.moe.intermediate_size,
            config.moe.shared_expert_intermediate_size) == (256, 8, 512, 512)
    assert (config.linear.num_key_heads, config.linear.num_value_heads, config.linear.key_head_dim,
            config.linear.value_head_dim) == (16, 32, 128, 128)
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",) + config.layer_types[4:]
    assert config.attention_layer_ids == tuple(range(3, 40, 4))
    assert drafter.intermediate_size == 6144 and drafter.target_layer_ids == (1, 10, 19, 28, 37)


# ---------------------------------------------------------------------------------------------
# Speculative decoding on one tiny target (of test_sampling's vocabulary, for the exact joint) and
# one drafter, so that the tests share their compiled programs

def _tiny_config_fields(vocab=48, layer_types=("linear_attention", "full_attention") * 2):
    return dict(arch="qwen3_5_moe", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=len(layer_types),
                num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, partial_rotary_factor=0.25,
                layer_types=layer_types,
                linear=LinearAttentionConfig(conv_kernel_dim=4, num_key_heads=2, num_value_heads=4, key_head_dim=8,
                                             value_head_dim=8),
                moe=MoEConfig(num_experts=8, num_experts_per_tok=2, intermediate_size=16,
                              shared_expert_intermediate_size=24, norm_topk_prob=True))


@pytest.fixture(scope="module")
def tiny_pair():
    """(target, drafter of block 8, ragged prompts)."""
    from test_sampling import V

    cfg = ModelConfig(**_tiny_config_fields(vocab=V + 1))
    params = init_target_params(cfg, jax.random.PRNGKey(3))
    target = Target(cfg, jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, params))  # sharper logits
    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(0, V, size=n))) for n in (3, 9, 20)]
    return target, tiny_drafter(target, block_size=8, seed=5), prompts


def test_speculative_greedy_with_rejections_at_every_position(tiny_pair, monkeypatch):
    """The recurrent state rolled back at every position of an 8-token block, three ragged rows
    (`check_rejections_at_every_position`): the verifies run the experts as `ragged_dot`, the plain
    reference's steps as gathered experts."""
    target, drafter, prompts = tiny_pair
    check_rejections_at_every_position(target, drafter, prompts, 40, monkeypatch)


@pytest.mark.slow  # make test-all: the hybrid's sampling (test_qwen3_5) and the MoE's (test_qwen3_moe) run by default
def test_speculative_sampling_keeps_the_targets_distribution(tiny_pair):
    target, drafter, _ = tiny_pair
    check_sampling_lossless(target, drafter)
