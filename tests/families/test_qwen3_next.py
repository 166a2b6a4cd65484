"""Qwen3-Next targets (Qwen3-Coder-Next: the Qwen3.5 hybrid's layers, Qwen3-MoE's choice of MLP per layer),
what is theirs alone: the fused input projections of the Gated DeltaNet (`in_proj_qkvz`, `in_proj_ba`,
grouped per key head) against transformers' own split, their export back to the same bytes, the
multi-token prediction head left unread, the rollback of the recurrent state after a verify, the
config's defaults and refusals, the released shapes of the random benchmark target, a sharded load
and decode on 8 devices, and training a drafter for it. Parity with
transformers, the cached ragged prefill, greedy and speculative decoding are the conformance
suite's (test_family_conformance.py, the qwen3_next row of support/families.py)."""
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax._errors import CheckpointError, ConfigError
from dflash_jax.families.qwen3_next import fused_rows
from dflash_jax.models.config import LinearAttentionConfig, ModelConfig
from support import families
from support.tolerance import assert_model_close

ROW = families.FAMILIES["qwen3_next"]


def first_linear_layer(target):
    """The params of layer 0 (a linear one) of a stacked target: its segment's, at index 0."""
    from dflash_jax.models.stack import segment_path, stack_segments

    params = target.params
    for name in (*segment_path(stack_segments(target.config.layer_kinds), 0, 0), "linear_attn"):
        params = params[name]
    return jax.tree_util.tree_map(lambda x: np.asarray(x[0]), params)


# ---------------------------------------------------------------------------------------------
# The fused projections

def test_fused_projections_split_as_transformers_splits_them(tmp_path):
    """Our four projections of a loaded checkpoint give, on random inputs, the q, k, v, z, b and a that
    transformers' `fix_query_key_value_ordering` takes from its fused products (two value heads per key
    head, key and value heads of different widths). transformers' own parameters (experts fused too)
    load as save_pretrained's tensors do."""
    torch, _ = families.hf_modules("qwen3_next")
    from safetensors.torch import save_file

    from dflash_jax import load_target

    model = families.make_hf("qwen3_next", tmp_path / "saved")
    target = load_target(tmp_path / "saved", tokenizer=False, layout="stacked")
    state = {n: p.detach().contiguous() for n, p in model.state_dict().items()}
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in state)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "config.json").write_text((tmp_path / "saved" / "config.json").read_text())
    save_file(state, tmp_path / "state" / "model.safetensors", metadata={"format": "pt"})
    jax.tree_util.tree_map(np.testing.assert_array_equal,
                           load_target(tmp_path / "state", tokenizer=False, layout="stacked").params, target.params)
    cfg, lin = target.config, target.config.linear
    assert cfg.layer_types[0] == "linear_attention" and lin.num_value_heads == 2 * lin.num_key_heads
    hf_layer = model.model.layers[0].linear_attn
    x = np.random.default_rng(0).normal(size=(1, 7, cfg.hidden_size)).astype(np.float32)
    with torch.no_grad():
        xt = torch.as_tensor(x)
        want = [t.numpy() for t in hf_layer.fix_query_key_value_ordering(hf_layer.in_proj_qkvz(xt),
                                                                           hf_layer.in_proj_ba(xt))]
    params = first_linear_layer(target)
    ours = {proj: x @ params[proj]["kernel"] for proj in ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                          "in_proj_a")}
    qk = lin.num_key_heads * lin.key_head_dim
    qkv = ours["in_proj_qkv"]
    heads = (1, 7, -1)
    got = [qkv[..., :qk].reshape(*heads, lin.key_head_dim), qkv[..., qk:2 * qk].reshape(*heads, lin.key_head_dim),
           qkv[..., 2 * qk:].reshape(*heads, lin.value_head_dim), ours["in_proj_z"].reshape(*heads, lin.value_head_dim),
           ours["in_proj_b"], ours["in_proj_a"]]
    for name, g, w in zip("qkvzba", got, want):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0, err_msg=name)


