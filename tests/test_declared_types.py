"""Declared types in place of conventions: which targets a backend's layout holds (`Backend.supports`),
packed params that say so (`BackendLayout`), the mixture-of-experts product form as a backend's static
choice (`Backend.expert_form`), one definition of each error class, `KeyRanges` in the kernels package."""
import dataclasses
import pickle
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import backends
from dflash_jax.backends import base
from dflash_jax.drafters.config import DrafterConfig
from dflash_jax.drafters.drafter import Drafter, init_drafter_params
from dflash_jax.layers import moe
from dflash_jax.models.config import LinearAttentionConfig, ModelConfig, MoEConfig
from dflash_jax.models.target import Target, target_param_shapes
from support.families import drawn_params

DENSE = ModelConfig(arch="qwen3", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
MOE = dataclasses.replace(DENSE, arch="qwen3_moe", moe=MoEConfig(num_experts=8, num_experts_per_tok=2,
                                                                 intermediate_size=16, norm_topk_prob=True))
HYBRID = ModelConfig(arch="qwen3_5", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, partial_rotary_factor=0.25,
                     layer_types=("linear_attention",) * 3 + ("full_attention",),
                     linear=LinearAttentionConfig(conv_kernel_dim=4, num_key_heads=2, num_value_heads=4,
                                                  key_head_dim=8, value_head_dim=8))
def _drawn_params(config):
    """Target params of `config` drawn with numpy (`support.families.drawn_params`; no initialiser to
    compile) at the initialiser's spread for these widths."""
    return drawn_params(target_param_shapes(config), scale=0.18)


DRAFTER = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                        head_dim=8, vocab_size=48, num_target_layers=2, target_layer_ids=(0, 1), block_size=4,
                        mask_token_id=47)


def test_the_backend_says_which_targets_its_layout_holds():
    """The CPU backend's packed layout holds Qwen3 / Llama layers; a hybrid or MoE target decodes
    from the stacked layout (XLA's, which holds every one): a backend's answer, not a config field."""
    llama = dataclasses.replace(DENSE, arch="llama", qk_norm=False)
    assert not hasattr(ModelConfig, "stacked_only")
    for config in (DENSE, llama, MOE, HYBRID):
        assert backends.get("xla").supports(config)
        assert backends.decode_backend(config, "xla") == "xla"
    assert backends.get("cpu").supports(DENSE) and backends.get("cpu").supports(llama)
    assert not backends.get("cpu").supports(MOE) and not backends.get("cpu").supports(HYBRID)
    assert backends.decode_backend(DENSE, "cpu") == "cpu"
    assert backends.decode_backend(MOE, "cpu") == "xla" and backends.decode_backend(HYBRID, "cpu") == "xla"
    with pytest.raises(ValueError, match="unknown backend"):
        backends.decode_backend(DENSE, "tpu-kernels")
    moe_target = Target(MOE, _drawn_params(MOE))
    assert moe_target.spec.decode_params(moe_target.params, "cpu") is moe_target.params
    assert moe_target.module_for(moe_target.params).backend == "xla"


def test_packed_params_carry_their_tag_through_jit_and_tree_maps():
    """`pack_layers` / `pack_drafter` tag their output (`BackendLayout`, backend "cpu"); the registry
    reads the tag, never keys or ranks, and the tag survives jit, tree_map, device_put and pickling."""
    from dflash_jax.backends.cpu.layout import is_packed_layout, pack_layers

    target = Target(DENSE, _drawn_params(DENSE))
    packed = target.spec.decode_params(target.params, "cpu")
    assert isinstance(packed, backends.BackendLayout) and packed.backend == "cpu"
    assert backends.of_target_params(packed) == "cpu" and is_packed_layout(packed)
    assert backends.of_target_params(target.params) == "xla"
    assert pack_layers(packed) is packed and target.spec.decode_params(packed, "cpu") is packed
    # a stacked dict that happens to hold a "head" is stacked: nothing is guessed from its keys
    assert backends.of_target_params({**packed}) == "xla"
    seen = []

    def layout_inside(params):
        seen.append(backends.of_target_params(params))
        return jax.tree_util.tree_leaves(params)[0]

    jax.jit(layout_inside)(packed)
    mapped = jax.tree_util.tree_map(lambda x: x, packed)
    restored = pickle.loads(pickle.dumps(jax.device_get(packed)))
    assert seen == ["cpu"]
    for params in (mapped, jax.device_put(packed), restored):
        assert backends.of_target_params(params) == "cpu" and set(params) == set(packed)
    paths = {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(packed)[0]}
    assert "['head']" in paths  # the same key paths as a dict's
    assert target.module_for(packed).backend == "cpu"

    drafter = Drafter(DRAFTER, init_drafter_params(DRAFTER, jax.random.PRNGKey(1)))
    loop = drafter.spec.decode_params(drafter.loop_params, "cpu")
    from dflash_jax.backends.cpu.ffi import available

    assert backends.of_drafter_params(drafter.spec.module_params(loop)) == ("cpu" if available() else "xla")
    assert backends.of_drafter_params(drafter.spec.module_params(drafter.loop_params)) == "xla"
    assert drafter.spec.decode_params(loop, "cpu") is loop


