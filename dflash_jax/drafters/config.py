"""The DFlash drafter config, read from / written to the official `config.json` layout, and the
check that a drafter fits a target (`validate_pair`). A DFlash2 drafter (`DFlash2DraftModel`) is the
same config with its `dflash2` fields set (`DFlash2Config`); a DSpark drafter (DeepSeek's DeepSpec,
`Qwen3DSparkModel`) with its `dspark` fields set (`DSparkConfig`)."""
from __future__ import annotations

import dataclasses
import math

from dflash_jax._errors import DrafterMismatchError
from dflash_jax.models.config import ConfigFields, decoder_fields, LayerLayout


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The official layer-selection rule (36-layer target, 5 draft layers -> (1, 9, 17, 25, 33))."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    return tuple(int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


def resolve_mask_token_id(explicit: int | None, tokenizer=None, vocab_size: int | None = None) -> int:
    """dflash_config.mask_token_id; else the tokenizer's mask token; else the first unused embedding
    row (len(tokenizer) when the vocabulary is padded); else pad; else eos."""
    if explicit is not None:
        return int(explicit)
    if tokenizer is not None:
        if getattr(tokenizer, "mask_token_id", None) is not None:
            return int(tokenizer.mask_token_id)
        if vocab_size is not None and len(tokenizer) < vocab_size:
            return len(tokenizer)
        for attr in ("pad_token_id", "eos_token_id"):
            if getattr(tokenizer, attr, None) is not None:
                return int(getattr(tokenizer, attr))
    raise ValueError("cannot resolve a mask token id: the drafter config has no "
                     "dflash_config.mask_token_id and no tokenizer was given")


ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel", "Qwen3DSparkModel")
MARKOV_HEAD_TYPES = ("vanilla",)  # DeepSpec's gated and RNN variants are refused by name


