"""Drafter generations as a registry, as target families are (`dflash_jax.families`).

A generation (`Generation`) is what one kind of DFlash drafter adds to the shared backbone (context
projection, K/V-injected layers, final norm, `drafters.drafter`), in one place:
- its own config (`own`: `DrafterConfig.dflash2` / `.dspark`, read and written by `drafters.config`,
  the one other module that tells generations apart),
- the modules it adds around each layer's sublayers (`layer_modules`, `wraps_sublayers`) and at the
  drafter's top (`head_modules`, `init_heads`),
- the block it drafts and how (`drafter_slots`, `embed_block`, `propose` -> a `Proposal`),
- what a generation call may ask of it (`accepts_confidence_threshold`),
- its checkpoint names and export layouts (`name_rules`, `layouts`, `own_tables`,
  `own_draft_vocab_size`),
- its training loss (`block_loss_term` and `add_block_loss_terms` on DFlash's block loss, or a loss
  of its own: `trains_own_loss`, `batch_loss`), its defaults for training (`train_fields`,
  `loss_weights`, `default_decay`) and what the profiler times of it (`timed_pieces`).

The decode loop, the engine, training, conversion and the CLIs ask `of(config)`; none of them tests
which generation it holds. Adding a generation: a `Generation` subclass here registered in
`GENERATIONS`, its config in `drafters.config` (read, validated, written), its math in a module of
its own beside `dflash2` and `dspark`, and its rows in the tests (tests/drafters/).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dflash_jax.decode import sampling
from dflash_jax.decode.loop import slot_confidence, target_probs
from dflash_jax.drafters import dflash2, dspark, objective
from dflash_jax.drafters.config import DFlash2Config, DSparkConfig
from dflash_jax.formats.names import drafter_rules, linear_rules, Rule


class Proposal(NamedTuple):
    """What a drafter proposes for one cycle: `drafts` [B, S] (target ids, S = the verify block - 1),
    `probs` [B, S, V] (their distribution q over the target vocabulary, which the exact rule reads;
    None unless sampling with it), `confidence` (`decode.loop.slot_confidence`: the top probability
    of the first slot [B] or of every slot [B, S] where the loop gates or plans its verify; None
    otherwise) and `limit` [B] (how many leading drafts each row verifies; None: all)."""

    drafts: Any
    probs: Any = None
    confidence: Any = None
    limit: Any = None


class Generation:
    """DFlash, the first generation: the block [anchor, MASK x (G-1)] embedded with the target's table,
    slots 1..G-1 proposing through the target's LM head (or a reduced draft vocabulary's own head),
    drafted independently (argmax, or sampled from the filtered distribution). Subclasses override
    what they change."""

    name = "dflash"
    architecture = "DFlashDraftModel"
    layouts = ("official",)  # the export layouts of `save_drafter(layout=...)` besides "auto"
    wraps_sublayers = False  # modules around each layer's attention and MLP (`layer_modules`)
    trains_own_loss = False  # a loss of its own (`batch_loss`) instead of DFlash's block loss
    first_accuracy_slot = 1  # the block slot the training accuracy vector starts at (the first proposing one)

    def own(self, config):
        """Its own config inside a `DrafterConfig` (None for DFlash)."""
        return None

    # ---- the modules

    def layer_modules(self, config, dtype, backend: str) -> dict:
        """Modules of each decoder layer beyond the backbone's, by their param names."""
        return {}

    def head_modules(self, config, dtype) -> dict:
        """Modules at the drafter's top level beyond the backbone's, by their param names."""
        return {}

    def init_heads(self, config, modules: dict, hidden) -> None:
        """Create the params of `head_modules` (at initialisation) from the block's hidden states."""

    # ---- drafting

    def drafter_slots(self, config, verify_block: int) -> int:
        """The positions of the drafter's block for a cycle that verifies `verify_block` tokens."""
        return verify_block

    def block_tokens(self, config, cfg, anchors):
        """The drafter's block [anchor, MASK x (S-1)] [B, S] for a cycle verifying cfg.block_size tokens."""
        mask = jnp.full((anchors.shape[0], self.drafter_slots(config, cfg.block_size) - 1), config.mask_token_id,
                        jnp.int32)
        return jnp.concatenate([anchors[:, None], mask], axis=1)

    def embed_block(self, target, target_params, drafter, drafter_params, block):
        """The block's input embeddings [B, S, D] for its tokens [B, S]."""
        return drafter.config.block_embeddings(target.embed(target_params, block))

    def propose(self, target, drafter, cfg, target_params, drafter_params, anchors, draft_cache, key,
                params) -> Proposal:
        """One cycle's proposal for every row (`Proposal`). target / drafter: specs; cfg: the loop's
        `GenerationConfig` (its block_size is what a cycle verifies); params: its `SamplingParams`.

        A reduced draft vocabulary (drafter_params = {"drafter", "draft_head"}, see `Drafter`) drafts
        with its own head over Vd ids and maps the draft back through draft_to_target. Its
        distribution over the full vocabulary is the filtered draft distribution at the kept target
        ids and zero elsewhere, so the exact rule (min(1, p_t/p_d), residual max(0, p_t - p_d))
        stays lossless."""
        dc = drafter.config
        block = self.block_tokens(dc, cfg, anchors)
        embeds = self.embed_block(target, target_params, drafter, drafter_params, block)
        hidden = drafter.draft_hidden(drafter_params, embeds, draft_cache)[:, 1:]
        if dc.draft_vocab_size is not None:
            logits = drafter.draft_head_logits(drafter_params, hidden)  # [B, G-1, Vd] float32
        else:
            logits = target.logits(target_params, hidden)
        logits = dc.draft_logits(logits)
        return self.choose(drafter, cfg, drafter_params, hidden, logits, anchors, key, params,
                           slot_confidence(cfg, logits))

    def choose(self, drafter, cfg, drafter_params, hidden, logits, anchors, key, params, confidence) -> Proposal:
        """The drafts of the slots' logits [B, S, V(d)]: each slot's argmax, or drawn from its filtered
        distribution when sampling with the exact rule."""
        exact = cfg.sampling and cfg.acceptance == "exact"
        if exact:
            probs = target_probs(cfg, params, logits)
            drafts = sampling.sample(key, probs)
        else:
            probs, drafts = None, sampling.greedy(logits)
        if drafter.config.draft_vocab_size is None:
            return Proposal(drafts, probs, confidence)
        to_target = drafter_params["draft_head"]["draft_to_target"]  # [Vd]
        if exact:
            probs = jnp.zeros((*probs.shape[:-1], drafter.config.vocab_size), probs.dtype).at[..., to_target].set(probs)
        return Proposal(to_target[drafts], probs, confidence)

    def accepts_confidence_threshold(self, config) -> bool:
        """Whether `generate(confidence_threshold=...)` applies to this drafter (a confidence head)."""
        return False

    def walk(self, drafter, params, hidden, logits, anchors, temperature=None, key=None):
        """A candidate selector's walk over the proposal slots (DFlash2's); ValueError for a drafter
        without one."""
        raise ValueError(f"select: this drafter is not a DFlash2 drafter (a {self.name} drafter has no candidate "
                         "selector)")

    def timed_pieces(self, drafter, slots: int) -> dict:
        """`infer.profile_cycle`'s pieces of its own: {label: f(drafter params, hidden [B, S, D],
        logits [B, S, V], anchors [B])}."""
        return {}

    # ---- checkpoints

    def name_rules(self, config) -> list[Rule]:
        """The checkpoint name table of the drafter's own tensors (official layout)."""
        return drafter_rules(config.attention_bias)

    own_tables: tuple[str, ...] = ()  # its own copies of the target's tables (top-level params)

    def own_draft_vocab_size(self, config) -> int | None:
        """A reduced vocabulary the generation keeps in its own params (DSpark's speculators d2t); None."""
        return None

    def shared_tables(self, config) -> tuple[str, ...]:
        """Its tables that a checkpoint leaves to the target (read from it at load, left out at export)."""
        return ()

    # ---- published settings (random drafters of the benchmark and the profiler)

    published_verify_block = 16  # tokens a cycle of its released drafters verifies
    min_verify_block = 2  # the fewest tokens a cycle of it verifies (the anchor and one draft)

    def published(self, base):
        """`base` (a DFlash `DrafterConfig` whose block_size is what a cycle verifies) as this
        generation's drafter with its released drafters' settings."""
        return base

    # ---- training

    # its own `model.*` fields of a training config with their defaults (the released drafters':
    # DESIGN.md section 9; DeepSpec's config/dspark/dspark_qwen3_4b_online.py), and its loss weights in
    # `run.*` with theirs (speculators' and SpecForge's DFlash2 selector_loss_alpha; DeepSpec's)
    train_defaults: dict = {}
    loss_weight_defaults: dict = {}
    draft_vocab_allowed = True  # a reduced draft vocabulary (model.draft_vocab_size)

    def check_train_fields(self, field) -> str | None:
        """What is wrong with its own training fields (`field(name)`: the value or its default), or None."""
        return None

    def train_fields(self, field) -> dict:
        """DrafterConfig keywords of its own from a training config (`field(name)`: model.<name>)."""
        return {}

    def loss_weights(self, weight) -> dict:
        """StepSpec keywords of its loss weights (`weight(name)`: the run's loss weight)."""
        return {}

    def default_decay(self, config) -> float:
        """The position weights' decay when the run sets none (the paper's value for the block size)."""
        return objective.default_decay(config.block_size)

    def block_loss_term(self, config, drafter_params, tokens, anchors, labels):
        """An extra term of DFlash's block loss (`objective.weighted_block_loss(extra=)`), or None."""
        return None

    def add_block_loss_terms(self, spec, loss, extra, weights):
        """(loss, terms) of the block loss `loss` with the values of `block_loss_term` (none here)."""
        return loss, {}

    def batch_loss(self, target, drafter, spec, params, frozen, batch):
        """A loss of its own (`trains_own_loss`; drafter: the `DrafterSpec` at the compute dtype):
        (loss, per-proposal accuracy, terms)."""
        raise NotImplementedError(f"{self.name} drafters train with DFlash's block loss")


