"""Official DFlash drafter directories (config.json + model.safetensors, or pytorch_model.bin when
torch is installed) <-> `Drafter`."""
from __future__ import annotations

import contextlib
import dataclasses
import shutil
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import _host_arrays as host_arrays, backends, sharding
from dflash_jax.drafters import generations
from dflash_jax.drafters.draft_vocab import DraftVocab
from dflash_jax.drafters.drafter import DECODE_WEIGHTS, Drafter, drafter_param_shapes
from dflash_jax.models.config import read_config_json, write_config_json
from dflash_jax.drafters.config import (SHARED_TABLES, DrafterConfig, is_speculators_dspark, resolve_mask_token_id,
                                        validate_pair)
from dflash_jax._errors import CheckpointError, DrafterMismatchError
from dflash_jax.formats.checkpoint_files import checkpoint_file, open_checkpoint
from dflash_jax.formats.dtypes import dtype_name, resolve_dtype
from dflash_jax.formats.names import hf_to_params, params_to_hf
from dflash_jax.formats.safetensors_io import save_safetensors

__all__ = ["DrafterMismatchError", "load_drafter", "save_drafter", "validate_pair"]

LAYOUTS = ("auto", "official", "speculators")  # save_drafter's `layout`

DRAFT_VOCAB_TENSORS = ("lm_head.weight", "d2t", "t2d")  # read only when config.json has draft_vocab_size
# a DSpark drafter's reduced vocabulary (the speculators layout): read apart, then widened to the vocabulary
SPARK_VOCAB_TENSORS = ("lm_head.weight", "markov_head.markov_w2.weight", "d2t", "t2d")
# the param paths of the DSpark weights built at load (from the target, or widened to the vocabulary)
BUILT_PARAMS = {"embed_tokens": ("embed_tokens", "embedding"), "lm_head": ("lm_head", "kernel"),
                "markov_w2": ("markov_head", "markov_w2", "kernel"), "draft_vocab": ("draft_vocab", "bias")}


def load_drafter(path: str | Path, target=None, dtype="float32", *, attn_impl: str = "auto",
                 decode_weights: str = "stored", mesh=None) -> Drafter:
    """Read an official DFlash (or DFlash2, or DSpark: DeepSpec's layout or the speculators one)
    drafter directory; validate it against `target` when given (before any tensor is read). A DSpark
    drafter in the speculators layout whose checkpoint leaves `embed_tokens.weight` / `lm_head.weight`
    out takes them from `target` (required then: a CheckpointError naming the tensors otherwise).
    decode_weights: what a CPU drafts with,
    "stored" (the weights as loaded) or "q8_0" (8-bit blocks, fewer bytes per cycle; `DrafterSpec`).
    Bad input raises one exception naming the file: FileNotFoundError, ConfigError, CheckpointError, TorchRequiredError,
    DrafterMismatchError; a bad decode_weights a ValueError. mesh: a `jax.sharding.Mesh` to place
    the weights on as they are read, by `dflash_jax.sharding`'s rules (`Drafter.mesh` keeps it); a
    split its tensor axis does not divide raises a ValueError naming the weight before any read."""
    if decode_weights not in DECODE_WEIGHTS:
        raise ValueError(f"decode_weights must be one of {DECODE_WEIGHTS}, got {decode_weights!r}")
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"drafter directory does not exist: {path}")
    dtype = resolve_dtype(dtype)
    hf = read_config_json(path)
    config = DrafterConfig.from_hf_config(hf, source=str(path / "config.json"))
    if config.mask_token_id is None:
        tokenizer = getattr(target, "tokenizer", None)
        mask = resolve_mask_token_id(None, tokenizer, target.config.vocab_size if target else None)
        config = dataclasses.replace(config, mask_token_id=mask)
    if target is not None:
        if config.num_target_layers is None:
            config = dataclasses.replace(config, num_target_layers=target.config.num_layers)
        validate_pair(config, target)
    shapes = drafter_param_shapes(config, dtype)
    tensors = open_checkpoint(path)
    reduced = config.draft_vocab_size is not None
    place = None if mesh is None else sharding.placer(mesh, shapes, config)
    generation = generations.of(config)
    rules = generation.name_rules(config)
    shared = ()
    if is_speculators_dspark(hf):  # the tables it leaves out are the target's
        shared = tuple(t for t in SHARED_TABLES if f"{t}.weight" not in tensors)
        config = config.with_shared_tables(shared)
        rules = [rule for rule in rules if rule.path[0] not in shared]
        if shared and target is None:
            raise CheckpointError(f"{checkpoint_file(path)}: a DSpark drafter in the speculators layout without "
                                  f"{[f'{t}.weight' for t in shared]} takes them from the target: pass target= "
                                  "to load_drafter")
    spark_vocab = generation.own_draft_vocab_size(config) is not None
    if spark_vocab:  # its head and W2 are read over the reduced vocabulary, then widened
        rules = [rule for rule in rules if rule.path[0] != "lm_head" and rule.path[:2] != ("markov_head", "markov_w2")]
    skipped = set(shared) | ({"lm_head", "markov_head", "draft_vocab"} if spark_vocab else set())
    params = hf_to_params(rules, tensors, _without(shapes, skipped, spark_vocab), config.num_layers, dtype,
                          source=str(path), place=place,
                          allow_extra=lambda name: (reduced and name in DRAFT_VOCAB_TENSORS)
                          or (spark_vocab and name in SPARK_VOCAB_TENSORS))
    tables = _target_tables(target, shared, shapes, dtype)
    if spark_vocab:
        tables.update(_spark_vocab_params(config, tensors, tables.pop("lm_head", None), dtype,
                                          checkpoint_file(path)))
    for name, value in tables.items():
        leaf = BUILT_PARAMS[name]
        node = params
        for key in leaf[:-1]:
            node = node.setdefault(key, {})
        node[leaf[-1]] = host_arrays.adopt(value) if place is None else place(leaf, value)
    drafter = Drafter(dataclasses.replace(config, draft_vocab_size=None), params, hf, dtype, attn_impl,
                      decode_weights=decode_weights, mesh=mesh)
    if reduced:
        kernel, vocab = _read_draft_vocab(tensors, config, checkpoint_file(path))
        drafter = drafter.with_draft_vocab(kernel, vocab)
        if mesh is not None:
            head = drafter.draft_head
            drafter = dataclasses.replace(drafter, draft_head=jax.device_put(
                head, sharding.param_shardings(mesh, {"draft_head": head}, drafter.config)["draft_head"]))
    return drafter


