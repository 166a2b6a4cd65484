"""DSpark drafters in the speculators layout (`DSparkSpeculator`, vllm-project/speculators'
`DSparkSpeculatorConfig` / `DSparkDraftModel`): the config read, the tensors loaded with the target's
tables where the checkpoint leaves them out, drafting equal to the same weights in DeepSpec's
layout, and the export bit-exact both ways.

The checkpoints here are written by the test from the speculators code's description (config keys
and tensor names), not by our exporter: a `transformer_layer_config` holding the decoder's fields
as transformers 5 serializes a Qwen3Config, `aux_hidden_state_layer_ids` = target layer ids + 1,
the DFlash backbone and the heads under the names `DSparkDraftModel`'s state dict has (no prefix),
`embed_tokens.weight` / `lm_head.weight` absent (the target's)."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax._errors import CheckpointError, ConfigError
from dflash_jax.decode import loop as decode_loop
from dflash_jax.drafters.config import DrafterConfig, DSparkConfig
from dflash_jax.engine.generator import Generator
from dflash_jax.formats.safetensors_io import save_safetensors
from dflash_jax.loading.drafter_io import load_drafter, save_drafter
from dflash_jax.models.config import ModelConfig
from dflash_jax.models.target import init_target_params, Target

D, H, KV, HD, FF, V, G, R = 32, 4, 2, 8, 64, 50, 4, 6
MASK = V - 1
TARGET = ModelConfig(arch="llama", vocab_size=V, hidden_size=D, intermediate_size=FF, num_layers=3, num_heads=H,
                     num_kv_heads=KV, head_dim=HD, max_position_embeddings=2048)
TABLES = ("embed_tokens.weight", "lm_head.weight")


def speculators_config(**kw):
    """config.json of a tiny DSparkSpeculator as speculators writes it (every field of the pydantic
    config; `transformer_layer_config` a Qwen3Config's to_diff_dict under transformers 5)."""
    layer = {"model_type": "qwen3", "vocab_size": V, "hidden_size": D, "intermediate_size": FF,
             "num_hidden_layers": 2, "num_attention_heads": H, "num_key_value_heads": KV, "head_dim": HD,
             "hidden_act": "silu", "max_position_embeddings": 256, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
             "use_cache": True, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
             "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 2,
             "layer_types": ["full_attention"] * 2, "attention_dropout": 0.0, "tie_word_embeddings": False}
    hf = {"architectures": ["DSparkSpeculator"], "speculators_model_type": "dspark", "speculators_version": "0.6.0",
          "dtype": "float32", "transformer_layer_config": layer, "draft_vocab_size": V, "block_size": G,
          "target_hidden_size": None, "aux_hidden_state_layer_ids": [1, 3], "mask_token_id": MASK,
          "sliding_window_non_causal": False, "sample_from_anchor": True, "markov_rank": R,
          "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True,
          "speculators_config": {"algorithm": "dspark", "default_proposal_method": "greedy",
                                 "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": G}],
                                 "verifier": {"name_or_path": "tiny/llama", "architectures": ["LlamaForCausalLM"]}}}
    return {**hf, **kw}


def deepspec_config():
    """The same drafter's config.json in DeepSpec's own layout (`Qwen3DSparkModel`)."""
    return {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": D, "intermediate_size": FF,
            "num_hidden_layers": 2, "num_attention_heads": H, "num_key_value_heads": KV, "head_dim": HD,
            "vocab_size": V, "num_target_layers": 3, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 256, "block_size": G, "layer_types": ["full_attention"] * 2,
            "tie_word_embeddings": False, "target_layer_ids": [0, 2], "mask_token_id": MASK, "markov_rank": R,
            "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True,
            "dtype": "float32"}