class DFlash2(Generation):
    """DFlash2 (`DFlash2DraftModel`): a grouped dynamic causal convolution around each attention and MLP
    sublayer (`dflash2.GroupedDynamicCausalConv`), and a candidate selector that walks the block
    through the top-K candidates of each slot (`select`): the argmax walk when greedy, else each
    slot drawn from softmax(score / temperature) over its K candidates (top_k and top_p filter the
    target's distribution only, as in the reference). The draft distribution the exact rule reads
    is that K-way q scattered on the candidate ids, zero elsewhere: min(1, p/q) and the residual
    max(0, p - q) keep it lossless."""

    name = "dflash2"
    architecture = "DFlash2DraftModel"
    wraps_sublayers = True

    def own(self, config) -> DFlash2Config:
        return config.dflash2

    def layer_modules(self, config, dtype, backend):
        d2 = config.dflash2
        conv = dict(hidden_size=config.hidden_size, kernel_size=d2.conv_kernel_size, group_size=d2.conv_group_size,
                    dtype=dtype, backend=backend)
        return {"attention_conv": dflash2.GroupedDynamicCausalConv(**conv),
                "mlp_conv": dflash2.GroupedDynamicCausalConv(**conv)}

    def head_modules(self, config, dtype):
        return {"candidate_selector": dflash2.CandidateSelector(config.vocab_size, config.dflash2.selector_rank,
                                                                dtype)}

    def init_heads(self, config, modules, hidden):
        modules["candidate_selector"](hidden)

    def walk(self, drafter, params, hidden, logits, anchors, temperature=None, key=None):
        """The selector's walk (`dflash2.select`) -> (drafts, candidates, chosen indices, q over them)."""
        return dflash2.select(drafter.module_params(params)["candidate_selector"], hidden, logits, anchors,
                              drafter.config.dflash2.selector_top_k, temperature, key)

    def select(self, drafter, cfg, drafter_params, hidden, logits, anchors, key, params):
        """The walk as a cycle runs it -> (drafts, their distributions or None)."""
        temperature = params.temperature if cfg.sampling else None
        drafts, candidates, index, q = self.walk(drafter, drafter_params, hidden, logits, anchors, temperature, key)
        probs = None
        if cfg.sampling and cfg.acceptance == "exact":
            probs = dflash2.scatter_q(q, candidates, drafter.config.vocab_size)
        return drafts, probs

    def choose(self, drafter, cfg, drafter_params, hidden, logits, anchors, key, params, confidence):
        return Proposal(*self.select(drafter, cfg, drafter_params, hidden, logits, anchors, key, params), confidence)

    def timed_pieces(self, drafter, slots):
        return {f"selector walk {slots}": lambda q, h, z, a: self.walk(drafter, q, h, z, a)[0]}

    def name_rules(self, config):
        rules = super().name_rules(config)
        for conv in ("attention_conv", "mlp_conv"):
            rules += [Rule(f"layers.{{i}}.{conv}.base_kernel", ("layers", conv, "base_kernel")),
                      Rule(f"layers.{{i}}.{conv}.kernel_projection.weight", ("layers", conv, "kernel_projection",
                                                                              "kernel"), transpose=True)]
        rules += [Rule(f"candidate_selector.{name}", ("candidate_selector", name))
                  for name in ("predecessor_codebook", "successor_codebook")]
        rules.append(Rule("candidate_selector.hidden_projection.weight",
                          ("candidate_selector", "hidden_projection", "kernel"), transpose=True))
        return rules

    published_verify_block = 8  # z-lab's DFlash2 drafters: blocks of 8
    published_settings = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
    train_defaults = published_settings
    loss_weight_defaults = {"selector_loss_alpha": 1.0}
    draft_vocab_allowed = False  # the selector's codebooks index the whole vocabulary

    def published(self, base):
        return dataclasses.replace(base, dflash2=DFlash2Config(**self.published_settings))

    def train_fields(self, field):
        return {"dflash2": DFlash2Config(*map(field, ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                      "selector_top_k")))}

    def loss_weights(self, weight):
        return {"selector_alpha": weight("selector_loss_alpha")}

    def block_loss_term(self, config, drafter_params, tokens, anchors, labels):
        """The selector's cross-entropy as an extra term of the block loss's chunks (the same draft
        logits; `objective.chunked_cross_entropy`): the teacher-forced predecessor is the text token
        before each label. Weighed afterwards with the backbone's slot weights."""
        b, n, g = labels.shape
        flat = lambda x: x.reshape(b, n * g)  # noqa: E731
        selector, top_k = drafter_params["candidate_selector"], config.dflash2.selector_top_k

        def term(h, logits, prev, y):
            return dflash2.selector_cross_entropy(selector, h, logits, prev, y, top_k)[0]

        return term, (flat(objective.block_predecessors(tokens, anchors, g)), flat(labels))

    def add_block_loss_terms(self, spec, loss, extra, weights):
        w = weights.reshape(extra[0].shape)
        selector = jnp.sum(w * extra[0]) / jnp.maximum(jnp.sum(w), 1e-9)
        return loss + spec.selector_alpha * selector, {"selector_loss": selector}