def _without(shapes, names, spark_vocab: bool):
    """The param shapes less the top-level entries `names`, keeping the Markov head's W1 (read by
    its rule) when the head is among them for a reduced vocabulary."""
    out = {k: v for k, v in shapes.items() if k not in names}
    if spark_vocab and "markov_head" in shapes:
        out["markov_head"] = {"markov_w1": shapes["markov_head"]["markov_w1"]}
    return out


def _spark_vocab_params(config: DrafterConfig, tensors, target_head, dtype, source: Path) -> dict:
    """A DSpark drafter's reduced vocabulary (speculators' d2t int [Vd], t2d bool [V], lm_head.weight
    [Vd, D] (or the target's head's columns, `target_head` [D, V]) and markov_w2.weight [Vd, r]) as
    its widened params: lm_head [D, V] and markov_w2 [r, V] zero off the kept ids, the bias [V] 0 at
    them and -inf elsewhere. CheckpointError naming `source` and the tensor when one is missing or
    does not fit."""
    own = generations.of(config).own(config)  # a DSparkConfig
    size, v, d, r = own.draft_vocab_size, config.vocab_size, config.hidden_size, own.markov_rank
    need = {"d2t": ((size,), "integer"), "t2d": ((v,), "bool")}
    if target_head is None:
        need["lm_head.weight"] = ((size, d), "float")
    if r:
        need["markov_head.markov_w2.weight"] = ((size, r), "float")
    missing = [name for name in need if name not in tensors]
    if missing:
        raise CheckpointError(f"{source}: draft_vocab_size={size} (a reduced draft vocabulary) but the tensors "
                              f"{missing} are missing")
    arrays = {name: np.asarray(tensors[name]) for name in need}
    for name, (shape, kind) in need.items():
        value = arrays[name]
        ok = {"integer": value.dtype.kind in "iu", "bool": value.dtype == bool, "float": True}[kind]
        if value.shape != shape or not ok:
            raise CheckpointError(f"{source}: tensor {name} is {value.dtype} {list(value.shape)}, expected {kind} "
                                  f"{list(shape)} (draft_vocab_size {size}, vocab_size {v})")
    try:
        ids = DraftVocab.from_eagle3(arrays["d2t"], arrays["t2d"]).draft_to_target
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None
    np_dtype = np.dtype(dtype)
    head = np.zeros((d, v), np_dtype)
    head[:, ids] = (target_head[:, ids] if target_head is not None else arrays["lm_head.weight"].T).astype(np_dtype)
    bias = np.full((v,), -np.inf, np_dtype)
    bias[ids] = 0
    out = {"lm_head": head, "draft_vocab": bias}
    if r:
        w2 = np.zeros((r, v), np_dtype)
        w2[:, ids] = arrays["markov_head.markov_w2.weight"].T.astype(np_dtype)
        out["markov_w2"] = w2
    return out


