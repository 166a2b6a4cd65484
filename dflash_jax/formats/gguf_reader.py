"""Read a llama.cpp GGUF checkpoint as a Hugging Face config plus float32 tensors in HF layout.

    ckpt = read_gguf(path)
    ckpt.hf_config                       # LlamaConfig-style dict (config.json keys)
    ckpt.tensors["model.norm.weight"]    # read-only np.float32 array

The parser and tensor access are `dflash_jax.formats.gguf_file`, the dequantisation cache that
`read_gguf` goes through by default `dflash_jax.formats.gguf_cache`, and the tokenizer built from
the file's own metadata (`gguf_tokenizer`) `dflash_jax.formats.gguf_tokenizer`. Nothing here
touches the network.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

from dflash_jax.formats.gguf_cache import CACHE_ENV, cached_checkpoint
from dflash_jax.formats.gguf_file import existing_gguf, GGUFCheckpoint, parse_gguf
from dflash_jax.formats.gguf_tokenizer import gguf_tokenizer  # noqa: F401  (target_loader imports it from here)
from dflash_jax._resources import smollm2_gguf_path, user_cache_dir

__all__ = ["gguf_tokenizer", "read_gguf",
           "smollm2_gguf_path"]  # smollm2_gguf_path: an alias of dflash_jax._resources.smollm2_gguf_path


def read_gguf(path: str | Path, *, cache: bool | str | Path = True) -> GGUFCheckpoint:
    """Open a Llama-architecture GGUF file: HF config dict plus float32 HF tensors.

    cache: True (default) uses the dequantisation cache in the user cache directory (see
    `dflash_jax.formats.gguf_cache`; ``DFLASH_JAX_GGUF_CACHE=0`` turns it off), a directory puts the cache there, False
    reads the GGUF itself and dequantises each tensor when it is accessed.
    """
    path = existing_gguf(path)
    if cache is True and os.environ.get(CACHE_ENV) == "0":
        cache = False
    if cache is False:
        checkpoint, ignored = parse_gguf(path)
    else:
        directory = user_cache_dir("gguf") if cache is True else Path(cache).expanduser()
        checkpoint, ignored = cached_checkpoint(path, directory)
    if ignored:
        warnings.warn(
            f"{path.name}: ignoring GGUF-only tensors {ignored} (no Hugging Face counterpart; "
            "e.g. Llama-3.1 RoPE frequency factors, which this config does not reproduce)",
            stacklevel=2,
        )
    return checkpoint
