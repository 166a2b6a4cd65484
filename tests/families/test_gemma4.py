"""Gemma 4 targets, what is theirs alone: the config as released and as transformers 5 saves it (per-layer
shapes), the proportional RoPE, the layer scalars, the softcapped logits as the distribution that sampling
draws from (slow), the weights' sharding declarations and the config's refusals, kv heads copied per layer kind on a
tensor axis (and, slow, greedy generation on tensor axes of 8 and 2 equal to one device's), and (slow) drafter
training with a Gemma 4 target: the features it reads and a short run's falling loss.
Parity with transformers (sliding and full layers of their own shapes, k=v, per-layer inputs, kv sharing,
the MoE block, a multimodal checkpoint's text model), the cached ragged prefill, greedy and speculative
decoding against transformers' generate, the export's round trip, rejections at every block position,
sampling and the decode step's HLO (on a target with per-layer inputs and kv-shared layers) are the
conformance suite's (test_family_conformance.py, the gemma4 row of support/families.py)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax._errors import ConfigError
from dflash_jax.models.config import ModelConfig
from support import families
from support.tolerance import assert_model_close

HF = {"architectures": ["Gemma4ForCausalLM"], **families.GEMMA4}
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}}


def _config(**overrides) -> ModelConfig:
    return ModelConfig.from_hf_config({**HF, **overrides})


def test_a_released_multimodal_config_reads_as_its_text_model():
    """gemma-4-26B-A4B-it's config.json shape (text_config under Gemma4ForConditionalGeneration; the 5:1
    layer rule; global head and kv-head fields; the MoE block): two KV groups of their own shapes, the
    sliding layers' RoPE as the config's, the full layers' in its options, the softcap, the experts."""
    from dflash_jax.cli.bench_random import RANDOM_TARGETS

    text = {k: v for k, v in RANDOM_TARGETS["gemma-4-26b-a4b"][0].items() if k not in ("architectures",)}
    text["num_hidden_layers"] = 12
    text["hidden_size_per_layer_input"] = None  # as one release states it: no per-layer inputs
    cfg = ModelConfig.from_hf_config({"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
                                      "eos_token_id": [1, 106], "text_config": text})
    assert cfg.arch == "gemma4" and cfg.eos_token_ids == (1, 106)
    assert cfg.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 2
    assert [(shape, ids) for shape, ids in cfg.kv_groups] == [((8, 256), (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)),
                                                            ((2, 512), (5, 11))]
    assert (cfg.rope_theta, cfg.rope["rope_type"], cfg.sliding_window) == (10000.0, "default", 1024)
    opts = cfg.family_options
    assert (opts.global_rope_theta, dict(opts.global_rope)) == (
        1000000.0, {"rope_type": "proportional", "partial_rotary_factor": 0.25})
    assert opts.attention_k_eq_v and cfg.final_logit_softcapping == 30.0 and cfg.tie_word_embeddings
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.intermediate_size) == (128, 8, 704)
    assert cfg.family.embedding_scale(cfg) == 2816 ** 0.5
    assert opts.hidden_size_per_layer_input == 0 and opts.num_kv_shared_layers == 0


@pytest.mark.parametrize("name", ["gemma-4-31b", "gemma-4-26b-a4b"])
def test_random_target_presets_have_the_released_shapes(name):
    """`--random-target gemma-4-31b` / `gemma-4-26b-a4b` cut to 2 layers: a sliding and a full layer of the
    released shapes (weights' shapes only, nothing drawn), and their KV cache's groups."""
    from dflash_jax.cli.bench_random import random_configs
    from dflash_jax.models.target import target_param_shapes, TargetSpec

    cfg, drafter = random_configs(name, 2, None)
    assert cfg.layer_types == ("sliding_attention", "full_attention") and drafter.target_layer_ids == (0, 1)
    shapes = target_param_shapes(cfg)
    sliding, full = shapes["layers_0"]["layer_0"], shapes["layers_1"]["layer_0"]  # a segment each
    d, heads, kv_heads = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads
    global_kv = cfg.family_options.global_kv_heads
    assert sliding["self_attn"]["k_proj"]["kernel"].shape == (1, d, kv_heads * 256)
    assert full["self_attn"]["q_proj"]["kernel"].shape == (1, d, heads * 512)
    assert full["self_attn"]["k_proj"]["kernel"].shape == (1, d, global_kv * 512)
    assert "v_proj" in sliding["self_attn"] and "v_proj" not in full["self_attn"]
    if cfg.moe is not None:
        assert sliding["experts"]["gate_up_proj"].shape == (1, 128, d, 2 * 704)
    cache = jax.eval_shape(lambda: TargetSpec(cfg).init_cache(1, 64))
    assert [g.k.shape for g in cache.groups] == [(1, 1, 64, kv_heads, 256), (1, 1, 64, global_kv, 512)]


