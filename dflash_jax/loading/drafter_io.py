"""Official DFlash drafter directories (config.json + model.safetensors, or pytorch_model.bin when
torch is installed) <-> `Drafter`."""
from __future__ import annotations

import contextlib
import dataclasses
import shutil
import uuid
from pathlib import Path

import jax
import numpy as np

from dflash_jax import sharding
from dflash_jax._config import read_config_json, write_config_json
from dflash_jax._draft_vocab import DraftVocab
from dflash_jax._drafter import DECODE_WEIGHTS, Drafter, drafter_param_shapes
from dflash_jax._drafter_config import DrafterConfig, resolve_mask_token_id, validate_pair
from dflash_jax._errors import CheckpointError, DrafterMismatchError
from dflash_jax.loading.checkpoint_files import checkpoint_file, open_checkpoint
from dflash_jax.loading.dtypes import dtype_name, resolve_dtype
from dflash_jax.loading.names import drafter_rules, hf_to_params, params_to_hf
from dflash_jax.loading.safetensors_io import save_safetensors

__all__ = ["DrafterMismatchError", "load_drafter", "save_drafter", "validate_pair"]

DRAFT_VOCAB_TENSORS = ("lm_head.weight", "d2t", "t2d")  # read only when config.json has draft_vocab_size


def load_drafter(path: str | Path, target=None, dtype="float32", *, attn_impl: str = "auto",
                 decode_weights: str = "stored", mesh=None) -> Drafter:
    """Read an official DFlash (or DFlash2, or DeepSpec's DSpark) drafter directory; validate it
    against `target` when given (before any tensor is read). decode_weights: what a CPU drafts with,
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
    rules = drafter_rules(config.attention_bias, config.dflash2 is not None, config.dspark)
    params = hf_to_params(rules, tensors, shapes, config.num_layers, dtype,
                          allow_extra=lambda name: reduced and name in DRAFT_VOCAB_TENSORS, source=str(path),
                          place=place)
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


def save_drafter(drafter: Drafter, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Write the official layout: config.json + model.safetensors (the params' dtype), atomically;
    a reduced draft vocabulary adds `draft_vocab_size` to config.json and `lm_head.weight` [Vd, D],
    `d2t` int64 [Vd], `t2d` bool [V] to the weights (EAGLE-3's layout, as vLLM reads it).
    An existing non-empty `out_dir` is refused (FileExistsError) unless overwrite=True."""
    out_dir = Path(out_dir)
    config = drafter.config
    tensors = params_to_hf(drafter_rules(config.attention_bias, config.dflash2 is not None, config.dspark),
                           drafter.params, config.num_layers)
    if drafter.draft_head is not None:
        tensors.update(drafter.draft_vocab.to_eagle3())
        tensors["lm_head.weight"] = np.ascontiguousarray(np.asarray(jax.device_get(drafter.draft_head["kernel"])).T)
    with replace_directory(out_dir, overwrite) as tmp:
        save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        write_config_json(tmp, drafter.config.to_hf_config(drafter.hf_config, dtype_name(drafter.dtype)))
    return out_dir