def backbone_and_heads(seed=0):
    """The tensors both layouts share, under their common names, random (the Markov head scaled up
    so that its bias changes drafts)."""
    rng = np.random.default_rng(seed)
    draw = lambda *shape, s=0.3: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    t = {"fc.weight": draw(D, 2 * D), "hidden_norm.weight": 1 + draw(D, s=0.1), "norm.weight": 1 + draw(D, s=0.1),
         "markov_head.markov_w1.weight": draw(V, R, s=1.5), "markov_head.markov_w2.weight": draw(V, R, s=1.5),
         "confidence_head.proj.weight": draw(1, D + R), "confidence_head.proj.bias": draw(1)}
    for i in range(2):
        p = f"layers.{i}."
        t.update({p + "input_layernorm.weight": 1 + draw(D, s=0.1), p + "post_attention_layernorm.weight": 1 + draw(D),
                  p + "self_attn.q_proj.weight": draw(H * HD, D), p + "self_attn.k_proj.weight": draw(KV * HD, D),
                  p + "self_attn.v_proj.weight": draw(KV * HD, D), p + "self_attn.o_proj.weight": draw(D, H * HD),
                  p + "self_attn.q_norm.weight": 1 + draw(HD, s=0.1),
                  p + "self_attn.k_norm.weight": 1 + draw(HD, s=0.1),
                  p + "mlp.gate_proj.weight": draw(FF, D), p + "mlp.up_proj.weight": draw(FF, D),
                  p + "mlp.down_proj.weight": draw(D, FF)})
    return t


def write(directory, config, tensors):
    directory.mkdir()
    save_safetensors(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def target():
    return Target(TARGET, init_target_params(TARGET, jax.random.PRNGKey(0)))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, target):
    """(speculators dir, DeepSpec dir) of the same weights: DeepSpec's holding copies of the target's
    embedding table and LM head, the speculators one leaving them out."""
    root = tmp_path_factory.mktemp("dspark-layouts")
    shared = backbone_and_heads()
    tables = {"embed_tokens.weight": np.asarray(target.params["embed_tokens"]["embedding"]),
              "lm_head.weight": np.asarray(target.params["lm_head"]["kernel"]).T}
    return (write(root / "speculators", speculators_config(), shared),
            write(root / "deepspec", deepspec_config(), {**shared, **tables}))


def test_config_reads_the_speculators_fields():
    cfg = DrafterConfig.from_hf_config(speculators_config())
    deepspec = DrafterConfig.from_hf_config(deepspec_config())
    assert cfg.target_layer_ids == (0, 2)  # aux_hidden_state_layer_ids - 1
    assert cfg.num_target_layers is None and cfg.proposals == G and cfg.is_causal is False
    assert cfg == dataclasses.replace(deepspec, num_target_layers=None)
    # absent head fields take the speculators class's defaults (DSparkSpeculatorConfig)
    bare = {k: v for k, v in speculators_config().items()
            if k not in ("block_size", "sample_from_anchor", "markov_head_type", "enable_confidence_head",
                         "confidence_head_with_markov", "sliding_window_non_causal", "mask_token_id")}
    defaults = DrafterConfig.from_hf_config(bare)
    assert defaults.block_size == 8 and defaults.mask_token_id is None
    # sample_from_anchor absent: a config from before speculators had the field, its 1+N block
    assert defaults.dspark == DSparkConfig(R, True, True, "vanilla", sample_from_anchor=False)
    assert defaults.proposals == 8 - 1
    assert DrafterConfig.from_hf_config({k: v for k, v in bare.items() if k != "markov_rank"}).dspark.markov_rank == 256
    older = DrafterConfig.from_hf_config(speculators_config(sample_from_anchor=False))
    assert older.proposals == G - 1
    sliding = speculators_config()
    sliding["transformer_layer_config"] = {**sliding["transformer_layer_config"], "sliding_window": 16,
                                           "layer_types": ["sliding_attention", "full_attention"]}
    assert DrafterConfig.from_hf_config(sliding).layer_causal == (True, False)
    assert DrafterConfig.from_hf_config({**sliding, "sliding_window_non_causal": True}).layer_causal == (False, False)