@pytest.mark.parametrize("heads", [(2, 4, 8, 12), (2, 2, 8, 8), (1, 4, 4, 2), (16, 32, 128, 128)])
def test_fused_rows_cover_each_tensor_once(heads):
    """The rows our projections take of each fused tensor are each of its rows exactly once (so the
    export writes every byte back); for key head h, q_h starts its group."""
    hk, hv, dk, dv = heads
    rows = fused_rows(LinearAttentionConfig(num_key_heads=hk, num_value_heads=hv, key_head_dim=dk, value_head_dim=dv))
    for projs in (("in_proj_qkv", "in_proj_z"), ("in_proj_b", "in_proj_a")):
        total = rows[projs[0]].total
        assert all(rows[p].total == total for p in projs)
        np.testing.assert_array_equal(np.sort(np.concatenate([rows[p].index for p in projs])), np.arange(total))
    width = 2 * dk + 2 * (hv // hk) * dv
    assert rows["in_proj_qkv"].total == hk * width and rows["in_proj_b"].total == 2 * hv
    q_starts = np.asarray(rows["in_proj_qkv"].index[:hk * dk:dk])
    np.testing.assert_array_equal(q_starts, np.arange(hk) * width)


def _fused_by_reshape(params, lin):
    """The layer's in_proj_qkvz and in_proj_ba [out, in] built from our kernels [in, out] by reshapes alone
    (per key head: q, k, its value heads' v, their z; its value heads' b, their a)."""
    hk, r = lin.num_key_heads, lin.num_value_heads // lin.num_key_heads
    qk = hk * lin.key_head_dim
    qkv, z = params["in_proj_qkv"]["kernel"].T, params["in_proj_z"]["kernel"].T
    per_head = lambda w: w.reshape(hk, -1, w.shape[-1])  # noqa: E731
    qkvz = np.concatenate([per_head(qkv[:qk]), per_head(qkv[qk:2 * qk]), per_head(qkv[2 * qk:]), per_head(z)], axis=1)
    ba = np.concatenate([params["in_proj_b"]["kernel"].T.reshape(hk, r, -1),
                         params["in_proj_a"]["kernel"].T.reshape(hk, r, -1)], axis=1)
    return qkvz.reshape(-1, qkvz.shape[-1]), ba.reshape(-1, ba.shape[-1])


def save_tiny_dir(target, directory, extra=None) -> dict:
    """An HF directory of our tiny target (the row's config.json, its export plus `extra` tensors) -> the
    exported tensors."""
    from dflash_jax.formats.names import params_to_hf, target_rules
    from dflash_jax.formats.safetensors_io import save_safetensors

    cfg = target.config
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"architectures": [ROW.hf_class], **ROW.config,
                                                       **ROW.decode_overrides}))
    exported = params_to_hf(target_rules(cfg), target.params, cfg.num_layers)
    save_safetensors({**exported, **(extra or {})}, directory / "model.safetensors")
    return exported


def test_export_writes_the_fused_tensors_and_loads_back(tmp_path, caplog):
    """Without torch: our target's export holds the fused tensors (as the reshapes of `_fused_by_reshape`
    build them, no unfused name), a directory of them (with a multi-token prediction head, which is
    not read) loads back to the same params and exports the same bytes again; a tensor of no layer
    is refused."""
    from dflash_jax import load_target
    from dflash_jax.formats.names import params_to_hf, target_rules

    target = families.tiny_target("qwen3_next")
    cfg = target.config
    exported = params_to_hf(target_rules(cfg), target.params, cfg.num_layers)
    assert not any("in_proj_qkv." in n or "in_proj_z" in n or "in_proj_b." in n for n in exported)
    qkvz, ba = _fused_by_reshape(first_linear_layer(target), cfg.linear)
    np.testing.assert_array_equal(exported["model.layers.0.linear_attn.in_proj_qkvz.weight"], qkvz)
    np.testing.assert_array_equal(exported["model.layers.0.linear_attn.in_proj_ba.weight"], ba)

    mtp = {"mtp.fc.weight": np.ones((cfg.hidden_size, 2 * cfg.hidden_size), np.float32)}
    save_tiny_dir(target, tmp_path, mtp)
    with caplog.at_level(logging.INFO, logger="dflash_jax"):
        loaded = load_target(tmp_path, tokenizer=False, layout="stacked")
    assert "multi-token prediction" in caplog.text
    jax.tree_util.tree_map(np.testing.assert_array_equal, loaded.params, target.params)
    again = params_to_hf(target_rules(cfg), loaded.params, cfg.num_layers)
    assert sorted(again) == sorted(exported)
    for name, value in again.items():
        assert value.tobytes() == exported[name].tobytes(), name

    save_tiny_dir(target, tmp_path, {"model.extra.weight": np.ones((2, 2), np.float32)})
    with pytest.raises(CheckpointError, match="model.extra.weight"):
        load_target(tmp_path, tokenizer=False)


# ---------------------------------------------------------------------------------------------
# Rollback of the recurrent state