def _spark_vocab_tensors(drafter: Drafter, tensors: dict) -> None:
    """The inverse of `_spark_vocab_params` on exported tensors: lm_head.weight [Vd, D] and
    markov_w2.weight [Vd, r] at the kept ids, d2t and t2d."""
    params = drafter.params
    bias = np.asarray(jax.device_get(params["draft_vocab"]["bias"]))
    ids = np.flatnonzero(bias == 0)
    tensors["lm_head.weight"] = np.ascontiguousarray(tensors["lm_head.weight"][ids])
    if "markov_head.markov_w2.weight" in tensors:
        tensors["markov_head.markov_w2.weight"] = np.ascontiguousarray(tensors["markov_head.markov_w2.weight"][ids])
    tensors.update(DraftVocab(ids, drafter.config.vocab_size).to_eagle3())


def _target_tables(target, names, shapes, dtype) -> dict[str, np.ndarray]:
    """The target's embedding table [V, D] and LM head kernel [D, V] (the embedding transposed when
    tied) for the DSpark tables `names` a checkpoint leaves out, in `dtype`: the same values, as
    the speculators layout means. A packed (CPU decode) target gives its head as its decode reads it
    (one-hot rows through the head); a family that scales its embeddings or softcaps its logits there
    is refused (the raw tables are not recoverable)."""
    out = {}
    if not names:
        return out
    tp, tc = target.params, target.config
    stacked = backends.of_target_params(tp) == "xla"
    table = tp.get("embed_tokens", {}).get("embedding")
    if "embed_tokens" in names:
        if table is None:
            if tc.family.embedding_scale(tc) is not None:
                raise DrafterMismatchError("the target's raw embedding table is not in its packed params (it scales "
                                           "its embeddings): load the target with layout=\"stacked\"")
            table = target.embed(tp, jnp.arange(tc.vocab_size, dtype=jnp.int32))
        out["embed_tokens"] = table
    if "lm_head" in names:
        if stacked:
            head = tp["embed_tokens"]["embedding"].T if tc.tie_word_embeddings else tp["lm_head"]["kernel"]
        elif tc.final_logit_softcapping:
            raise DrafterMismatchError("the target's LM head is not recoverable from its packed params (it softcaps "
                                       "its logits): load the target with layout=\"stacked\"")
        else:
            head = target.logits(tp, jnp.eye(tc.hidden_size, dtype=target.dtype))
        out["lm_head"] = head
    for name, value in out.items():
        want = shapes[name]["embedding" if name == "embed_tokens" else "kernel"].shape
        if tuple(np.shape(value)) != tuple(want):
            raise DrafterMismatchError(f"the target's {name} table {tuple(np.shape(value))} does not fit the "
                                       f"drafter's {tuple(want)}")
        out[name] = np.asarray(jax.device_get(value)).astype(np.dtype(dtype))
    return out