def test_missing_and_unsupported_fields_are_named():
    layer = speculators_config()["transformer_layer_config"]
    bad = [(dict(transformer_layer_config=None), "missing required field 'transformer_layer_config'"),
           (dict(aux_hidden_state_layer_ids=None), "missing required field 'aux_hidden_state_layer_ids'"),
           (dict(draft_vocab_size=None), "missing required field 'draft_vocab_size'"),
           (dict(transformer_layer_config={k: v for k, v in layer.items() if k != "hidden_size"}),
            "'transformer_layer_config.hidden_size'"),
           (dict(transformer_layer_config={k: v for k, v in layer.items() if k != "vocab_size"}),
            "'transformer_layer_config.vocab_size'"),
           (dict(aux_hidden_state_layer_ids=[0, 3]), "an id of 0"),
           (dict(draft_vocab_size=V + 1), "draft_vocab_size 51 must lie in"),
           (dict(markov_head_type="gated"), "markov_head_type 'gated' is not supported"),
           (dict(markov_rank=0), "confidence_head_with_markov needs a Markov head"),
           (dict(target_hidden_size=64), "target_hidden_size 64"),
           (dict(block_size="7"), "'block_size' must be an integer")]
    for kw, match in bad:
        with pytest.raises(ConfigError, match=match):
            DrafterConfig.from_hf_config(speculators_config(**kw))


def test_loads_and_drafts_as_the_same_weights_in_deepspecs_layout(checkpoints, target):
    from support.speculative import plain_greedy_rows

    spec_dir, deepspec_dir = checkpoints
    spec = load_drafter(spec_dir, target)
    ref = load_drafter(deepspec_dir, target)
    assert spec.config.dspark.shared_tables == ("embed_tokens", "lm_head")
    assert dataclasses.replace(spec.config, dspark=ref.config.dspark) == ref.config
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                           spec.params, ref.params)
    # the proposal, as the loop makes it
    rng = np.random.default_rng(3)
    features = jnp.asarray(rng.standard_normal((3, 6, 2 * D)).astype(np.float32))
    anchors = jnp.asarray([3, 17, 44])
    sampling = decode_loop.SamplingParams(jnp.float32(1.0), jnp.float32(1.0), jnp.full((8,), -1, jnp.int32),
                                          confidence_threshold=jnp.float32(0.5))
    gen_cfg = decode_loop.GenerationConfig(block_size=G + 1)
    proposals = []
    for drafter in (spec, ref):
        cache = drafter.spec.append_context(drafter.params, drafter.spec.init_cache(3, 32), features)
        proposals.append(decode_loop._propose(None, drafter.spec, gen_cfg, None, drafter.params, anchors, cache,
                                              jax.random.PRNGKey(0), sampling))
    for a, b in zip(*proposals):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # greedy speculative decoding: the same tokens and acceptance lengths, the target's own output
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11, 12]]
    results = [Generator(target, d).generate(prompts, max_new_tokens=12, stop_token_ids=()) for d in (spec, ref)]
    # plain decoding of the prompts as one ragged batch (2 programs, not one prefill per prompt length; rows of
    # a ragged prefill equal each row alone: test_family_conformance's cached ragged prefill)
    assert results[0].tokens == results[1].tokens == plain_greedy_rows(target, prompts, 12)
    assert results[0].acceptance_lengths == results[1].acceptance_lengths


def test_export_round_trip_is_bit_exact_both_ways(checkpoints, target, tmp_path):
    from safetensors.numpy import load_file

    spec_dir, deepspec_dir = checkpoints
    drafter = load_drafter(spec_dir, target)
    save_drafter(drafter, tmp_path / "again")  # auto: the layout it came from, the tables left out again
    source = load_file(str(spec_dir / "model.safetensors"))
    written = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert set(written) == set(source)
    for name, value in source.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == speculators_config()
    # speculators -> DeepSpec's layout: the target's tables written in, the file DeepSpec's own
    save_drafter(drafter, tmp_path / "deepspec", layout="official")
    out = json.loads((tmp_path / "deepspec" / "config.json").read_text())
    assert out["architectures"] == ["Qwen3DSparkModel"] and "transformer_layer_config" not in out
    deepspec = load_file(str(deepspec_dir / "model.safetensors"))
    written = load_file(str(tmp_path / "deepspec" / "model.safetensors"))
    assert set(written) == set(deepspec)
    for name, value in deepspec.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    # DeepSpec's layout -> speculators: its own tables kept in the file, read back without a target
    save_drafter(load_drafter(deepspec_dir), tmp_path / "spec", layout="speculators")
    again = load_drafter(tmp_path / "spec")
    assert again.config.dspark.shared_tables == () and again.config.target_layer_ids == (0, 2)
    assert set(load_file(str(tmp_path / "spec" / "model.safetensors"))) == set(deepspec)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                           again.params, drafter.params)