def test_the_expert_form_is_the_backends_static_choice(monkeypatch):
    """`layers.moe.FORMS` are the forms a backend names; fewer pairs than experts gather everywhere;
    more: XLA gathers on a CPU while the gathered weights fit `CPU_GATHER_BYTES`, sorts
    (`ragged_dot`) beyond that and on other platforms; the CPU backend always as on a CPU."""
    assert tuple(moe.FORMS) == backends.EXPERT_FORMS
    xla, cpu, limit = backends.get("xla"), backends.get("cpu"), base.CPU_GATHER_BYTES
    for platform, big in (("cpu", "gathered"), ("gpu", "sorted"), ("tpu", "sorted")):
        monkeypatch.setattr(base.jax, "default_backend", lambda: platform)
        assert backends.platform() == platform
        assert xla.expert_form(2, 8, 1 << 20) == "gathered"  # a decode step: k pairs
        assert xla.expert_form(32, 8, 1 << 20) == big
        assert xla.expert_form(32, 8, limit) == "sorted"
        assert cpu.expert_form(32, 8, 1 << 20) == "gathered" and cpu.expert_form(32, 8, limit) == "sorted"


def _moe_verify_text(target, params, monkeypatch=None, form=None):
    if form is not None:
        monkeypatch.setattr(base.Backend, "expert_form", lambda self, *args: form)
    cache = target.init_cache(1, 64)
    fn = jax.jit(lambda p, tokens, c: target.spec.forward(p, tokens, c)[0])  # a new function: traced anew
    return fn.lower(params, jnp.zeros((1, 16), jnp.int32), cache).compile().as_text()


def test_a_moe_verify_on_a_cpu_gathers_its_experts(monkeypatch):
    """The compiled 16-token verify of a Qwen3-MoE target on a CPU gathers the chosen experts'
    weights (32 pairs over 8 experts): no sort of the pairs and no scatter of their sums, which the
    sorted (`ragged_dot`) form has; both forms give the same hidden states."""
    if backends.platform() != "cpu":
        pytest.skip("the CPU's expert form")
    target = Target(MOE, _drawn_params(MOE))
    params = target.spec.decode_params(target.params)
    assert backends.of_target_params(params) == "xla"
    auto = _moe_verify_text(target, params)
    ops = lambda text: (len(re.findall(r" sort\(", text)), len(re.findall(r" scatter\(", text)))  # noqa: E731
    assert ops(auto) == (0, 0) and re.search(r" gather\(", auto), ops(auto)
    assert ops(_moe_verify_text(target, params, monkeypatch, "sorted")) != (0, 0)  # the check can fail
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 48, size=(2, 16)), jnp.int32)
    gathered = target.forward(params, tokens)[0]
    monkeypatch.setattr(base.Backend, "expert_form", lambda self, *args: "sorted")
    np.testing.assert_allclose(np.asarray(target.forward(params, tokens)[0]), np.asarray(gathered),
                               rtol=1e-5, atol=1e-5)


def test_one_definition_of_each_error_class():
    """The training scripts raise the library's errors, all ValueErrors (docs/architecture.md)."""
    import dflash_jax
    from train import checkpointing, config

    assert config.ConfigError is dflash_jax.ConfigError
    assert checkpointing.CheckpointError is dflash_jax.CheckpointError
    for error in (dflash_jax.ConfigError, dflash_jax.CheckpointError, dflash_jax.TorchRequiredError,
                  dflash_jax.DrafterMismatchError):
        assert issubclass(error, ValueError)
    assert not issubclass(dflash_jax.CheckpointError, RuntimeError)


def test_key_ranges_come_with_the_kernels_package():
    import dflash_jax.kernels as kernels
    from dflash_jax.kernels import masks as _masks

    assert kernels.KeyRanges is _masks.KeyRanges and "KeyRanges" in kernels.__all__
    q = jnp.ones((1, 2, 2, 8), jnp.float32)
    ranges = kernels.KeyRanges(start=jnp.zeros((1, 2, 2), jnp.int32), end=jnp.asarray([[[1, 0], [2, 0]]], jnp.int32))
    out = kernels.reference_attention(q, q, q, ranges)
    np.testing.assert_allclose(np.asarray(out), np.ones((1, 2, 2, 8)), rtol=1e-6)
