"""Qwen3.5-MoE / Qwen3.6-MoE targets (the Qwen3.5 hybrid whose every MLP is an MoE block with a
sigmoid-gated shared expert), what is theirs alone: fused experts as released load as
save_pretrained's per-expert tensors, the text config of a multimodal config.json and its refusals,
and the released shapes of the random benchmark target. Parity with transformers, cached ragged
prefill, the export's round trip, speculative decoding with rejections and sampling are the
conformance suite's (test_family_conformance.py, the qwen3_5_moe row of support/families.py)."""
import jax
import numpy as np
import dataclasses

import pytest

from dflash_jax._errors import ConfigError
from dflash_jax.models.config import LinearAttentionConfig, ModelConfig, MoEConfig
from support import families

TEXT = families.QWEN3_5_MOE
ROW = families.FAMILIES["qwen3_5_moe"]


@pytest.mark.parametrize("variant", list(ROW.variants))
def test_fused_experts_load_as_the_per_expert_tensors(variant, tmp_path, caplog):
    """The released checkpoints hold each layer's experts fused (`mlp.experts.gate_up_proj` [E, 2I, D],
    `mlp.experts.down_proj` [E, D, I]: transformers' own parameters): they load to the same params as
    save_pretrained's per-expert tensors, and a multimodal checkpoint's vision tower is not read."""
    import logging

    pytest.importorskip("torch")  # the jax-latest leg has none

    from safetensors.torch import save_file

    from dflash_jax import load_target

    directory = tmp_path / "per-expert"
    model = families.make_hf("qwen3_5_moe", directory, variant=variant)  # per-expert tensors, as transformers writes
    target = load_target(directory, tokenizer=False)
    state = {n: p.detach().contiguous() for n, p in model.state_dict().items()}
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in state)
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((directory / "config.json").read_text())
    if target.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="dflash_jax"):
        loaded = load_target(fused, tokenizer=False)
    assert ("vision tower" in caplog.text) == ROW.multimodal(variant)
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


def _tiny_config_fields(vocab=48, layer_types=("linear_attention", "full_attention") * 2):
    return dict(arch="qwen3_5_moe", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=len(layer_types),
                num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, partial_rotary_factor=0.25,
                layer_types=layer_types,
                linear=LinearAttentionConfig(conv_kernel_dim=4, num_key_heads=2, num_value_heads=4, key_head_dim=8,
                                             value_head_dim=8),
                moe=MoEConfig(num_experts=8, num_experts_per_tok=2, intermediate_size=16,
                              shared_expert_intermediate_size=24, norm_topk_prob=True))