def test_transformers_saved_per_layer_config_reads_as_the_global_fields():
    """transformers 5 saves the full layers' shapes as `per_layer_config` (layer index -> head_dim,
    num_key_value_heads) and no global_head_dim: the same config as the released fields; and the
    proportional RoPE's frequencies are transformers' for that layer type."""
    torch, transformers = families.hf_modules("gemma4")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from dflash_jax.families.gemma4 import layer_rotary

    hf = transformers.Gemma4TextConfig(**families.GEMMA4)
    saved = hf.to_dict()
    assert "per_layer_config" in saved and "global_head_dim" not in saved
    ours = ModelConfig.from_hf_config({**saved, "architectures": ["Gemma4ForCausalLM"]})
    assert ours.kv_groups == _config().kv_groups == (((2, 8), (0, 2)), ((1, 16), (1, 3)))
    want, _ = ROPE_INIT_FUNCTIONS["proportional"](hf, layer_type="full_attention")
    inv_freq, scale = layer_rotary(ours, full=True)
    np.testing.assert_array_equal(inv_freq, want.numpy())
    assert scale == 1.0 and np.count_nonzero(inv_freq) == 2  # a quarter of 8 frequency pairs rotate


def test_layer_scalars_and_the_softcap_equal_transformers(tmp_path):
    """Each layer's `layer_scalar` (a buffer transformers initialises to 1, which the conformance rows keep)
    read from the checkpoint and applied: logits (softcapped) and every captured layer equal transformers'."""
    torch, _ = families.hf_modules("gemma4")
    from dflash_jax import load_target

    model = families.make_hf("gemma4")
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.5 + 0.3 * i)
    model.save_pretrained(tmp_path)
    target = load_target(tmp_path, tokenizer=False)
    cfg = target.config
    np.testing.assert_allclose(np.asarray(target.params["layers"]["layer_1"]["layer_scalar"]).ravel(), [0.8, 1.4])
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 12))
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids), output_hidden_states=True)
    capture = tuple(range(cfg.num_layers))

    @jax.jit  # forward and logits in one program
    def run(params, tokens):
        hidden, features, _ = target.forward(params, tokens, capture=capture)
        return target.logits(params, hidden), features

    logits, features = run(target.params, jnp.asarray(ids, jnp.int32))
    logits = np.asarray(logits)
    assert np.abs(logits).max() < cfg.final_logit_softcapping
    assert_model_close(logits, out.logits.numpy(), cfg, tokens=ids.shape[1])
    d = cfg.hidden_size
    for j in capture:
        assert_model_close(np.asarray(features[..., j * d:(j + 1) * d]), out.hidden_states[j + 1].numpy(), cfg,
                           tokens=ids.shape[1], err_msg=f"layer {j}")


@pytest.mark.parametrize("overrides", [
    dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=128),  # one scan over identical layers
    dict(num_kv_shared_layers=2),  # one KV group of the 2 full layers that keep keys, of the full layers' shape
], ids=["direct-ple", "kv-shared"])
def test_a_stack_of_full_layers_only_equals_transformers(tmp_path, overrides):
    """Every layer full (their own head size and kv heads, none of the config's sliding shape): logits, and
    the same logits through the cache in two steps."""
    families.hf_modules("gemma4")
    import torch

    from dflash_jax import load_target

    model = families.make_hf("gemma4", tmp_path, layer_types=["full_attention"] * 4, **overrides)
    target = load_target(tmp_path, tokenizer=False)
    cfg = target.config
    assert len(cfg.kv_groups) == 1 and cfg.kv_groups[0][0] == (1, 16)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 12))
    with torch.no_grad():
        want = model(input_ids=torch.as_tensor(ids)).logits.numpy()

    @jax.jit  # the three passes and their logits in one program
    def run(params, tokens):
        hidden, _, _ = target.forward(params, tokens)
        cache = target.init_cache(2, 32)
        first, _, cache = target.forward(params, tokens[:, :7], cache)
        rest, _, cache = target.forward(params, tokens[:, 7:], cache)
        return target.logits(params, hidden), target.logits(params, jnp.concatenate([first, rest], axis=1))

    logits, cached = run(target.params, jnp.asarray(ids, jnp.int32))
    assert_model_close(np.asarray(logits), want, cfg, tokens=12)
    assert_model_close(np.asarray(cached), want, cfg, tokens=12)