def _read_draft_vocab(tensors, config: DrafterConfig, source: Path) -> tuple[np.ndarray, DraftVocab]:
    """The reduced vocabulary's head kernel [D, Vd] and map from lm_head.weight [Vd, D], d2t int [Vd]
    and t2d bool [V] (EAGLE-3's layout); CheckpointError naming `source` when they are missing or
    do not fit."""
    missing = [name for name in DRAFT_VOCAB_TENSORS if name not in tensors]
    if missing:
        raise CheckpointError(f"{source}: config.json sets draft_vocab_size={config.draft_vocab_size} but "
                              f"the tensors {missing} are missing")
    head, d2t, t2d = (np.asarray(tensors[name]) for name in DRAFT_VOCAB_TENSORS)
    size, d = config.draft_vocab_size, config.hidden_size
    for name, value, shape, ok, kind in (("lm_head.weight", head, (size, d), True, ""),
                                         ("d2t", d2t, (size,), d2t.dtype.kind in "iu", "integer "),
                                         ("t2d", t2d, (config.vocab_size,), t2d.dtype == bool, "bool ")):
        if value.shape != shape or not ok:
            raise CheckpointError(f"{source}: tensor {name} is {value.dtype} {list(value.shape)}, expected "
                                  f"{kind}{list(shape)} (draft_vocab_size {size}, vocab_size {config.vocab_size})")
    try:
        vocab = DraftVocab.from_eagle3(d2t, t2d)
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None
    return head.T, vocab


def _sibling(path: Path, tag: str) -> Path:
    """A new, hidden directory beside `path` (created with the usual permissions)."""
    sibling = path.parent / f".{path.name}.{tag}-{uuid.uuid4().hex[:8]}"
    sibling.mkdir()
    return sibling


@contextlib.contextmanager
def replace_directory(out_dir: Path, overwrite: bool):
    """Yield a temporary directory beside `out_dir`; when the block succeeds it is renamed to `out_dir`
    (an existing `out_dir` is first moved aside, then deleted: replaced only with overwrite=True, or
    when empty). On failure the temporary directory is removed and `out_dir` is left as it was."""
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; choose a new directory or replace it "
                              "explicitly (overwrite=True; --force on the command line)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(out_dir, "tmp")
    try:
        yield tmp
        if out_dir.exists():
            old = _sibling(out_dir, "old")
            out_dir.rename(old / out_dir.name)
            tmp.rename(out_dir)
            shutil.rmtree(old)
        else:
            tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_drafter(drafter: Drafter, out_dir: str | Path, *, overwrite: bool = False, layout: str = "auto") -> Path:
    """Write the official layout: config.json + model.safetensors (the params' dtype), atomically;
    a reduced draft vocabulary adds `draft_vocab_size` to config.json and `lm_head.weight` [Vd, D],
    `d2t` int64 [Vd], `t2d` bool [V] to the weights (EAGLE-3's layout, as vLLM reads it).
    layout: "official" (DFlashDraftModel, DFlash2DraftModel, DeepSpec's Qwen3DSparkModel),
    "speculators" (a DSpark drafter as `DSparkSpeculator`: config.json with
    `transformer_layer_config` and `aux_hidden_state_layer_ids`, the tensors under the same names,
    without the tables `DSparkConfig.shared_tables` says are the target's), or "auto" (default: the
    layout the drafter was loaded from, `Drafter.hf_config`). An existing non-empty `out_dir` is
    refused (FileExistsError) unless overwrite=True."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    out_dir = Path(out_dir)
    config = drafter.config
    loaded_speculators = is_speculators_dspark(drafter.hf_config or {})
    speculators = layout == "speculators" or (layout == "auto" and loaded_speculators)
    generation = generations.of(config)
    if speculators and "speculators" not in generation.layouts:
        writers = [g.name for g in generations.GENERATIONS.values() if "speculators" in g.layouts]
        raise ValueError(f"layout='speculators' is written for {', '.join(writers)} drafters only, not "
                         f"{generation.name}")
    tensors = params_to_hf(generation.name_rules(config), drafter.params, config.num_layers)
    if drafter.draft_head is not None:
        tensors.update(drafter.draft_vocab.to_eagle3())
        tensors["lm_head.weight"] = np.ascontiguousarray(np.asarray(jax.device_get(drafter.draft_head["kernel"])).T)
    # a config of the other layout is not a base: its keys would make the file read as that layout
    base = drafter.hf_config if loaded_speculators == speculators else None
    if speculators:
        if generation.own_draft_vocab_size(config) is not None:
            _spark_vocab_tensors(drafter, tensors)
        for name in generation.shared_tables(config):
            tensors.pop(f"{name}.weight")
        hf = config.to_speculators_config(base, dtype_name(drafter.dtype))
    else:
        hf = config.to_hf_config(base, dtype_name(drafter.dtype))
    with replace_directory(out_dir, overwrite) as tmp:
        save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        write_config_json(tmp, hf)
    return out_dir
