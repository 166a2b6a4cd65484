"""A Qwen3-MoE whose MoE layers are not all of its layers: `mlp_only_layers` and `decoder_sparse_step`
give dense MLPs among the sparse ones, as transformers' `Qwen3MoeDecoderLayer` decides. The stack
groups the layers into scanned segments (`dflash_jax.models.stack`); the model equals
`Qwen3MoeForCausalLM` (logits, captured layers, greedy), and speculative decoding equals plain."""
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.engine.generator import generate
from dflash_jax.models.config import ModelConfig
from dflash_jax.models.stack import stack_segments
from support.tolerance import assert_model_close
from support.speculative import check_rejections_at_every_position, plain_greedy, tiny_drafter

# 4 layers: dense, MoE, MoE, dense -> three segments (a dense layer, two MoE layers scanned, a dense layer)
HF = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
          norm_topk_prob=True, max_position_embeddings=256, mlp_only_layers=[0, 3])


def test_dense_layers_are_read_from_mlp_only_layers_and_decoder_sparse_step():
    cfg = ModelConfig.from_hf_config({"architectures": ["Qwen3MoeForCausalLM"], **HF})
    assert cfg.mlp_kinds == ("dense", "moe", "moe", "dense")
    assert [(s.start, len(s.pattern), s.repeats) for s in stack_segments(cfg.layer_kinds)] == [(0, 1, 1), (1, 1, 2),
                                                                                               (3, 1, 1)]
    # transformers: layer i is sparse when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    stepped = ModelConfig.from_hf_config({"architectures": ["Qwen3MoeForCausalLM"], **HF, "mlp_only_layers": [],
                                          "decoder_sparse_step": 2})
    assert stepped.mlp_kinds == ("dense", "moe", "dense", "moe")
    assert [(s.start, len(s.pattern), s.repeats) for s in stack_segments(stepped.layer_kinds)] == [(0, 2, 2)]


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from dflash_jax import load_target

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**HF))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1 + 0.1 * torch.randn_like(p)) if "norm" in name else 0.3 * torch.randn_like(p))
    model.eval()
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == [
        "Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP"]
    directory = tmp_path_factory.mktemp("qwen3-moe-dense")
    model.save_pretrained(directory)
    return torch, model, load_target(directory, tokenizer=False)


def test_logits_captured_layers_and_greedy_equal_transformers(hf_pair):
    torch, model, target = hf_pair
    assert sorted(k for k in target.params if k.startswith("layers")) == ["layers_0", "layers_1", "layers_2"]
    ids = np.random.default_rng(1).integers(0, 96, size=(3, 24))
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids), output_hidden_states=True)
    hidden, features, _ = target.forward(target.params, jnp.asarray(ids, jnp.int32), capture=(0, 1, 2, 3))
    assert_model_close(np.asarray(target.logits(target.params, hidden)), out.logits.numpy(), target.config,
                       tokens=ids.shape[1])
    for j in range(3):  # the last layer's entry is after the final norm
        assert_model_close(np.asarray(features[..., j * 32:(j + 1) * 32]), out.hidden_states[j + 1].numpy(),
                           target.config, tokens=ids.shape[1], err_msg=f"layer {j}")
    prompt = [5, 17, 33, 2, 9]
    with torch.no_grad():
        expect = model.generate(torch.as_tensor([prompt]), attention_mask=torch.ones(1, 5, dtype=torch.long),
                                max_new_tokens=20, min_new_tokens=20, do_sample=False)[0, 5:].tolist()
    assert plain_greedy(target, prompt, 20) == expect
    drafter = tiny_drafter(target, block_size=4, seed=2)
    assert generate(target, drafter, [prompt], max_new_tokens=20, stop_token_ids=()).tokens == [expect]


@pytest.mark.slow  # make test-all; a dense prefix rolled back by default: the deepseek_v3 row's rejections
def test_speculative_greedy_with_rejections_at_every_position(hf_pair, monkeypatch):
    _, _, target = hf_pair
    rng = np.random.default_rng(2)
    prompts = [list(map(int, rng.integers(0, 40, size=n))) for n in (2, 11, 19)]
    check_rejections_at_every_position(target, tiny_drafter(target), prompts, 40, monkeypatch)