def test_tables_left_out_need_the_target(checkpoints, tmp_path):
    spec_dir, deepspec_dir = checkpoints
    with pytest.raises(CheckpointError, match="embed_tokens.weight"):
        load_drafter(spec_dir)
    drafter = load_drafter(deepspec_dir)
    with pytest.raises(ValueError, match="speculators"):
        save_drafter(dataclasses.replace(drafter, config=dataclasses.replace(drafter.config, dspark=None)),
                     tmp_path / "x", layout="speculators")
    with pytest.raises(ValueError, match="layout must be one of"):
        save_drafter(drafter, tmp_path / "y", layout="vllm")


# ---- a reduced draft vocabulary (d2t / t2d) ----------------------------------------------------------

VD = 20
IDS = np.sort(np.random.default_rng(5).choice(V, VD, replace=False))


@pytest.fixture(scope="module")
def reduced_checkpoint(tmp_path_factory):
    """A speculators DSpark checkpoint over the VD target ids IDS: its own lm_head [VD, D] and
    markov_w2 [VD, R], d2t int64 (target id - draft id) and t2d bool [V], the embedding the target's."""
    rng = np.random.default_rng(11)
    t = backbone_and_heads(seed=1)
    t2d = np.zeros(V, bool)
    t2d[IDS] = True
    t.update({"lm_head.weight": (rng.standard_normal((VD, D)) * 0.5).astype(np.float32),
              "markov_head.markov_w2.weight": (rng.standard_normal((VD, R)) * 1.5).astype(np.float32),
              "d2t": (IDS - np.arange(VD)).astype(np.int64), "t2d": t2d})
    return write(tmp_path_factory.mktemp("dspark-reduced") / "ckpt", speculators_config(draft_vocab_size=VD), t)