class DSpark(Generation):
    """DSpark (DeepSeek's DeepSpec, `Qwen3DSparkModel`; also the speculators layout `DSparkSpeculator`):
    the block [anchor, MASK x (G-2)] of G-1 slots embedded with the drafter's own table, all G-1 slots
    proposing (a cycle verifies G = cfg.block_size; without `sample_from_anchor`, DFlash's block of
    G slots, the anchor's not proposing), each slot's base logits from its own LM head biased by the
    Markov head and drafted left to right (`dspark.draft`): greedy, or at temperature > 0 drawn from
    the filtered biased distribution, which is then the exact draft distribution q the acceptance
    rule reads. With a confidence head and `params.confidence_threshold`, the proposal limit
    (`dspark.proposal_limit`)."""

    name = "dspark"
    architecture = "Qwen3DSparkModel"
    layouts = ("official", "speculators")
    trains_own_loss = True
    first_accuracy_slot = 0
    own_tables = ("embed_tokens", "lm_head")

    def own(self, config) -> DSparkConfig:
        return config.dspark

    def head_modules(self, config, dtype):
        return dspark.heads(config.dspark, config.vocab_size, config.hidden_size, dtype)

    def init_heads(self, config, modules, hidden):
        dspark.init_heads(config.dspark, modules, hidden)

    def drafter_slots(self, config, verify_block):
        return verify_block - 1 if config.dspark.sample_from_anchor else verify_block

    def embed_block(self, target, target_params, drafter, drafter_params, block):
        return dspark.block_embeddings(drafter.module_params(drafter_params), block)

    def propose(self, target, drafter, cfg, target_params, drafter_params, anchors, draft_cache, key, params):
        dc, module = drafter.config, drafter.module_params(drafter_params)
        from_anchor = dc.dspark.sample_from_anchor
        block = self.block_tokens(dc, cfg, anchors)
        hidden = drafter.draft_hidden(drafter_params, dspark.block_embeddings(module, block), draft_cache)
        hidden = hidden if from_anchor else hidden[:, 1:]
        logits = dc.draft_logits(dspark.base_logits(module, hidden))
        exact = cfg.sampling and cfg.acceptance == "exact"
        probs_fn = (lambda z: target_probs(cfg, params, z)) if exact else None
        drafts, _, probs, confidences = dspark.draft(dc.dspark, module, hidden, logits, anchors, probs_fn, key)
        first = slot_confidence(cfg, logits)  # not the confidence head's: c_k reads draft k - 1 (`_verify_plan`)
        limit = None
        if confidences is not None and params.confidence_threshold is not None:
            limit = dspark.proposal_limit(confidences, params.confidence_threshold)
        return Proposal(drafts, probs, first, limit)

    def accepts_confidence_threshold(self, config):
        return config.dspark.enable_confidence_head

    def timed_pieces(self, drafter, slots):
        dc = drafter.config
        return {f"DSpark head {slots}": lambda q, h, z, a: dspark.base_logits(drafter.module_params(q), h),
                f"Markov chain {slots}": lambda q, h, z, a: dspark.draft(dc.dspark, drafter.module_params(q), h, z,
                                                                        a)[::3]}  # drafts and confidences

    def name_rules(self, config):
        rules = super().name_rules(config) + [Rule("embed_tokens.weight", ("embed_tokens", "embedding")),
                                              Rule("lm_head.weight", ("lm_head", "kernel"), transpose=True)]
        if config.dspark.markov_rank:
            rules += [Rule("markov_head.markov_w1.weight", ("markov_head", "markov_w1", "embedding")),
                      Rule("markov_head.markov_w2.weight", ("markov_head", "markov_w2", "kernel"), transpose=True)]
        if config.dspark.enable_confidence_head:
            rules += linear_rules("confidence_head.proj", ("confidence_head", "proj"), True)
        return rules

    def own_draft_vocab_size(self, config):
        return config.dspark.draft_vocab_size

    def shared_tables(self, config):
        return config.dspark.shared_tables

    published_verify_block = 8  # deepseek-ai/dspark_*_block7: blocks of 7 slots, all proposing
    markov_rank = 256  # their Markov head's rank
    train_defaults = {"markov_rank": markov_rank, "confidence_head": True, "confidence_head_with_markov": True,
                      "sample_from_anchor": True}
    loss_weight_defaults = {"ce_loss_alpha": 0.1, "l1_loss_alpha": 0.9, "confidence_loss_alpha": 1.0}
    draft_vocab_allowed = False  # its own reduced vocabulary is the speculators layout's d2t

    min_verify_block = 3  # its block of G-1 >= 2 slots

    def published(self, base):
        if base.block_size < self.min_verify_block:
            raise ValueError(f"a DSpark drafter verifies blocks of at least {self.min_verify_block} tokens, got "
                             f"{base.block_size}")
        return dataclasses.replace(base, block_size=base.block_size - 1, dspark=DSparkConfig(
            markov_rank=self.markov_rank, enable_confidence_head=True, confidence_head_with_markov=True))

    def check_train_fields(self, field):
        if field("confidence_head") and field("confidence_head_with_markov") and field("markov_rank") == 0:
            return ("model.confidence_head_with_markov needs a Markov head (model.markov_rank > 0), or set it to "
                    "false")
        return None

    def train_fields(self, field):
        return {"dspark": DSparkConfig(field("markov_rank"), field("confidence_head"),
                                       field("confidence_head") and field("confidence_head_with_markov"),
                                       sample_from_anchor=field("sample_from_anchor"))}

    def loss_weights(self, weight):
        return {"ce_alpha": weight("ce_loss_alpha"), "l1_alpha": weight("l1_loss_alpha"),
                "confidence_alpha": weight("confidence_loss_alpha")}

    def default_decay(self, config):
        return 4.0  # DeepSpec's loss_decay_gamma (config/dspark/dspark_qwen3_4b_online.py)

    def batch_loss(self, target, drafter, spec, params, frozen, batch):
        """DeepSpec's loss (0.1 CE + 0.9 L1 + the confidence BCE, docs/training.md), per-proposal
        accuracy [P] (teacher-forced argmax of the biased logits) and the loss's terms of one
        (micro-)batch with its anchors; online features only: the loss reads the target's whole
        distribution at every proposal."""
        if "features" in batch:
            raise ValueError("training a DSpark drafter needs the target's whole distribution at every proposal "
                             "(its L1 and confidence terms): run online (data.path of text or token records, not a "
                             "feature cache)")
        if spec.target_labels:
            raise ValueError("a DSpark drafter learns the text's next tokens (DeepSpec's loss): run.labels must be "
                             "'tokens'")
        config, dtype = drafter.config, drafter.dtype
        target_params = jax.lax.stop_gradient(frozen["target"])
        tokens, loss_mask, anchors, valid = batch["tokens"], batch["loss_mask"], batch["anchors"], batch["valid"]
        target_hidden, features, _ = target.forward(target_params, tokens, capture=config.target_layer_ids)
        target_hidden, features = jax.lax.stop_gradient(target_hidden), jax.lax.stop_gradient(features)
        drafter_params = jax.tree.map(lambda p: p.astype(dtype), params["drafter"])
        for name in self.own_tables:  # frozen copies of the target's tables
            drafter_params[name] = jax.lax.stop_gradient(drafter_params[name])
        hidden = objective.drafter_block_hidden(drafter, target, drafter_params, target_params,
                                                features.astype(dtype), tokens, anchors, valid, spec.anchor_chunk,
                                                embed=lambda block: dspark.block_embeddings(drafter_params, block))
        b, n = anchors.shape
        g, p = config.block_size, config.proposals
        hidden = hidden.reshape(b, n, g, -1)[:, :, g - p:].reshape(b, n * p, -1)  # the proposing slots
        labels, previous, positions, weights = objective.proposal_targets(tokens, loss_mask, anchors, valid, p,
                                                                          spec.decay)
        flat = lambda x: x.reshape(b, n * p, *x.shape[3:])  # noqa: E731
        aligned = jnp.take_along_axis(target_hidden, flat(positions)[..., None], axis=1)  # [B, N*P, D]
        dc = config.dspark

        def one(h, h_target, prev, y):
            logits = config.draft_logits(dspark.base_logits(drafter_params, h))
            logits, confidence = dspark.teacher_forced(dc, drafter_params, h, logits, prev)
            ce, l1, bce, correct = dspark.loss_terms(logits, target.logits(target_params, h_target), y, confidence)
            return ce, l1, jnp.zeros_like(ce) if bce is None else bce, correct

        ce, l1, bce, correct = objective.map_position_chunks(one, (hidden, aligned, flat(previous), flat(labels)),
                                                             spec.logits_chunk)
        w = flat(weights)
        mean = lambda x: jnp.sum(w * x) / jnp.maximum(jnp.sum(w), 1e-9)  # noqa: E731
        terms = {"ce_loss": mean(ce), "l1_loss": mean(l1)}
        loss = spec.ce_alpha * terms["ce_loss"] + spec.l1_alpha * terms["l1_loss"]
        if dc.enable_confidence_head:
            terms["confidence_loss"] = mean(bce)
            loss = loss + spec.confidence_alpha * terms["confidence_loss"]
        counted = weights > 0
        return loss, objective.slot_accuracy(correct.reshape(b, n, p) & counted, counted), terms


DFLASH, DFLASH2, DSPARK = Generation(), DFlash2(), DSpark()
GENERATIONS = {g.name: g for g in (DFLASH, DFLASH2, DSPARK)}


def names() -> tuple[str, ...]:
    """The generation names, in the order they came (`model.generation` of a training config)."""
    return tuple(GENERATIONS)


def get(name: str) -> Generation:
    """The generation called `name`; ValueError naming the known ones."""
    try:
        return GENERATIONS[name]
    except KeyError:
        raise ValueError(f"unknown drafter generation {name!r} (known: {', '.join(GENERATIONS)})") from None


def of(config) -> Generation:
    """The generation of a `DrafterConfig` (`DrafterConfig.generation`)."""
    return GENERATIONS[config.generation]
