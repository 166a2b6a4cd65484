"""The drafter a training run starts from: its config (fitted to the target) and initial params.

Levers: warm start (drafter layers <- the target's top layers), fc passing the deepest captured
feature through, and a reduced draft vocabulary head initialised from the target's LM head columns.
A DFlash2 drafter (`dflash2`) starts with its convolutions as identities and random selector
codebooks; a DSpark drafter (`dspark`) with its own embedding table and LM head copied from the
target's (training keeps them frozen) and random Markov and confidence heads.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.drafters import generations
from dflash_jax.drafters.drafter import init_drafter_params
from dflash_jax.drafters.config import (DFlash2Config, DrafterConfig, DSparkConfig, default_target_layer_ids,
                                        resolve_mask_token_id)
from dflash_jax import backends
from dflash_jax.loading.drafter_io import validate_pair

LAYER_PARTS = ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp")


class DrafterFitError(ValueError):
    """The configured drafter cannot serve the target (one message lists every problem)."""


def build_drafter_config(target, *, num_layers: int, block_size: int, intermediate_size: int | None = None,
                         target_layer_ids=None, mask_token_id: int | None = None,
                         sliding_window: int = 0, is_causal: bool | None = None,
                         dflash2: DFlash2Config | None = None, dspark: DSparkConfig | None = None) -> DrafterConfig:
    """A drafter shaped like the target's layers (hidden size, heads, RoPE), the official
    target-layer rule unless ids are given, and the mask token resolved from the tokenizer.
    sliding_window > 0 makes every layer a sliding-window layer (Qwen3's "sliding_attention").
    is_causal: whether a block query sees only the block keys at or before it (None: the authors'
    default, sliding layers causal and full ones not). dflash2 / dspark: the generation's own
    fields (neither: a DFlash drafter)."""
    tc = target.config
    layer_ids = tuple(target_layer_ids) if target_layer_ids is not None else \
        default_target_layer_ids(tc.num_layers, num_layers)
    try:
        mask = resolve_mask_token_id(mask_token_id, target.tokenizer, tc.vocab_size)
        config = DrafterConfig(
            hidden_size=tc.hidden_size, intermediate_size=intermediate_size or tc.intermediate_size,
            num_layers=num_layers, num_heads=tc.num_heads, num_kv_heads=tc.num_kv_heads,
            head_dim=tc.head_dim, vocab_size=tc.vocab_size, num_target_layers=tc.num_layers,
            target_layer_ids=layer_ids, block_size=block_size, mask_token_id=mask,
            rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta, rope_scaling=tc.rope_scaling,
            max_position_embeddings=tc.max_position_embeddings,
            layer_types=("sliding_attention",) * num_layers if sliding_window else (),
            sliding_window=sliding_window, is_causal=is_causal, dflash2=dflash2, dspark=dspark)
        validate_pair(config, target)
    except ValueError as e:
        raise DrafterFitError(f"the configured drafter does not fit the target "
                              f"({tc.num_layers} layers, hidden {tc.hidden_size}, vocab {tc.vocab_size}): {e}") from e
    return config


def _require_stacked(target_params):
    if backends.of_target_params(target_params) != "xla":
        raise DrafterFitError("the target's params are packed for CPU decoding; a drafter is initialised "
                              "from the stacked layout: load_target(..., layout=\"stacked\")")


def target_head_kernel(target, target_params):
    """The target's LM head as a kernel [D, V] (the embedding transposed when tied)."""
    _require_stacked(target_params)
    if target.config.tie_word_embeddings:
        return target_params["embed_tokens"]["embedding"].T
    return target_params["lm_head"]["kernel"]


def warm_start(drafter_params, target_params, num_target_layers: int, layer_ids=None):
    """Drafter layer i <- target layer layer_ids[i] (default: the top n, L - n + i) for attention
    projections, norms and MLP; the final norm <- the target's. q_norm/k_norm stay as initialised
    (ones) when the target has none."""
    _require_stacked(target_params)
    n = jax.tree.leaves(drafter_params["layers"])[0].shape[0]
    layer_ids = tuple(range(num_target_layers - n, num_target_layers)) if layer_ids is None else tuple(layer_ids)
    if len(layer_ids) != n or not all(0 <= i < num_target_layers for i in layer_ids):
        raise DrafterFitError(f"warm start: {n} drafter layers cannot copy target layers {list(layer_ids)} "
                              f"(the target has {num_target_layers})")
    picked = np.asarray(layer_ids)
    source = target_params["layers"]

    def copy(dst, src, where):
        if dst.shape != src[picked].shape:
            raise DrafterFitError(f"warm start: drafter {where} has shape {dst.shape[1:]}, target layers "
                                  f"have {src.shape[1:]} (set model.intermediate_size to the target's)")
        return jnp.asarray(src[picked], dst.dtype)

    def merge(dst, src, where):
        return {k: (merge(v, src[k], f"{where}.{k}") if isinstance(v, dict) else copy(v, src[k], f"{where}.{k}"))
                if k in src else v for k, v in dst.items()}

    layers = {k: (merge(v, source[k], k) if k in LAYER_PARTS else v) for k, v in drafter_params["layers"].items()}
    norm = {"scale": jnp.asarray(target_params["norm"]["scale"], drafter_params["norm"]["scale"].dtype)}
    return {**drafter_params, "layers": layers, "norm": norm}


def last_feature_fc(drafter_params, num_features: int):
    """fc kernel [n*D, D] = [0; ...; 0; I]: the context starts as the deepest captured feature."""
    kernel = drafter_params["fc"]["kernel"]
    d = kernel.shape[1]
    eye = jnp.zeros_like(kernel).at[(num_features - 1) * d:].set(jnp.eye(d, dtype=kernel.dtype))
    return {**drafter_params, "fc": {"kernel": eye}}


def grow(start: dict, fresh: dict) -> dict:
    """A deeper drafter from a trained one: `start`'s params (n layers, with its draft head if any)
    and, stacked on top, `fresh`'s layers beyond the n-th, each an identity at first (its attention
    output and MLP down projections zeroed, the residual stream passing through), so the grown
    drafter drafts exactly what `start` did and training takes it on from there."""
    n = jax.tree.leaves(start["drafter"]["layers"])[0].shape[0]
    total = jax.tree.leaves(fresh["drafter"]["layers"])[0].shape[0]
    if total <= n:
        raise DrafterFitError(f"grow: {total} layers cannot extend a drafter of {n}")
    added = jax.tree.map(lambda x: x[n:], fresh["drafter"]["layers"])
    added["self_attn"]["o_proj"] = jax.tree.map(jnp.zeros_like, added["self_attn"]["o_proj"])
    added["mlp"]["down_proj"] = jax.tree.map(jnp.zeros_like, added["mlp"]["down_proj"])
    layers = jax.tree.map(lambda a, b: jnp.concatenate([a, b.astype(a.dtype)]), start["drafter"]["layers"], added)
    return {**start, "drafter": {**start["drafter"], "layers": layers}}


def target_tables(drafter_params, target, target_params):
    """A DSpark drafter's own `embed_tokens` and `lm_head` <- the target's embedding table and LM
    head (DeepSpec's `initialize_embeddings_and_head`)."""
    _require_stacked(target_params)
    embedding = target_params["embed_tokens"]["embedding"]
    head = target_head_kernel(target, target_params)
    mine = drafter_params["embed_tokens"]["embedding"], drafter_params["lm_head"]["kernel"]
    if embedding.shape != mine[0].shape or head.shape != mine[1].shape:
        raise DrafterFitError(f"DSpark: the target's tables {embedding.shape}, {head.shape} do not fit the drafter's "
                              f"{mine[0].shape}, {mine[1].shape}")
    return {**drafter_params, "embed_tokens": {"embedding": jnp.asarray(embedding, mine[0].dtype)},
            "lm_head": {"kernel": jnp.asarray(head, mine[1].dtype)}}


def initial_params(config: DrafterConfig, target, target_params, rng, *, warm: bool = False,
                   warm_layers=None, fc_init: str = "random", draft_to_target: np.ndarray | None = None) -> dict:
    """{"drafter": params} (+ {"draft_head": target LM head columns [D, Vd]} for a draft vocabulary).
    warm: copy target layers `warm_layers` (default the top ones) into the drafter layers."""
    drafter = init_drafter_params(config, rng, jnp.float32)
    if generations.of(config).own_tables:  # a DSpark drafter's own copies of the target's tables
        drafter = target_tables(drafter, target, target_params)
    if warm:
        drafter = warm_start(drafter, target_params, target.config.num_layers, warm_layers)
    if fc_init == "last_feature":
        drafter = last_feature_fc(drafter, config.num_features)
    params = {"drafter": drafter}
    if draft_to_target is not None:
        head = target_head_kernel(target, target_params)
        params["draft_head"] = jnp.asarray(head[:, np.asarray(draft_to_target)], jnp.float32)
    return params

