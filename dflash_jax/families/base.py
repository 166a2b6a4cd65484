"""`Family`: what one target family knows, in one place (see the package docstring)."""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from dflash_jax._errors import CheckpointError
from dflash_jax.formats.names import _linear_rules, moe_layer_rules, Rule, unfuse_experts
from dflash_jax.models.config import ConfigFields, decoder_fields, LINEAR, ModelConfig, REQUIRED
from dflash_jax.models.stack import is_direct, segment_path, stack_segments

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class Family:
    """A target family. Subclasses set the class attributes and override what differs:
    `family_fields` (the config fields beyond the common ones), `validate`, `mixer_rules` /
    `mlp_rules` (the name table of one layer kind), `adapt_tensors`, `layer_module`."""

    name: str = ""
    hf_classes: tuple[str, ...] = ()  # `architectures` entries it reads
    model_types: tuple[str, ...] = ()  # `model_type`s it reads when a config lists no architectures
    qk_norm: bool = False  # RMSNorm of each head's query and key
    hybrid: bool = False  # Gated DeltaNet layers and partial rotary allowed
    partial_rotary: bool = False  # partial rotary allowed (partial_rotary_factor < 1) without being hybrid
    latent_attention: bool = False  # multi-head latent attention (`ModelConfig.mla`) allowed
    default_max_positions: int = 4096
    # its layers are `TargetLayer`s (attention and a SwiGLU MLP), which a backend's packed decode layout holds
    # (the CPU backend's); False for a family with layer modules of its own
    plain_layers: bool = True
    checkpoint_prefixes: tuple[str, ...] = ("model.",)  # the text model's prefix, the first one present

    # ---- config.json

    def config_fields(self, fields: ConfigFields) -> ConfigFields:
        """The fields to read (a family may fill in defaults or read a nested text config)."""
        return fields

    def family_fields(self, fields: ConfigFields) -> dict:
        """ModelConfig keywords beyond the common ones (e.g. moe=, linear=, attention_sinks=)."""
        return {}

    def default_intermediate_size(self, fields: ConfigFields):
        return REQUIRED

    def read_config(self, fields: ConfigFields) -> ModelConfig:
        fields = self.config_fields(fields)
        return fields.build(
            ModelConfig,
            arch=self.name,
            vocab_size=fields.int("vocab_size"),
            **decoder_fields(fields, self.default_max_positions, hybrid=self.hybrid,
                             default_intermediate_size=self.default_intermediate_size(fields),
                             partial_rotary=self.partial_rotary),
            tie_word_embeddings=fields.bool("tie_word_embeddings", False),
            qk_norm=self.qk_norm,
            attention_bias=fields.bool("attention_bias", False),
            mlp_bias=fields.bool("mlp_bias", False),
            bos_token_id=fields.int("bos_token_id", None),
            eos_token_ids=fields.int_or_int_list("eos_token_id"),
            pad_token_id=fields.int("pad_token_id", None),
            **self.family_fields(fields),
        )

    def validate(self, config: ModelConfig) -> None:
        """ValueError for what this family's configs cannot hold (called by ModelConfig)."""
        if config.linear is not None and not self.hybrid:
            raise ValueError(f"a {self.name} target has no linear-attention layers")
        if config.partial_rotary_factor != 1.0 and not (self.hybrid or self.partial_rotary):
            raise ValueError(f"partial_rotary_factor != 1 is not supported for {self.name}")
        if config.mla is not None and not self.latent_attention:
            raise ValueError(f"a {self.name} target has no multi-head latent attention (mla=)")

    # ---- the model

    def layer_mixer(self, config: ModelConfig, layer: int, layer_type: str) -> str:
        """The token mixer of layer `layer` (of `layer_types` entry `layer_type`), its kind's first half
        (`ModelConfig.layer_kinds`): "linear_attention", or "attention" (full or sliding: the window is
        data). A family whose layers of two types differ in shape names them apart (Gemma 4)."""
        return LINEAR if layer_type == LINEAR else "attention"

    def kv_shape(self, config: ModelConfig, mixer: str) -> tuple[int, int] | None:
        """(kv heads, head dim) of the keys and values a layer of this mixer keeps in the KV cache, None
        for one that keeps none (`ModelConfig.kv_groups`)."""
        return None if mixer == LINEAR else (config.num_kv_heads, config.head_dim)

    def layer_inputs(self, config: ModelConfig, dtype):
        """None, or a Flax module (a submodule of the target model, "layer_inputs") that gives each layer an input
        of its own: (tokens [B, T], their embeddings [B, T, D]) -> [B, T, L, ...], layer i's [..., i, :] the
        fourth entry of its xs (Gemma 4's per-layer inputs)."""
        return None

    def embedding_scale(self, config: ModelConfig) -> float | None:
        """The factor the token embeddings are multiplied by (in the embedding's dtype), None for none."""
        return None

    def layer_module(self, mixer: str):
        """The Flax module class of a layer whose token mixer is `mixer` ("attention" or "linear_attention",
        `ModelConfig.layer_kinds`), built
        as cls(config, dtype, attn_impl, backend, mlp=<"dense" | "moe">, name=...), called as
        `dflash_jax.models.target.TargetLayer` is (or, for a linear mixer, as `families.qwen3_5.HybridLayer`)."""
        from dflash_jax.models.target import TargetLayer

        return TargetLayer

    # the token mixers whose layers keep a state of their own beside (or instead of) keys and values:
    # the cache holds it by name (`Cache.layer_states`), the stack hands each such layer its own
    # entries, and the layer returns the pending inputs its cache's `commit` writes (Qwen3.5's Gated
    # DeltaNet: "conv" tails and delta-rule "state"s)
    stateful_mixers: tuple[str, ...] = ()

    def initial_layer_state(self, config: ModelConfig, mixer: str, batch: int, dtype) -> dict:
        """The state a layer of a stateful mixer starts from without a cache (a forward over a whole
        sequence): its `Cache.layer_states` entries for one layer, at their start."""
        raise NotImplementedError(f"{self.name}: no layer of mixer {mixer!r} keeps a state")

    def init_cache(self, config: ModelConfig, batch: int, capacity: int, dtype, *, kv_replicas: int = 1,
                   groups: int = 1):
        """An empty decode cache (`dflash_jax.models.cache.Cache`) of a family whose layers keep something other
        than the stack's default (a `KVCache`, or a hybrid's `HybridCache`); None: the default."""
        return None

    norm_scale_in_float32: bool = False  # RMSNorm scaled in float32 before the cast (gpt-oss)

    def final_norm(self, config: ModelConfig, dtype):
        from dflash_jax.layers.common import RMSNorm

        return RMSNorm(config.rms_norm_eps, dtype, self.norm_scale_in_float32)

    # ---- the checkpoint name table

    def target_rules(self, config: ModelConfig, prefix: str = "model.") -> list[Rule]:
        """Hugging Face name <-> param path of every weight (`loading.names.hf_to_params` /
        `params_to_hf`): the embedding, each layer by its kind at its place in the stack's segments
        (`dflash_jax.models.stack`), the final norm, an untied head."""
        rules = [Rule(f"{prefix}embed_tokens.weight", ("embed_tokens", "embedding")),
                 Rule(f"{prefix}norm.weight", ("norm", "scale"))]
        segments, direct = stack_segments(config.layer_kinds), is_direct(config)
        for s, segment in enumerate(segments):
            for position, (mixer, mlp) in enumerate(segment.pattern):
                ids, path = segment.layer_ids(position), segment_path(segments, s, position, direct)
                hf = f"{prefix}layers.{{i}}"
                layer = [Rule(f"{hf}.{n}.weight", (*path, n, "scale"), layer_ids=ids)
                         for n in ("input_layernorm", "post_attention_layernorm")]
                layer += self.mixer_rules(config, mixer, hf, path, ids)
                layer += self.mlp_rules(config, mlp, hf, (*path, "mlp"), ids)
                rules += layer
        if not config.tie_word_embeddings:
            rules.append(Rule("lm_head.weight", ("lm_head", "kernel"), transpose=True))
        return rules

    def mixer_rules(self, config: ModelConfig, mixer: str, hf: str, path: tuple, ids) -> list[Rule]:
        """Rules of a layer's token mixer (attention: q/k/v/o, biases where the config says, q/k norms)."""
        attn = (*path, "self_attn")
        rules = _linear_rules(f"{hf}.self_attn", attn, ATTENTION_PROJECTIONS, config.attention_bias, ids)
        if config.qk_norm:
            rules += [Rule(f"{hf}.self_attn.{n}.weight", (*attn, n, "scale"), layer_ids=ids)
                      for n in ("q_norm", "k_norm")]
        return rules

    def mlp_rules(self, config: ModelConfig, mlp: str, hf: str, path: tuple, ids) -> list[Rule]:
        """Rules of a layer's MLP: the dense SwiGLU, or the MoE block in its released layout."""
        if mlp == "moe":
            return moe_layer_rules(hf, config.num_experts, path, ids,
                                   shared_expert=config.moe.shared_expert_intermediate_size > 0)
        return _linear_rules(f"{hf}.mlp", path, MLP_PROJECTIONS, config.mlp_bias, ids)

    # ---- checkpoints as released

    def checkpoint_prefix(self, tensors: Mapping) -> str:
        """The prefix of the text model's names in a checkpoint (the first of `checkpoint_prefixes`
        whose embedding is there)."""
        for prefix in self.checkpoint_prefixes:
            if f"{prefix}embed_tokens.weight" in tensors:
                return prefix
        return self.checkpoint_prefixes[0]

    def adapt_tensors(self, config: ModelConfig, tensors: Mapping, source: str) -> Mapping:
        """The checkpoint's tensors as the name table reads them (a view, nothing copied): by default an
        MoE checkpoint's fused expert tensors shown per expert (`loading.names.unfuse_experts`)."""
        return unfuse_experts(tensors, source) if config.moe is not None else tensors

    def unused_tensors(self, name: str) -> bool:
        """Whether a checkpoint tensor the text model does not read is expected (a vision tower, ...)."""
        return False

    def allow_extra(self, config: ModelConfig, tensors: Mapping, source: str, prefix: str) -> Callable[[str], bool]:
        """The extra checkpoint tensors that are not an error: a tied head equal to the embedding (some
        exports save both; a different one would be silently dropped: CheckpointError), and this
        family's `unused_tensors`."""
        name, embed = "lm_head.weight", f"{prefix}embed_tokens.weight"
        tied_copy = False
        if config.tie_word_embeddings and name in tensors and embed in tensors:
            if not np.array_equal(np.asarray(tensors[name]), np.asarray(tensors[embed])):
                raise CheckpointError(
                    f"{source} has a {name} that differs from {embed} but its config says "
                    "tie_word_embeddings: true, so the head would be dropped; set tie_word_embeddings to "
                    "false, or remove the tensor")
            tied_copy = True
        return lambda n: (tied_copy and n == name) or self.unused_tensors(n)