def _two_token_joints(targets, prompt, vocab):
    """Each target's exact p(x1, x2 | prompt) by enumeration (as `support.sampling.exact_joint` at temperature 1,
    no filter, depth 2), all from one program: the prompt followed by each token t, the logits (`Target.logits`)
    at the prompt's last position giving x1's distribution and at t's position x2's given x1 = t."""
    from dflash_jax.decode import sampling

    batch = jnp.asarray([list(prompt) + [t] for t in range(vocab)], jnp.int32)

    @jax.jit
    def probs(params):
        return [sampling.filtered_probs(t.logits(params, t.forward(params, batch)[0][:, -2:]), 1.0, 0, None)
                for t in targets]

    joints = []
    for p in probs(targets[0].params):
        p = np.asarray(p, np.float64)
        joints.append({(a, b): p[a, 0, a] * p[a, 1, b] for a in range(vocab) for b in range(vocab)
                       if p[a, 0, a] > 0 and p[a, 1, b] > 0})
    return joints


@pytest.mark.slow  # make test-all; by default the conformance row's logits against transformers (the softcap is
# Target.logits') and test_sampling's chi-squares (the loop samples Target.logits' distribution, on a Qwen3 target)
def test_sampled_tokens_follow_the_softcapped_distribution():
    """Speculative sampling from a target whose softcap bends its logits far from the raw ones: the first
    two tokens follow the softcapped distribution (chi-square, the exact joint by enumeration through
    `Target.logits`) and not the raw logits' softmax, and drafts are accepted."""
    from dflash_jax.engine.generator import generate
    from dflash_jax.models.target import Target
    from support.sampling import PROMPT, SAMPLES, V, chi_square_pvalue
    from support.speculative import tiny_drafter

    target = families.tiny_target("gemma4", seed=3, scale=0.6, vocab_size=V + 1, final_logit_softcapping=0.5)
    raw = Target(dataclasses.replace(target.config, final_logit_softcapping=0.0), target.params)
    capped, uncapped = _two_token_joints((target, raw), PROMPT, V + 1)
    assert max(abs(capped[s] - uncapped.get(s, 0.0)) for s in capped) > 0.05
    result = generate(target, tiny_drafter(target, block_size=4, seed=5), [PROMPT] * SAMPLES, max_new_tokens=2,
                      stop_token_ids=(), temperature=1.0, seed=11)
    samples = [tuple(t) for t in result.tokens]
    assert chi_square_pvalue(samples, capped) > 1e-3
    assert chi_square_pvalue(samples, uncapped) < 1e-6
    assert result.tau > 1.05


@pytest.mark.parametrize("layer_types", [("sliding_attention", "full_attention"),
                                         ("sliding_attention", "full_attention", "sliding_attention",
                                          "sliding_attention", "full_attention")])
def test_a_stack_of_several_segments_updates_its_cache_in_place(layer_types):
    """Sliding and full layers in no repeating pattern (a segment each, as `--layers 2` cuts a preset): the
    decode step's new keys are written after every segment has read the cache, which is never copied
    (`models.target.after`; the conformance row's decode checks cover the kv-shared layers)."""
    from support.hlo import CAPACITY, compiled_text, whole_buffer_ops

    target = families.tiny_target("gemma4", num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                                  hidden_size_per_layer_input=0, num_kv_shared_layers=0)
    spec = target.spec
    assert len(target.params) > 3  # several segments: layers_0, layers_1, ...

    def step(params, tokens, cache):
        hidden, _, cache = spec.forward(params, tokens, cache)
        return spec.logits(params, hidden), cache

    hlo = compiled_text(step, target.params, jnp.zeros((2, 1), jnp.int32), spec.init_cache(2, CAPACITY), donate=(2,))
    assert whole_buffer_ops(hlo) == []