@pytest.mark.slow  # make test-all; by default the rollback of these layers: the qwen3_5_moe row's rejections
@pytest.mark.parametrize("variant", [families.DEFAULT, "dense-raw-topk"])
def test_verify_then_commit_equals_prefilling_the_accepted_prefix(variant):
    """A verify of an 8-token block (write_cache=False) committed with n accepted tokens, n = 0..8 on
    nine rows, leaves each row's cache (conv tails, delta-rule states, keys and values, lengths) as
    prefilling the prompt and the block's first n tokens does, and the next step's logits agree."""
    overrides = {k: v for k, v in ROW.variants[variant].items() if k != "multimodal"}
    target = families.tiny_target("qwen3_next", **overrides)
    rng = np.random.default_rng(4)
    prompt, block = rng.integers(0, 90, size=10), rng.integers(0, 90, size=8)
    rows = 9
    accepted = jnp.arange(rows, dtype=jnp.int32)
    tile = lambda x: jnp.asarray(np.tile(x, (rows, 1)), jnp.int32)  # noqa: E731
    _, _, cache = target.prefill(target.params, tile(prompt), target.init_cache(rows, 32))
    hidden, _, pending = target.forward(target.params, tile(block), cache, write_cache=False)
    committed = cache.commit(pending, accepted)
    ref_hidden, _, ref = target.prefill(target.params, tile(np.concatenate([prompt, block])),
                                        target.init_cache(rows, 32), num_new=10 + accepted)
    np.testing.assert_array_equal(np.asarray(committed.lengths), 10 + np.arange(rows))
    close = lambda got, want, what: assert_model_close(np.asarray(got), np.asarray(want), target.config,  # noqa: E731
                                                      tokens=18, err_msg=what)
    close(hidden, ref_hidden[:, 10:], "verify")
    close(committed.conv, ref.conv, "conv tails")
    close(committed.state, ref.state, "delta-rule states")
    for n in range(rows):  # the filled key/value slots of each row
        close(committed.kv.k[:, n, :10 + n], ref.kv.k[:, n, :10 + n], f"keys of row {n}")
        close(committed.kv.v[:, n, :10 + n], ref.kv.v[:, n, :10 + n], f"values of row {n}")
    nxt = jnp.asarray(rng.integers(0, 90, size=(rows, 1)), jnp.int32)
    step, _, _ = target.forward(target.params, nxt, committed)
    ref_step, _, _ = target.forward(target.params, nxt, ref)
    close(target.logits(target.params, step), target.logits(target.params, ref_step), "next step")


# ---------------------------------------------------------------------------------------------
# Config

RELEASED = {  # Qwen3-Next-80B-A3B-Instruct's config.json, as released (flat, rope fields at the top level)
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "hidden_act": "silu", "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "full_attention_interval": 4, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_experts": 512,
    "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True, "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_scaling": None,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "router_aux_loss_coef": 0.001, "output_router_logits": False,
    "use_sliding_window": False, "attention_bias": False, "torch_dtype": "bfloat16"}


def test_config_reads_the_released_fields_and_transformers_defaults():
    cfg = ModelConfig.from_hf_config(RELEASED)
    assert (cfg.arch, cfg.rotary_dim, cfg.rope_theta, cfg.moe.num_experts, cfg.moe.num_experts_per_tok,
            cfg.moe.shared_expert_intermediate_size, cfg.moe.norm_topk_prob, cfg.moe.dense_layers) == (
        "qwen3_next", 64, 1e7, 512, 10, 512, True, ())
    assert cfg.attention_layer_ids == tuple(range(3, 48, 4))
    # where config.json is silent, Qwen3NextConfig's defaults (a 256-wide head, a quarter rotated)
    silent = {k: v for k, v in RELEASED.items() if k not in ("head_dim", "partial_rotary_factor", "norm_topk_prob")}
    cfg = ModelConfig.from_hf_config(silent)
    assert (cfg.head_dim, cfg.rotary_dim, cfg.moe.norm_topk_prob) == (256, 64, True)
    # transformers 5's rope_parameters hold the factor
    moved = {**silent, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}}
    assert ModelConfig.from_hf_config(moved).rotary_dim == 128
    # dense MLPs: mlp_only_layers and decoder_sparse_step as transformers decides; no experts: all dense
    cfg = ModelConfig.from_hf_config({**RELEASED, "mlp_only_layers": [0], "decoder_sparse_step": 2,
                                      "norm_topk_prob": False})
    assert cfg.moe.dense_layers == (0,) + tuple(range(2, 48, 2)) and not cfg.moe.norm_topk_prob
    assert ModelConfig.from_hf_config({**RELEASED, "num_experts": 0}).mlp_kinds == ("dense",) * 48
    assert ModelConfig.from_hf_config({**RELEASED, "hidden_act": None}).arch == "qwen3_next"  # null: absent