def test_a_reduced_vocabulary_drafts_only_its_ids_as_the_reference_chain(reduced_checkpoint, target):
    """The chain in the reduced vocabulary, in float64 numpy from the description (logits over the VD
    ids: lm_head h + W2 W1[x_{k-1}], x_{-1} the anchor, each draft mapped to its target id through
    d2t and fed to W1 as that id): the loop's greedy drafts, confidences and, at temperature 1, q
    (softmax over the VD ids, zero elsewhere)."""
    from safetensors.numpy import load_file

    drafter = load_drafter(reduced_checkpoint, target)
    assert drafter.config.dspark.draft_vocab_size == VD and drafter.config.dspark.shared_tables == ("embed_tokens",)
    t = load_file(str(reduced_checkpoint / "model.safetensors"))
    w1 = t["markov_head.markov_w1.weight"].astype(np.float64)
    w2, head = t["markov_head.markov_w2.weight"].astype(np.float64), t["lm_head.weight"].astype(np.float64)
    conf_w, conf_b = t["confidence_head.proj.weight"][0].astype(np.float64), float(t["confidence_head.proj.bias"][0])
    rng = np.random.default_rng(3)
    features = jnp.asarray(rng.standard_normal((3, 6, 2 * D)).astype(np.float32))
    anchors = np.array([3, 17, 44])
    spec, params = drafter.spec, drafter.params
    cache = spec.append_context(params, spec.init_cache(3, 32), features)
    block = jnp.concatenate([jnp.asarray(anchors)[:, None], jnp.full((3, G - 1), MASK, jnp.int32)], axis=1)
    hidden = np.asarray(spec.draft_hidden(params, params["embed_tokens"]["embedding"][block], cache), np.float64)
    sampling = decode_loop.SamplingParams(jnp.float32(1.0), jnp.float32(1.0), jnp.full((8,), -1, jnp.int32),
                                          confidence_threshold=jnp.float32(0.5))
    greedy = decode_loop._propose(None, spec, decode_loop.GenerationConfig(block_size=G + 1), None, params,
                                  jnp.asarray(anchors), cache, jax.random.PRNGKey(0), sampling)
    sampled = decode_loop._propose(None, spec, decode_loop.GenerationConfig(block_size=G + 1, sampling=True), None,
                                   params, jnp.asarray(anchors), cache, jax.random.PRNGKey(1), sampling)
    for row in range(3):
        prev, chain, conf = int(anchors[row]), [], []
        for k in range(G):
            z = hidden[row, k] @ head.T + w2 @ w1[prev]
            conf.append(1 / (1 + np.exp(-(conf_w @ np.concatenate([hidden[row, k], w1[prev]]) + conf_b))))
            prev = int(IDS[np.argmax(z)])
            chain.append(prev)
        np.testing.assert_array_equal(np.asarray(greedy[0][row]), chain, err_msg=f"row {row}")
        assert int(greedy[3][row]) == int(np.cumprod(np.asarray(conf) >= 0.5).sum()), (row, conf)
        # at T = 1 along the sampled chain: q is the reduced softmax, zero off IDS
        prev, drafts, q = int(anchors[row]), np.asarray(sampled[0][row]), np.asarray(sampled[1][row])
        assert set(drafts.tolist()) <= set(IDS.tolist())
        for k in range(G):
            z = hidden[row, k] @ head.T + w2 @ w1[prev]
            want = np.zeros(V)
            want[IDS] = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
            np.testing.assert_allclose(q[k], want, atol=1e-5, err_msg=f"row {row} slot {k}")
            prev = int(drafts[k])


@pytest.mark.slow
def test_greedy_speculative_with_a_reduced_vocabulary_equals_plain_decoding(reduced_checkpoint, target):
    from support.speculative import plain_greedy

    drafter = load_drafter(reduced_checkpoint, target)
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11, 12]]
    result = Generator(target, drafter).generate(prompts, max_new_tokens=10, stop_token_ids=())
    assert result.tokens == [plain_greedy(target, p, 10) for p in prompts]


def test_a_reduced_vocabulary_exports_bit_exact(reduced_checkpoint, target, tmp_path):
    from safetensors.numpy import load_file

    drafter = load_drafter(reduced_checkpoint, target)
    save_drafter(drafter, tmp_path / "again")
    source = load_file(str(reduced_checkpoint / "model.safetensors"))
    written = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert set(written) == set(source)
    for name, value in source.items():
        assert written[name].dtype == value.dtype, name
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == speculators_config(draft_vocab_size=VD)
    with pytest.raises(ValueError, match="layout='speculators'"):
        save_drafter(drafter, tmp_path / "deepspec", layout="official")
    t = dict(source)
    del t["d2t"]
    bad = write(tmp_path / "bad", speculators_config(draft_vocab_size=VD), t)
    with pytest.raises(CheckpointError, match="'d2t'"):
        load_drafter(bad, target)


def test_the_convert_cli_writes_the_speculators_layout(checkpoints, tmp_path):
    from dflash_jax import convert
    from dflash_jax.loading.orbax_io import save_orbax_drafter

    _, deepspec_dir = checkpoints
    drafter = load_drafter(deepspec_dir)
    save_orbax_drafter(drafter, tmp_path / "orbax")
    assert convert.main(["to-hf", str(tmp_path / "orbax"), str(tmp_path / "hf"), "--layout", "speculators"]) == 0
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == ["DSparkSpeculator"] and written["aux_hidden_state_layer_ids"] == [1, 3]
    again = load_drafter(tmp_path / "hf")
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                           again.params, drafter.params)