def test_every_weight_has_a_sharding_declaration():
    """Every weight of a target with per-layer inputs, kv-shared layers and the MoE block is declared
    (`sharding.param_axes`: an undeclared weight of rank >= 2 is an error)."""
    from dflash_jax import sharding
    from dflash_jax.models.target import target_param_shapes

    cfg = _config(**families._GEMMA4_PLE_KV_SHARED, enable_moe_block=True, num_experts=4, top_k_experts=2,
                  moe_intermediate_size=8)
    shapes = target_param_shapes(cfg)
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(shapes)]
    assert any("embed_tokens_per_layer" in n for n in names) and any("gate_up_proj" in n for n in names)
    for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
        sharding.param_axes(path, leaf.shape)


@pytest.mark.parametrize("overrides, message", [
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu' is not supported"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention 'all'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), "rope_parameters per layer type"),
    (dict(rope_parameters={**ROPE, "full_attention": {"rope_type": "dynamic", "rope_theta": 1e6}}),
     "unsupported full-attention rope type 'dynamic'"),
    (dict(per_layer_config={"1": {"head_dim": 16, "sliding_window": 3}}), r"overrides \['sliding_window'\]"),
    (dict(per_layer_config={"1": {"head_dim": 16}, "3": {"head_dim": 32}}), "every full layer of one shape"),
    (dict(num_kv_shared_layers=4), "must leave layers that keep keys of their own"),
    (dict(num_kv_shared_layers=2, layer_types=["full_attention", "full_attention", "sliding_attention",
                                                "full_attention"]),
     "needs a layer of its type before them"),
    (dict(num_global_key_value_heads=3), r"full_attention layers: query heads \(4\) must be a multiple of kv heads"),
])
def test_what_gemma4_does_not_implement_is_refused_by_name(overrides, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        _config(**overrides)


# heads and kv heads for a tensor axis: 16 query heads; the sliding layers' 8 kv heads split over tensor=2 and 8,
# the full layers' one kv head (k=v) copied 2 and 8 times
TENSOR_SPLIT = dict(num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=1)


def sharded_findings(out: str) -> None:
    """In an 8-device process: greedy tokens of a tiny Gemma 4 target (per-layer inputs, kv-shared layers, full
    layers with fewer kv heads than the sliding ones: `TENSOR_SPLIT`) on one device, plain and speculative, and
    on tensor axes of 8 and 2 (x data 4), plain and speculative with a random drafter of 8 query heads; the
    kv-head copies of each layer kind; the caches' head counts -> `out`."""
    import json

    from dflash_jax import sharding
    from dflash_jax.drafters.config import DrafterConfig
    from dflash_jax.drafters.drafter import Drafter, init_drafter_params
    from dflash_jax.engine.generator import Generator

    target = families.tiny_target("gemma4", **TENSOR_SPLIT)
    cfg = target.config
    drafter_cfg = DrafterConfig(hidden_size=cfg.hidden_size, intermediate_size=64, num_layers=1, num_heads=8,
                                num_kv_heads=2, head_dim=8, vocab_size=cfg.vocab_size,
                                num_target_layers=cfg.num_layers, target_layer_ids=(1, cfg.num_layers - 1),
                                block_size=4, mask_token_id=cfg.vocab_size - 1)
    drafter = Drafter(drafter_cfg, init_drafter_params(drafter_cfg, jax.random.PRNGKey(1)))
    prompts = [[3, 9, 4, 7], [5, 5, 20, 31, 2, 8, 11]]
    found = {}
    for name, mesh in (("one", None), ("tensor8", sharding.make_mesh(data=1, tensor=8)),
                       ("tensor2_data4", sharding.make_mesh(data=4, tensor=2))):
        for kind, pair in (("plain", None), ("speculative", drafter)):
            generator = Generator(target, pair, mesh=mesh, **({"backend": "xla"} if mesh is None else {}))
            found[f"{name}/{kind}"] = generator.generate(prompts, max_new_tokens=10, stop_token_ids=()).tokens
        if mesh is not None:
            spec = sharding.spec_for_mesh(target.spec, mesh)
            found[f"{name}/kv_replicas"] = list(np.atleast_1d(spec.kv_replicas).tolist())
            found[f"{name}/cache_heads"] = [g.k.shape[3] for g in spec.init_cache(2, 16).groups]
    with open(out, "w") as f:
        json.dump(found, f)


# ~150 s on 2 CPU cores; test_kv_heads_copied_per_layer_kind_compute_what_one_device_computes (newer-jax leg)
@pytest.mark.slow
def test_sharded_generation_on_a_tensor_axis_equals_one_device():
    """kv heads copied per layer kind (`sharding.spec_for_mesh`): the full layers' one kv head 2 and 8 times, the
    sliding layers' 8 split; greedy tokens, plain and speculative, equal one device's."""
    from support.devices import run_8_devices

    found = run_8_devices("sharded_findings({out})", "test_gemma4")
    reference = found.pop("one/plain")
    assert found.pop("one/speculative") == reference
    assert found.pop("tensor8/kv_replicas") == [1, 8] and found.pop("tensor2_data4/kv_replicas") == [1, 2]
    assert found.pop("tensor8/cache_heads") == [8, 8] and found.pop("tensor2_data4/cache_heads") == [8, 2]
    for key, tokens in found.items():
        assert tokens == reference, key


# newer-jax leg only (`one_leg`); both legs run Gemma 4's layers (test_conformance_dense.py) and kv heads
# copied over a tensor axis (test_sharded_generate.py's layout cases)
@pytest.mark.one_leg
def test_kv_heads_copied_per_layer_kind_compute_what_one_device_computes():
    """On one device, each layer kind's kv heads copied as a tensor axis of 8 needs (the sliding layers' 8 not,
    the full layers' one 8 times; `sharding.group_kv_replicas`): the same logits and captured layers through the
    cached prefill and a decode step (kv-shared layers reading the copies), the cache holding each group's
    copies; the k/v projections split over `tensor` where their group's heads are, else replicated."""
    from dflash_jax import sharding
    from dflash_jax.models.target import target_param_shapes

    # layers 2 and 3 read the copied keys of layers 0 and 1
    target = families.tiny_target("gemma4", **TENSOR_SPLIT, num_hidden_layers=4, num_kv_shared_layers=2,
                                  layer_types=["sliding_attention", "full_attention"] * 2)
    cfg, spec = target.config, target.spec
    assert sharding.group_kv_replicas(cfg, 8) == (1, 8) and sharding.group_kv_replicas(cfg, 2) == (1, 2)
    assert sharding.group_kv_replicas(cfg, 1) == 1
    copied = dataclasses.replace(spec, kv_replicas=(1, 8))
    tokens = jnp.asarray([[3, 9, 4, 7, 1, 30], [5, 5, 20, 31, 2, 8]], jnp.int32)

    @jax.jit  # both specs in one program (eagerly, each layer segment's scan compiles for each)
    def run(params):
        outputs = []
        for s in (spec, copied):
            cache = s.init_cache(2, 16)
            hidden, feats, cache = s.forward(params, tokens, cache, capture=(1, 3))
            step, _, cache = s.forward(params, tokens[:, :1], cache)
            outputs.append((s.logits(params, hidden), feats, s.logits(params, step), cache))
        return outputs

    (*want, cache), (*got, copied_cache) = run(target.params)
    heads, copied_heads = ([g.k.shape[3] for g in c.groups] for c in (cache, copied_cache))
    assert heads == [8, 1] and copied_heads == [8, 8]
    for g, w in zip(got, want):
        assert_model_close(np.asarray(g), np.asarray(w), cfg, tokens=tokens.shape[1] + 1)
    split = {leaf.shape[-1]: tuple(sharding.param_spec(path, leaf.shape, cfg, 8))[-1]
             for path, leaf in jax.tree_util.tree_leaves_with_path(target_param_shapes(cfg))
             if jax.tree_util.keystr(path).endswith("['k_proj']['kernel']")}
    assert split == {8 * cfg.head_dim: "tensor", 16: None}  # the sliding layers' 8 heads of 8, the full one of 16


@pytest.mark.slow  # ~80 s; the training machinery is every family's (test_moe_train runs it by default)
def test_drafter_training_reads_the_right_layers_and_learns(tmp_path):
    """`train.train` with a Gemma 4 target (per-layer inputs, kv-shared layers, sliding windows, the softcap)
    from its checkpoint directory: the features the online step and `train.cache_features` read are the outputs
    of the chosen layers (one a kv-shared layer), and the loss of a short run is finite and falls."""
    from support import family_training

    losses = family_training.check_features_then_train("gemma4", tmp_path, (1, 4), vocab=128, steps=24)
    assert np.mean(losses[-4:]) < 0.9 * np.mean(losses[:4]), losses  # measured: 5.38 -> 4.24