@pytest.mark.parametrize("change, match", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step"),
    (dict(num_hidden_layers=4, layer_types=["linear_attention", "sliding_attention", "linear_attention",
                                            "full_attention"], sliding_window=8), "sliding_attention"),
    (dict(num_experts_per_tok=600), "num_experts_per_tok"),
])
def test_config_refuses_what_qwen3_next_cannot_hold(change, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_config({**RELEASED, **change})


# ---------------------------------------------------------------------------------------------
# The random benchmark target

def test_random_benchmark_target_has_the_released_shapes():
    """`--random-target qwen3-coder-next`: the released shapes; cut to 8 layers, its params' shapes
    (not drawn: 512 experts a layer) hold the fused tensors' rows, and every weight has a sharding
    rule on a tensor axis of 4 and an expert axis of 8."""
    from dflash_jax.cli.bench_random import random_configs
    from dflash_jax.formats.names import target_rules
    from dflash_jax.models.target import target_param_shapes
    from dflash_jax.sharding import param_spec

    config, drafter = random_configs("qwen3-coder-next", None, None)
    assert (config.arch, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.head_dim, config.vocab_size, config.rotary_dim) == ("qwen3_next", 48, 2048, 16, 2, 256, 151936, 64)
    assert (config.num_experts, config.moe.num_experts_per_tok, config.moe.intermediate_size,
            config.moe.shared_expert_intermediate_size, config.moe.norm_topk_prob) == (512, 10, 512, 512, True)
    assert (config.linear.num_key_heads, config.linear.num_value_heads, config.linear.key_head_dim,
            config.linear.value_head_dim) == (16, 32, 128, 128)
    assert config.attention_layer_ids == tuple(range(3, 48, 4))
    assert drafter.intermediate_size == 5120 and drafter.target_layer_ids == (1, 12, 23, 34, 45)

    config, _ = random_configs("qwen3-coder-next", 8, None)
    shapes = target_param_shapes(config, jnp.bfloat16)
    linear = shapes["layers"]["layer_0"]["linear_attn"]
    assert linear["in_proj_qkv"]["kernel"].shape == (2, 2048, 8192)
    assert linear["in_proj_z"]["kernel"].shape == (2, 2048, 4096)
    assert shapes["layers"]["layer_3"]["mlp"]["gate_proj"].shape == (2, 512, 2048, 512)
    rows = {r.hf.rsplit(".", 2)[-2]: r.rows.total for r in target_rules(config) if r.rows}
    assert rows == {"in_proj_qkvz": 12288, "in_proj_ba": 64}
    for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
        param_spec(path, leaf.shape, config, tensor=4, expert=8)


# ---------------------------------------------------------------------------------------------
# On a mesh (8 CPU devices in a subprocess, `support.devices.run_8_devices`)

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79]]


MESHES = {"data4_tensor2": dict(data=4, tensor=2), "data2_expert2_tensor2": dict(data=2, expert=2, tensor=2)}


def sharded_run(out: str, tmp: str) -> None:
    """The tiny target exported, then on each of `MESHES`: loaded shard by shard (the fused rows read
    per device block) and decoded greedily -> `out`: one device's tokens and, per mesh, whether the
    placed params equal one device's, whether the Gated DeltaNet's and the experts' weights are split,
    and the tokens."""
    from pathlib import Path

    from dflash_jax import load_target, sharding
    from dflash_jax.engine.generator import Generator

    target = families.tiny_target("qwen3_next")
    directory = Path(tmp)
    save_tiny_dir(target, directory)
    found = {"one_device": Generator(target, None, backend="xla").generate(PROMPTS, max_new_tokens=12,
                                                                            stop_token_ids=()).tokens}
    split = lambda tree: any(any(entry is not None for entry in leaf.sharding.spec)  # noqa: E731
                             for leaf in jax.tree_util.tree_leaves(tree))
    for name, sizes in MESHES.items():
        mesh = sharding.make_mesh(**sizes)
        loaded = load_target(directory, tokenizer=False, mesh=mesh)
        layer = loaded.params["layers"]["layer_0"]
        found[name] = {
            "same_params": jax.tree_util.tree_all(jax.tree_util.tree_map(
                lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), loaded.params, target.params)),
            "linear_split": split(layer["linear_attn"]),
            "experts_split": [list(layer["mlp"][p].sharding.spec) + [None] * (4 - len(layer["mlp"][p].sharding.spec))
                              for p in ("gate_proj", "down_proj")],
            "tokens": Generator(loaded, None, mesh=mesh).generate(PROMPTS, max_new_tokens=12,
                                                                  stop_token_ids=()).tokens}
    Path(out).write_text(json.dumps(found))