@dataclasses.dataclass(frozen=True)
class DFlash2Config:
    """What a DFlash2 drafter adds to DFlash (the authors' `DFlash2DraftModel`): a grouped dynamic
    causal convolution of kernel size T = `conv_kernel_size` over groups of `conv_group_size`
    channels before and after every attention and MLP sublayer, and a candidate selector that walks
    the block through the top `selector_top_k` candidates of each position with a pairwise term of
    rank `selector_rank` (`dflash_jax.drafters.dflash2`)."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int

    FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

    def __post_init__(self):
        for name in self.FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"dflash_config.{name} must be a positive integer, got {value!r}")

    @classmethod
    def from_fields(cls, dflash, fields) -> "DFlash2Config":
        """Each field from dflash_config first, then the top level (as the reference reads them); a
        field in neither is an error naming it."""
        values = {}
        for name in cls.FIELDS:
            value = dflash.int(name, None)
            values[name] = fields.int(name, None) if value is None else value
            if values[name] is None:
                raise fields.error(f"a DFlash2DraftModel config needs dflash_config.{name} (or a top-level "
                                   f"{name}); it has neither")
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    """What a DSpark drafter (DeepSpec's `Qwen3DSparkModel`) adds to the DFlash backbone
    (`dflash_jax.drafters.dspark`): its own token embeddings and LM head (copies of the target's tables), the
    anchor slot proposing too (a block of G slots gives G proposals), a Markov head of rank
    `markov_rank` (0: none) that biases each slot's logits by the token drafted before it, and
    optionally a confidence head over [h_k ; W1[x_{k-1}]] (`confidence_head_with_markov`) or h_k.
    sample_from_anchor False (a config that says so; DeepSpec's own never does): the older 1+N
    block, whose anchor slot does not propose (G - 1 proposals, the chain starting at slot 1)."""

    markov_rank: int
    enable_confidence_head: bool
    confidence_head_with_markov: bool = False
    markov_head_type: str = "vanilla"
    sample_from_anchor: bool = True
    # The tables (of "embed_tokens", "lm_head") that the checkpoint leaves out because they are the
    # target's (the speculators layout may): filled in from the target at load time, and left out
    # again by an export in that layout. Not part of the math.
    shared_tables: tuple[str, ...] = ()
    # A reduced draft vocabulary (the speculators layout's d2t/t2d): the drafter proposes only these
    # Vd target ids. Its LM head and Markov W2 are held over the whole vocabulary (zero columns
    # elsewhere) with a [V] bias of 0 at the kept ids and -inf elsewhere (`drafters.dspark.base_logits`), so
    # the draft distribution is zero off them. None: the whole vocabulary.
    draft_vocab_size: int | None = None

    def __post_init__(self):
        if not isinstance(self.markov_rank, int) or isinstance(self.markov_rank, bool) or self.markov_rank < 0:
            raise ValueError(f"markov_rank must be an integer >= 0 (0: no Markov head), got {self.markov_rank!r}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type {self.markov_head_type!r} is not supported (supported: "
                             f"{list(MARKOV_HEAD_TYPES)}; DeepSpec's gated and RNN Markov heads are not implemented)")
        if self.confidence_head_with_markov and not self.enable_confidence_head:
            raise ValueError("confidence_head_with_markov needs enable_confidence_head")
        if self.confidence_head_with_markov and self.markov_rank == 0:
            raise ValueError("confidence_head_with_markov needs a Markov head (markov_rank > 0)")
        bad = [t for t in self.shared_tables if t not in SHARED_TABLES]
        if bad:
            raise ValueError(f"shared_tables {bad}: only {list(SHARED_TABLES)} can be the target's")

    @property
    def confidence_inputs(self) -> int:
        """Extra inputs of the confidence head beside the hidden state: the Markov embedding's rank."""
        return self.markov_rank if self.confidence_head_with_markov else 0

    @classmethod
    def from_fields(cls, fields) -> "DSparkConfig":
        """From DeepSpec's top-level config.json fields; a missing required one is an error naming it."""
        rank = fields.int("markov_rank")
        enabled = fields.bool("enable_confidence_head")
        return cls(markov_rank=rank, enable_confidence_head=enabled,
                   confidence_head_with_markov=fields.bool("confidence_head_with_markov") if enabled else False,
                   markov_head_type=_str_field(fields, "markov_head_type") if rank > 0 else "vanilla",
                   sample_from_anchor=fields.bool("sample_from_anchor", True))

    def write(self, hf: dict) -> None:
        """Its fields into a config.json dict, as DeepSpec writes them (the optional ones only where used)."""
        hf["markov_rank"] = self.markov_rank
        hf["enable_confidence_head"] = self.enable_confidence_head
        for name, used in (("markov_head_type", self.markov_rank > 0),
                           ("confidence_head_with_markov", self.enable_confidence_head),
                           ("sample_from_anchor", not self.sample_from_anchor)):
            if used:
                hf[name] = getattr(self, name)
            else:
                hf.pop(name, None)


def _str_field(fields, name: str) -> str:
    value = fields.hf.get(name)
    if not isinstance(value, str):
        raise fields.error(f"field {fields.prefix + name!r} must be a string, got {value!r}"
                           if value is not None else f"missing required field {fields.prefix + name!r}")
    return value


SHARED_TABLES = ("embed_tokens", "lm_head")
SPECULATORS_ARCHITECTURE = "DSparkSpeculator"


def is_speculators_dspark(hf: dict) -> bool:
    """Whether a config.json is a DSpark drafter in the speculators layout (`DSparkSpeculatorConfig`:
    `speculators_model_type: "dspark"`, `architectures: ["DSparkSpeculator"]`)."""
    archs = hf.get("architectures") or ()
    named = isinstance(archs, list) and SPECULATORS_ARCHITECTURE in archs
    return hf.get("speculators_model_type") == "dspark" or named


def _speculators_error(fields, message: str):
    return fields.error(f"a DSpark drafter in the speculators layout ({SPECULATORS_ARCHITECTURE}): {message}")


def speculators_is_causal(config) -> bool:
    """`sliding_window_non_causal` of the speculators layout for a drafter config: sliding layers
    causal inside the block unless it is true; full layers never causal. ValueError where the
    config's causality is not one of those."""
    sliding = [c for c, t in zip(config.layer_causal, config.layer_types) if t == "sliding_attention"]
    full = [c for c, t in zip(config.layer_causal, config.layer_types) if t != "sliding_attention"]
    if any(full):
        raise ValueError("the speculators layout has no causal full-attention layers (is_causal true over "
                         "full_attention layers)")
    return bool(sliding) and not any(sliding)


@dataclasses.dataclass(frozen=True)
class DrafterConfig(LayerLayout):
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int | None  # None: not in config.json; taken from the target at load time
    target_layer_ids: tuple[int, ...]
    block_size: int = 16
    mask_token_id: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: tuple = (("rope_type", "default"),)
    max_position_embeddings: int = 40960
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    attention_bias: bool = False
    # A reduced draft vocabulary (EAGLE-3 layout: `lm_head.weight`, `d2t`, `t2d` in the weights):
    # the drafter's own head predicts draft_vocab_size target ids. None: the target's LM head.
    draft_vocab_size: int | None = None
    # The authors' current reference (`dflash/model.py`): None = a sliding layer is causal inside the
    # block and a full layer is not (kept None only where the layers mix both kinds; otherwise that
    # default is resolved to the bool); a bool makes every layer causal or not (`layer_causal`).
    is_causal: bool | None = None
    input_embedding_scale: float = 1.0  # times the block's token embeddings
    output_multiplier: float = 1.0  # times the draft logits, then
    final_logit_softcapping: float = 0.0  # > 0: c * tanh(logits / c)
    dflash2: DFlash2Config | None = None  # set: a DFlash2 drafter (convolutions and candidate selector)
    dspark: DSparkConfig | None = None  # set: a DSpark drafter (own tables, Markov and confidence heads)

    def __post_init__(self):
        self._validate_sizes("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                             "head_dim", "vocab_size")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must not be empty")
        bad = [i for i in self.target_layer_ids
               if i < 0 or (self.num_target_layers is not None and i >= self.num_target_layers)]
        if bad:
            raise ValueError(f"target_layer_ids {bad} out of range for {self.num_target_layers} target layers")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must lie in [1, vocab_size={self.vocab_size}], "
                             f"got {self.draft_vocab_size}")
        self._validate_layer_types()
        if self.is_causal is None and len(set(self.layer_types)) == 1:  # one value says it: say it
            object.__setattr__(self, "is_causal", self.layer_types[0] == "sliding_attention")
        if self.final_logit_softcapping < 0:
            raise ValueError(f"final_logit_softcapping must be >= 0 (0: none), got {self.final_logit_softcapping}")
        for name in ("input_embedding_scale", "output_multiplier"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) == 0:
                raise ValueError(f"{name} must be a finite nonzero number, got {getattr(self, name)}")
        if self.dflash2 is not None:
            self._validate_dflash2()
        if self.dspark is not None:
            self._validate_dspark()

    def _validate_dflash2(self):
        d2 = self.dflash2
        if self.hidden_size % d2.conv_group_size:
            raise ValueError(f"DFlash2: conv_group_size {d2.conv_group_size} must divide hidden_size "
                             f"{self.hidden_size}")
        if d2.selector_top_k > self.vocab_size:
            raise ValueError(f"DFlash2: selector_top_k {d2.selector_top_k} exceeds vocab_size {self.vocab_size}")
        if self.draft_vocab_size is not None:
            raise ValueError("DFlash2: a reduced draft vocabulary (draft_vocab_size) is not supported: the "
                             "selector's codebooks index the whole vocabulary")

    def _validate_dspark(self):
        if self.dflash2 is not None:
            raise ValueError("a drafter is DFlash2 or DSpark, not both")
        if self.draft_vocab_size is not None:
            raise ValueError("DSpark: a reduced draft vocabulary is DSparkConfig.draft_vocab_size (the "
                             "speculators layout's d2t), not DrafterConfig.draft_vocab_size")
        size = self.dspark.draft_vocab_size
        if size is not None and not 1 <= size < self.vocab_size:
            raise ValueError(f"DSpark: draft_vocab_size must lie in [1, vocab_size={self.vocab_size}), got {size}")
        for name, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                              ("final_logit_softcapping", 0.0)):
            if getattr(self, name) != default:
                raise ValueError(f"DSpark: {name} is not part of Qwen3DSparkModel (got {getattr(self, name)})")

    def with_shared_tables(self, shared) -> "DrafterConfig":
        """This config with the tables `shared` (of `SHARED_TABLES`) taken from the target: a DSpark
        drafter in the speculators layout whose checkpoint leaves them out."""
        return dataclasses.replace(self, dspark=dataclasses.replace(self.dspark, shared_tables=tuple(shared)))

    @property
    def generation(self) -> str:
        """The drafter generation's name (`drafters.generations`: "dflash", "dflash2" or "dspark"), from the
        generation config it holds; this module and the registry are the only ones that look."""
        if self.dspark is not None:
            return "dspark"
        return "dflash2" if self.dflash2 is not None else "dflash"

    @property
    def architecture(self) -> str:
        """The config.json architecture: DFlashDraftModel, DFlash2DraftModel or Qwen3DSparkModel."""
        if self.dspark is not None:
            return "Qwen3DSparkModel"
        return ARCHITECTURES[self.dflash2 is not None]

    @property
    def proposals(self) -> int:
        """Drafted tokens per cycle at the config's block size: G for DSpark (the anchor slot
        proposes too: `sample_from_anchor`), G - 1 for DFlash."""
        return self.block_size if self.dspark is not None and self.dspark.sample_from_anchor else self.block_size - 1

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def layer_causal(self) -> tuple[bool, ...]:
        """Per layer: whether a block query sees only the block keys at or before its own position."""
        if self.is_causal is not None:
            return (self.is_causal,) * self.num_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @property
    def full_layers_causal(self) -> bool:
        """Whether the full-attention layers are causal (one value for all of them, as for sliding ones)."""
        return bool(self.is_causal)

    @property
    def sliding_layers_causal(self) -> bool:
        return self.is_causal is not False

    def block_embeddings(self, embeds):
        """The block's token embeddings as the layers read them (times input_embedding_scale)."""
        return embeds if self.input_embedding_scale == 1.0 else embeds * self.input_embedding_scale

    def draft_logits(self, logits):
        """The head's logits as the drafter's distribution: times output_multiplier, then softcapped."""
        import jax.numpy as jnp

        if self.output_multiplier != 1.0:
            logits = logits * self.output_multiplier
        if self.final_logit_softcapping > 0:
            cap = self.final_logit_softcapping
            logits = jnp.tanh(logits / cap) * cap
        return logits

    @classmethod
    def from_hf_config(cls, hf: dict, tokenizer=None, source: str = "config.json") -> "DrafterConfig":
        """From the official config.json dict; `source` (the file) is named in every error."""
        fields = ConfigFields(hf, source)
        if is_speculators_dspark(hf):
            return cls._from_speculators_dspark(fields, tokenizer)
        archs = fields.str_list("architectures", ())
        known = [a for a in archs if a in ARCHITECTURES]
        if archs and not known:
            raise fields.error(f"not a DFlash drafter config: architectures={list(archs)} "
                               f"(expected one of {list(ARCHITECTURES)})")
        if "Qwen3DSparkModel" in known:
            return cls._from_dspark_config(fields, tokenizer)
        dflash = fields.section("dflash_config")
        dflash2 = DFlash2Config.from_fields(dflash, fields) if "DFlash2DraftModel" in known else None
        num_target_layers = fields.int("num_target_layers", None)
        layer_ids = dflash.int_list("target_layer_ids", None)
        if layer_ids is None:
            if num_target_layers is None:
                raise fields.error("drafter config needs num_target_layers or dflash_config.target_layer_ids")
            layer_ids = default_target_layer_ids(num_target_layers, fields.int("num_hidden_layers"))
        vocab_size = fields.int("vocab_size")
        mask_token_id = dflash.int("mask_token_id", None)
        if mask_token_id is not None or tokenizer is not None:
            mask_token_id = resolve_mask_token_id(mask_token_id, tokenizer, vocab_size)
        # as the reference reads them: dflash_config first, then the top level
        scaled = {name: dflash.float(name, fields.float(name, default))
                  for name, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                                        ("final_logit_softcapping", 0.0))}
        return fields.build(
            cls,
            **decoder_fields(fields, default_max_positions=40960),
            vocab_size=vocab_size,
            num_target_layers=num_target_layers,
            target_layer_ids=layer_ids,
            block_size=dflash.int("block_size", fields.int("block_size", 16)),
            mask_token_id=mask_token_id,
            attention_bias=fields.bool("attention_bias", False),
            draft_vocab_size=fields.int("draft_vocab_size", None),
            is_causal=fields.bool("is_causal", None),
            dflash2=dflash2,
            **scaled,
        )

    @classmethod
    def _from_dspark_config(cls, fields, tokenizer=None) -> "DrafterConfig":
        """DeepSpec's own config.json (`Qwen3DSparkModel`): Qwen3 fields plus top-level
        target_layer_ids, mask_token_id, block_size, num_target_layers and the heads' fields."""
        layer_ids = fields.int_list("target_layer_ids")
        if -1 in layer_ids:
            raise fields.error(f"target_layer_ids {list(layer_ids)}: an id of -1 (the target's embedding output "
                               "as a context feature) is not supported")
        mask_token_id = fields.int("mask_token_id", None)
        vocab_size = fields.int("vocab_size")
        if mask_token_id is not None or tokenizer is not None:
            mask_token_id = resolve_mask_token_id(mask_token_id, tokenizer, vocab_size)
        if fields.bool("tie_word_embeddings", False):
            raise fields.error("a Qwen3DSparkModel with tie_word_embeddings is not supported (DeepSpec stores "
                               "embed_tokens and lm_head apart)")
        return fields.build(
            cls,
            **decoder_fields(fields, default_max_positions=40960),
            vocab_size=vocab_size,
            num_target_layers=fields.int("num_target_layers", None),
            target_layer_ids=layer_ids,
            block_size=fields.int("block_size"),
            mask_token_id=mask_token_id,
            attention_bias=fields.bool("attention_bias", False),
            is_causal=fields.bool("is_causal", None),
            dspark=fields.build(DSparkConfig.from_fields, fields=fields),
        )

    @classmethod
    def _from_speculators_dspark(cls, fields, tokenizer=None) -> "DrafterConfig":
        """The speculators layout of a DSpark drafter (`DSparkSpeculatorConfig`, a
        `DFlashSpeculatorConfig`): the decoder fields nested in `transformer_layer_config`,
        `aux_hidden_state_layer_ids` = target layer ids + 1 (hidden-state indices, 0 the embedding
        output), `draft_vocab_size` (the whole vocabulary, or a reduced one shipped as d2t/t2d),
        `sliding_window_non_causal`, and the heads' fields with the speculators class's defaults where
        absent (block_size 8, markov_rank 256, markov_head_type "vanilla", enable_confidence_head and
        confidence_head_with_markov true). speculators serializes every field of its config, and
        `sample_from_anchor` only exists since its PR #760: a config without it comes from the
        earlier code, whose slot k predicted anchor + k (the 1+N block), so absent means false."""
        if not isinstance(fields.hf.get("transformer_layer_config"), dict):
            raise _speculators_error(fields, "missing required field 'transformer_layer_config' (an object "
                                             "holding the decoder's fields)")
        layer = fields.section("transformer_layer_config")
        for name in ("aux_hidden_state_layer_ids", "draft_vocab_size"):
            if fields.hf.get(name) is None:
                raise _speculators_error(fields, f"missing required field {name!r}")
        aux = fields.int_list("aux_hidden_state_layer_ids")
        if not aux:
            raise _speculators_error(fields, "aux_hidden_state_layer_ids is empty")
        if min(aux) < 1:
            raise _speculators_error(fields, f"aux_hidden_state_layer_ids {list(aux)}: an id of 0 (the target's "
                                             "embedding output as a context feature) is not supported")
        decoder = decoder_fields(layer, default_max_positions=40960)
        vocab_size = layer.int("vocab_size")
        target_hidden = fields.int("target_hidden_size", None)
        if target_hidden is not None and target_hidden != decoder["hidden_size"]:
            raise _speculators_error(fields, f"target_hidden_size {target_hidden} differs from the drafter's "
                                             f"hidden_size {decoder['hidden_size']}; not supported")
        draft_vocab = fields.int("draft_vocab_size")
        if not 1 <= draft_vocab <= vocab_size:
            raise _speculators_error(fields, f"draft_vocab_size {draft_vocab} must lie in [1, vocab_size "
                                             f"{vocab_size}]")
        mask_token_id = fields.int("mask_token_id", None)
        if mask_token_id is not None or tokenizer is not None:
            mask_token_id = resolve_mask_token_id(mask_token_id, tokenizer, vocab_size)
        rank = fields.int("markov_rank", 256)
        enabled = fields.bool("enable_confidence_head", True)
        head_type = fields.hf.get("markov_head_type", "vanilla")
        if not isinstance(head_type, str):
            raise _speculators_error(fields, f"field 'markov_head_type' must be a string, got {head_type!r}")
        heads = fields.build(DSparkConfig, markov_rank=rank, enable_confidence_head=enabled,
                             confidence_head_with_markov=enabled and fields.bool("confidence_head_with_markov", True),
                             markov_head_type=head_type, sample_from_anchor=fields.bool("sample_from_anchor", False),
                             draft_vocab_size=None if draft_vocab == vocab_size else draft_vocab)
        return fields.build(
            cls,
            **decoder,
            vocab_size=vocab_size,
            num_target_layers=None,
            target_layer_ids=tuple(i - 1 for i in aux),
            block_size=fields.int("block_size", 8),
            mask_token_id=mask_token_id,
            attention_bias=layer.bool("attention_bias", False),
            is_causal=False if fields.bool("sliding_window_non_causal", False) else None,
            dspark=heads,
        )

    def to_speculators_config(self, base: dict | None = None, dtype_name: str = "bfloat16") -> dict:
        """The speculators layout's config.json of a DSpark drafter (`DSparkSpeculatorConfig`); the
        fields of `base` (a loaded speculators config) that we don't model are kept, inside
        `transformer_layer_config` too. Every head field is written explicitly (sample_from_anchor
        included, whose default readers take differently), as speculators writes them."""
        if self.dspark is None:
            raise ValueError("the speculators layout is written here for DSpark drafters only")
        hf = dict(base or {})
        layer = dict(hf.get("transformer_layer_config") or {})
        rope = dict(self.rope_scaling)
        rope_type = rope.pop("rope_type", "default")
        if "rope_parameters" in layer:
            layer["rope_parameters"] = {**rope, "rope_type": rope_type, "rope_theta": self.rope_theta}
        else:
            layer["rope_theta"] = self.rope_theta
            if rope_type != "default" or layer.get("rope_scaling") is not None:
                layer["rope_scaling"] = None if rope_type == "default" else {"rope_type": rope_type, **rope}
        layer.setdefault("model_type", "qwen3")
        layer.update(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                     num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
                     num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, vocab_size=self.vocab_size,
                     rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
                     attention_bias=self.attention_bias, layer_types=list(self.layer_types))
        if self.sliding_window:
            layer["sliding_window"] = self.sliding_window
        d = self.dspark
        hf.update(
            architectures=[SPECULATORS_ARCHITECTURE],
            speculators_model_type="dspark",
            transformer_layer_config=layer,
            aux_hidden_state_layer_ids=[i + 1 for i in self.target_layer_ids],
            block_size=self.block_size,
            draft_vocab_size=self.dspark.draft_vocab_size or self.vocab_size,
            sliding_window_non_causal=speculators_is_causal(self),
            markov_rank=d.markov_rank,
            markov_head_type=d.markov_head_type,
            enable_confidence_head=d.enable_confidence_head,
            confidence_head_with_markov=d.confidence_head_with_markov,
            sample_from_anchor=d.sample_from_anchor,
            dtype=dtype_name,
        )
        hf.pop("torch_dtype", None)
        if self.mask_token_id is not None:
            hf["mask_token_id"] = self.mask_token_id
        hf.setdefault("speculators_config", {
            "algorithm": "dspark",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": self.proposals}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": None, "architectures": []}})
        return hf

    def to_hf_config(self, base: dict | None = None, dtype_name: str = "bfloat16") -> dict:
        """The official config.json; fields of `base` (the loaded file) that we don't model are kept."""
        hf = dict(base or {})
        rope = dict(self.rope_scaling)
        rope_type = rope.pop("rope_type", "default")
        hf.update(
            architectures=[self.architecture],
            model_type="qwen3",
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=None if rope_type == "default" else {"rope_type": rope_type, **rope},
            max_position_embeddings=self.max_position_embeddings,
            layer_types=list(self.layer_types),
            sliding_window=self.sliding_window or hf.get("sliding_window"),
            attention_bias=self.attention_bias,
            tie_word_embeddings=False,
            block_size=self.block_size,
            dtype=dtype_name,
        )
        for name in ("num_target_layers", "draft_vocab_size"):
            if getattr(self, name) is None:
                hf.pop(name, None)
            else:
                hf[name] = getattr(self, name)
        # is_causal written out wherever one value says it (None: mixed layers, the readers' default)
        if self.is_causal is None:
            hf.pop("is_causal", None)
        else:
            hf["is_causal"] = self.is_causal
        hf.pop("torch_dtype", None)  # older name of `dtype`; never leave a stale one behind
        hf.pop("rope_parameters", None)
        dflash = dict(hf.get("dflash_config") or {})
        dflash["target_layer_ids"] = list(self.target_layer_ids)
        if self.mask_token_id is not None:
            dflash["mask_token_id"] = self.mask_token_id
        if "block_size" in dflash:
            dflash["block_size"] = self.block_size
        for name, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                              ("final_logit_softcapping", 0.0)):
            hf.pop(name, None)  # one place for them: dflash_config, which the reference reads first
            if getattr(self, name) != default:
                dflash[name] = getattr(self, name)
            else:
                dflash.pop(name, None)
        for name in DFlash2Config.FIELDS:  # in dflash_config, where the reference reads them first
            hf.pop(name, None)
            if self.dflash2 is None:
                dflash.pop(name, None)
            else:
                dflash[name] = getattr(self.dflash2, name)
        hf["dflash_config"] = dflash
        if self.dspark is not None:  # DeepSpec's layout: its fields at the top level, no dflash_config
            if self.dspark.draft_vocab_size is not None:
                raise ValueError("DeepSpec's layout has no reduced draft vocabulary: write this DSpark drafter in "
                                 "the speculators layout (layout='speculators')")
            del hf["dflash_config"]
            hf["target_layer_ids"] = list(self.target_layer_ids)
            if self.mask_token_id is not None:
                hf["mask_token_id"] = self.mask_token_id
            self.dspark.write(hf)
        return hf


def validate_pair(config: DrafterConfig, target) -> None:
    """Raise DrafterMismatchError naming both sides when the drafter cannot serve this target."""
    tc = target.config
    problems = []
    if config.hidden_size != tc.hidden_size:
        problems.append(f"hidden size: drafter {config.hidden_size} vs target {tc.hidden_size}")
    if config.vocab_size != tc.vocab_size:
        problems.append(f"vocab size: drafter {config.vocab_size} vs target {tc.vocab_size}")
    if config.num_target_layers is not None and config.num_target_layers != tc.num_layers:
        problems.append(f"number of target layers: drafter expects {config.num_target_layers}, "
                        f"target has {tc.num_layers}")
    bad = [i for i in config.target_layer_ids if not 0 <= i < tc.num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} out of range for a {tc.num_layers}-layer target")
    if config.mask_token_id is None or not 0 <= config.mask_token_id < tc.vocab_size:
        problems.append(f"mask token id {config.mask_token_id} is not inside the target vocabulary "
                        f"(size {tc.vocab_size})")
    if problems:
        raise DrafterMismatchError("drafter does not match target: " + "; ".join(problems))