@pytest.mark.slow  # make test-all; by default the Qwen3.5 layers' 8-device run: test_sharded_generate
def test_sharded_load_and_greedy_decoding_equal_one_device():
    """On 8 devices (data 4 x tensor 2; data 2 x expert 2 x tensor 2): the fused tensors load shard by
    shard to one device's params, the Gated DeltaNet's weights split over `tensor`, the experts over
    `expert` (where it is in the mesh) and their width over `tensor`, and greedy decoding gives one
    device's tokens."""
    from support.devices import run_8_devices

    found = run_8_devices("sharded_run({out}, {tmp})", "test_qwen3_next")
    for name in MESHES:
        case = found[name]
        assert case["same_params"] and case["linear_split"], name
        assert case["tokens"] == found["one_device"], name
    # gate_proj [L, E, D, I], down_proj [L, E, I, D]
    assert found["data2_expert2_tensor2"]["experts_split"] == [[None, "expert", None, "tensor"],
                                                               [None, "expert", "tensor", None]]


# ---------------------------------------------------------------------------------------------
# Training a drafter for it

def _train_config(target_dir, data, out_dir, **data_extra):
    from train.config import config_from_dict

    return config_from_dict({
        "model": {"target": str(target_dir), "num_layers": 1, "intermediate_size": 32, "block_size": 4,
                  "target_layer_ids": [0, 3], "mask_token_id": ROW.config["vocab_size"] - 1},
        "data": {"path": str(data), "max_length": 32, "batch_size": 4, "seed": 3, **data_extra},
        "optim": {"learning_rate": 3e-3, "warmup_ratio": 0.05},
        "run": {"out_dir": str(out_dir), "steps": 2, "num_anchors": 4, "log_every": 1, "checkpoint_every": 2,
                "async_checkpointing": False, "shard_target": True}})


@pytest.mark.slow  # make test-all: the training path is every target's, run by default in test_moe_train
def test_cache_features_and_training_online_and_offline(tmp_path):
    """`train.cache_features` stores the target's features as a forward computes them at every real
    position of ragged rows; `train.train` runs from the feature cache (offline) and from the target's
    checkpoint directory (online)."""
    from dflash_jax import load_target
    from train.cache_features import cache_features
    from train.data import DataConfig, load_token_records, make_iterator
    from train.train import train

    save_tiny_dir(families.tiny_target("qwen3_next"), tmp_path / "target")
    target = load_target(tmp_path / "target", tokenizer=False)
    rng = np.random.default_rng(6)
    with open(tmp_path / "train.jsonl", "w") as f:
        for n in rng.integers(12, 32, size=8):
            f.write(json.dumps({"tokens": rng.integers(0, 90, size=int(n)).tolist(),
                                "loss_mask": [0] * 4 + [1] * (int(n) - 4)}) + "\n")
    records = load_token_records(tmp_path / "train.jsonl", None, 32)
    layers = (0, 3)
    cache_features(target, records, tmp_path / "cache", layers, batch_size=4, buckets=(32,), progress=False)
    forward = jax.jit(lambda params, tokens: target.forward(params, tokens, capture=layers))
    config = DataConfig(str(tmp_path / "cache"), max_length=32, batch_size=4, buckets=(32,), num_epochs=1)
    batch = next(iter(make_iterator(config, process_index=0, process_count=1)))
    _, online, _ = forward(target.params, batch["tokens"])
    for row, n in enumerate(batch["lengths"]):
        np.testing.assert_allclose(batch["features"][row, :n].astype(np.float32), np.asarray(online[row, :n]),
                                   rtol=1e-2, atol=1e-2)
    offline = train(_train_config(tmp_path / "target", tmp_path / "cache", tmp_path / "offline", buckets=[32]),
                    target=target)
    online_run = train(_train_config(tmp_path / "target", tmp_path / "train.jsonl", tmp_path / "online"))
    for last in (offline, online_run):
        assert last["step"] == 2 and np.isfinite(last["loss"])
