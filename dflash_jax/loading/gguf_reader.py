"""Read a llama.cpp GGUF checkpoint as a Hugging Face config plus float32 tensors in HF layout.

    ckpt = read_gguf(path)
    ckpt.hf_config                       # LlamaConfig-style dict (config.json keys)
    ckpt.tensors["model.norm.weight"]    # read-only np.float32 array

GGUF stores a 2-D weight with ``ne = [in, out]``; its numpy view (and what
``gguf.quants.dequantize`` returns) is ``[out, in]``, i.e. already PyTorch's Linear layout.
The one layout change llama.cpp's ``convert_hf_to_gguf.py`` makes for Llama is a row
permutation of q_proj / k_proj (weight and bias) from HF's "rotate_half" RoPE pairing to
GGML's interleaved pairing; ``_unpermute_rope_rows`` inverts it exactly as transformers'
``LlamaTensorProcessor._reverse_permute_weights`` does.

Dequantisation cache: parsing a GGUF (its vocabulary is ~100k small strings) and dequantising it
take seconds, so by default the first `read_gguf` of a file writes everything a load needs (config,
metadata, vocabulary, float32 tensors) into one file under the user cache directory
(``dflash_jax.resources.user_cache_dir("gguf")``), and later reads memory-map it. An entry is keyed
by the GGUF's resolved path; its size and modification time, the cache format and the ``gguf``
package version are checked on every read (a mismatch rebuilds the entry), and so are a CRC32 of the
manifest and the entry's size (a damaged or partial entry is rebuilt with a warning, never used);
each tensor's own CRC32 is checked when it is first read (a damaged one is read from the GGUF
instead, with a warning, and the entry rebuilt on the next read). Entries are written
to a temporary file and renamed into place, so concurrent processes never see half an entry.
``DFLASH_JAX_GGUF_CACHE=0`` or ``read_gguf(path, cache=False)`` turns the cache off.

Nothing here touches the network: the tokenizer is built from the file's own metadata.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import math
import mmap
import os
import re
import shutil
import struct
import tempfile
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from dflash_jax.resources import smollm2_gguf_path, user_cache_dir

__all__ = ["GGUFCheckpoint", "GGUFTensors", "TensorInfo", "Vocabulary", "gguf_tokenizer", "read_gguf",
           "smollm2_gguf_path"]  # smollm2_gguf_path: an alias of dflash_jax.resources.smollm2_gguf_path

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama",)
CACHE_ENV = "DFLASH_JAX_GGUF_CACHE"  # "0" turns the dequantisation cache off

# GGUF tensor name -> HF tensor name for the Llama family.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# Tensors llama.cpp writes that have no Hugging Face counterpart. `rope_freqs.weight` holds
# Llama-3.1-style per-frequency RoPE factors; transformers ignores it as well.
_NO_HF_COUNTERPART = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

# Tokens that close a chat turn, in the order we prefer them as `eos_token`.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


# --------------------------------------------------------------------------------------------
# paths


def _existing_gguf(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file not found: {p}")
    return p


def _open_reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(path, "r")
    except ValueError as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


# --------------------------------------------------------------------------------------------
# metadata


def _clean_float(value: float) -> float:
    """GGUF stores floats as float32; return the shortest decimal that maps to the same float32
    (9.999999747378752e-06 -> 1e-05), which is what the original config.json said."""
    return float(str(np.float32(value)))


def _scalar_metadata(reader) -> dict[str, Any]:
    """All non-array key/value pairs of the file (arrays such as the vocabulary are left out)."""
    from gguf import GGUFValueType

    out: dict[str, Any] = {}
    for key, fld in reader.fields.items():
        if not fld.types or fld.types[0] == GGUFValueType.ARRAY:
            continue
        out[key] = fld.contents()
    return out


def _rope_scaling(meta: Mapping[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind is None and f"{arch}.rope.scale_linear" in meta:  # older llama.cpp key
        kind, factor = "linear", meta[f"{arch}.rope.scale_linear"]
    if kind is None or kind == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    if factor is not None:
        scaling["factor"] = _clean_float(factor)
    if (orig := meta.get(f"{arch}.rope.scaling.original_context_length")) is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    if (attn := meta.get(f"{arch}.rope.scaling.attn_factor")) is not None:
        scaling["attention_factor"] = _clean_float(attn)
    return scaling


def _check_architecture(meta: Mapping[str, Any], path: Path) -> str:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {path}; supported: {list(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


# --------------------------------------------------------------------------------------------
# tensors


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's ``permute(w, n_head, n_head_kv)`` on the rows of q/k weight or bias.

    llama.cpp: ``w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2)``, taking HF's row order
    (head, half, i) to GGML's (head, i, half). Undo: view as (head, i, half), swap back.
    For k, ``n_head`` is the number of KV heads (llama.cpp substitutes it the same way).
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute {rows} rows into {n_head} heads of even size")
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class TensorInfo:
    gguf_name: str  # e.g. "blk.3.ffn_down.weight"
    quant_type: str  # GGML storage type, e.g. "Q4_1", "Q8_0", "F32"
    shape: tuple[int, ...]  # HF layout
    file_offset: int = -1  # where the stored data starts in the GGUF file (bytes; -1: unknown)
    rope_heads: int | None = None  # q/k: the heads whose rows llama.cpp permuted (_unpermute_rope_rows)


# GGML block types whose stored blocks `GGUFTensors.stored_blocks` hands out: 32 weights per block.
STORED_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}


class GGUFTensors(Mapping[str, np.ndarray]):
    """Read-only mapping HF name -> read-only float32 array in HF layout.

    Backed by the dequantisation cache (each array is a view of the memory-mapped entry: nothing
    is copied) or, with the cache off, by the GGUF file (each access dequantises that one tensor).
    Copy an array before changing it.
    """

    def __init__(self, infos: Mapping[str, TensorInfo], read: Callable[[str], np.ndarray], path: Path | None = None):
        self._infos = dict(infos)
        self._read = read  # name -> float32 array; keeps its memory map alive
        self._path = path  # the GGUF file, for stored_blocks

    def __getitem__(self, name: str) -> np.ndarray:
        info = self._infos[name]
        arr = self._read(name).reshape(info.shape)
        arr.flags.writeable = False
        return arr

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        """GGUF name, storage type and HF-layout shape of ``name``, without reading it."""
        return self._infos[name]

    def stored_blocks(self, name: str) -> np.ndarray | None:
        """A 2-D weight [out, in] as the GGUF file stores it: uint8 blocks [out, in / 32, bytes] of
        a type in STORED_BLOCK_BYTES (rows in HF's order: q/k un-permuted like the floats), read from
        the file, not dequantised; None for any other storage type, or where the file offset is
        unknown. `kernels.cpu_matmul.pack_quantized` lays them out for the CPU rows kernel."""
        info = self._infos[name]
        size = STORED_BLOCK_BYTES.get(info.quant_type)
        if size is None or len(info.shape) != 2 or info.shape[1] % 32 or info.file_offset < 0 or self._path is None:
            return None
        rows, blocks = info.shape[0], info.shape[1] // 32
        stored = np.memmap(self._path, np.uint8, mode="r", offset=info.file_offset, shape=(rows, blocks, size))
        return stored if info.rope_heads is None else _unpermute_rope_rows(stored, info.rope_heads)

    def __repr__(self) -> str:
        return f"GGUFTensors({len(self)} tensors)"


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{int(m.group(1))}.{_LAYER_NAMES[m.group(2)]}"
    return None


@dataclass(frozen=True)
class Vocabulary:
    """The tokenizer arrays of a GGUF file (``tokenizer.ggml.*``)."""

    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]


def _vocabulary(reader) -> Vocabulary:
    def array(key: str) -> tuple:
        fld = reader.fields.get(key)
        return () if fld is None else tuple(fld.contents())

    return Vocabulary(array("tokenizer.ggml.tokens"), array("tokenizer.ggml.token_type"),
                      array("tokenizer.ggml.merges"))


@dataclass(frozen=True)
class GGUFCheckpoint:
    path: Path
    architecture: str
    hf_config: dict[str, Any]
    tensors: GGUFTensors
    metadata: Mapping[str, Any] = field(repr=False)  # the file's scalar key/values
    vocabulary: Vocabulary = field(repr=False)


def read_gguf(path: str | Path, *, cache: bool | str | Path = True) -> GGUFCheckpoint:
    """Open a Llama-architecture GGUF file: HF config dict plus float32 HF tensors.

    cache: True (default) uses the dequantisation cache in the user cache directory (see the module
    docstring; ``DFLASH_JAX_GGUF_CACHE=0`` turns it off), a directory puts the cache there, False
    reads the GGUF itself and dequantises each tensor when it is accessed.
    """
    path = _existing_gguf(path)
    if cache is True and os.environ.get(CACHE_ENV) == "0":
        cache = False
    if cache is False:
        checkpoint, ignored = _parse_gguf(path)
    else:
        directory = user_cache_dir("gguf") if cache is True else Path(cache).expanduser()
        checkpoint, ignored = _cached_checkpoint(path, directory)
    if ignored:
        warnings.warn(
            f"{path.name}: ignoring GGUF-only tensors {ignored} (no Hugging Face counterpart; "
            "e.g. Llama-3.1 RoPE frequency factors, which this config does not reproduce)",
            stacklevel=2,
        )
    return checkpoint


def _parse_gguf(path: Path) -> tuple[GGUFCheckpoint, list[str]]:
    """(checkpoint dequantising from the file on access, GGUF tensors with no HF counterpart)."""
    reader = _open_reader(path)
    meta = _scalar_metadata(reader)
    arch = _check_architecture(meta, path)

    def get(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    def need(key: str) -> int:
        value = get(key)
        if value is None:
            raise ValueError(f"{path}: metadata key {arch}.{key} is missing")
        return int(value)

    n_layers = need("block_count")
    n_heads = need("attention.head_count")
    n_kv_heads = int(get("attention.head_count_kv", n_heads))

    infos: dict[str, TensorInfo] = {}
    sources: dict[str, tuple[Any, int | None]] = {}  # HF name -> (gguf.ReaderTensor, RoPE heads)
    ignored: list[str] = []
    unknown: list[str] = []
    for t in reader.tensors:
        hf = _hf_name(t.name)
        if hf is None:
            (ignored if t.name in _NO_HF_COUNTERPART else unknown).append(t.name)
            continue
        if hf in infos:
            raise ValueError(f"{path}: tensor {t.name!r} appears twice")
        heads = n_heads if ".attn_q." in t.name else n_kv_heads if ".attn_k." in t.name else None
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ne order -> numpy order
        infos[hf] = TensorInfo(t.name, t.tensor_type.name, shape, int(t.data_offset), heads)
        sources[hf] = (t, heads)
    if unknown:
        raise ValueError(
            f"{path}: tensors with no Llama mapping (MoE or another variant?): {unknown[:8]}"
            + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        )
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{s}" for i in range(n_layers) for s in (
            "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
            "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
    }
    if missing := sorted(expected - infos.keys()):
        raise ValueError(f"{path}: missing tensors, e.g. {missing[:4]}")
    if extra := [n for n in infos if n.startswith("model.layers.") and int(n.split(".")[2]) >= n_layers]:
        raise ValueError(f"{path}: tensors beyond block_count={n_layers}, e.g. {extra[:4]}")

    # Sizes come from the tensors themselves; the metadata is cross-checked against them.
    vocab_size, hidden = infos["model.embed_tokens.weight"].shape
    intermediate = infos["model.layers.0.mlp.gate_proj.weight"].shape[0]
    head_dim = infos["model.layers.0.self_attn.q_proj.weight"].shape[0] // n_heads
    for key, value in (("embedding_length", hidden), ("feed_forward_length", intermediate)):
        if get(key) is not None and int(get(key)) != value:
            raise ValueError(f"{path}: {arch}.{key}={get(key)} disagrees with the tensors ({value})")
    for key in ("attention.key_length", "rope.dimension_count"):
        if get(key) is not None and int(get(key)) != head_dim:
            warnings.warn(f"{path.name}: {arch}.{key}={get(key)} but q_proj implies head_dim={head_dim}")
    if get("vocab_size") is not None and int(get("vocab_size")) != vocab_size:
        warnings.warn(f"{path.name}: {arch}.vocab_size={get('vocab_size')} but token_embd has {vocab_size} rows")

    def token_id(key: str):
        v = meta.get(f"tokenizer.ggml.{key}")
        return None if v is None else int(v)

    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab_size),
        "hidden_size": int(hidden),
        "intermediate_size": int(intermediate),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "rms_norm_eps": _clean_float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _clean_float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in infos,
        "mlp_bias": "model.layers.0.mlp.gate_proj.bias" in infos,
        "tie_word_embeddings": "lm_head.weight" not in infos,
        "bos_token_id": token_id("bos_token_id"),
        "eos_token_id": token_id("eos_token_id"),
        "pad_token_id": token_id("padding_token_id"),
    }
    if (scaling := _rope_scaling(meta, arch)) is not None:
        config["rope_scaling"] = scaling

    def dequantize(name: str) -> np.ndarray:  # `reader` stays alive with this closure
        from gguf.quants import dequantize as ggml_dequantize

        tensor, heads = sources[name]
        arr = np.asarray(ggml_dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        arr = arr.reshape(infos[name].shape)
        return arr if heads is None else _unpermute_rope_rows(arr, heads)

    checkpoint = GGUFCheckpoint(path=path, architecture=arch, hf_config=config,
                                tensors=GGUFTensors(infos, dequantize, path), metadata=meta,
                                vocabulary=_vocabulary(reader))
    return checkpoint, ignored


# --------------------------------------------------------------------------------------------
# dequantisation cache
#
# One file per GGUF: header (magic, manifest length, CRC32 of the manifest), the JSON manifest,
# zero padding to _ALIGN, the float32 tensors, each starting at a multiple of _ALIGN from the data
# start, then the CRC32 of each tensor's bytes (uint32, in the manifest's order). A tensor's
# checksum is verified when it is first read: a CPU decode of a GGUF reads only a few of them as
# floats (the rest from the file's own blocks), and checking the whole entry on every load read
# 544 MB for SmolLM2 (0.2-0.3 s, and every page of it counted in the process's memory).

_CACHE_FORMAT = 3  # bump when what the cache stores or how the reader dequantises changes
_MAGIC = b"DFJ-GGUF"
_HEADER = struct.Struct("<8sQI")  # magic, manifest bytes, crc32 of the manifest
_ALIGN = 64


class _DamagedEntry(Exception):
    """The cache entry is unreadable, truncated or fails its checksum."""


class _StaleEntry(Exception):
    """The cache entry was written for another version of the GGUF, cache format or reader."""


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def cache_entry_path(path: str | Path, directory: str | Path | None = None) -> Path:
    """The dequantisation cache file of a GGUF (in `directory`, default the user cache directory)."""
    path = Path(path).expanduser().resolve()
    directory = user_cache_dir("gguf") if directory is None else Path(directory).expanduser()
    return directory / f"{path.stem}-{hashlib.sha256(str(path).encode()).hexdigest()[:16]}.f32cache"


def _source_stamp(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "format": _CACHE_FORMAT, "gguf": importlib.metadata.version("gguf")}


def _cached_checkpoint(path: Path, directory: Path) -> tuple[GGUFCheckpoint, list[str]]:
    entry, source = cache_entry_path(path, directory), _source_stamp(path)
    try:
        return _open_entry(entry, source, path)
    except (OSError, _StaleEntry):  # no entry yet (or no access to it), or one for another source
        pass
    except _DamagedEntry as e:
        warnings.warn(f"GGUF cache entry {entry} is damaged ({e}): rebuilding it from {path.name}",
                      stacklevel=3)
    checkpoint, ignored = _parse_gguf(path)
    try:
        _write_entry(entry, source, checkpoint, ignored)
    except OSError as e:
        warnings.warn(f"cannot write the GGUF cache entry {entry} ({e}): {path.name} is dequantised "
                      "again on every load", stacklevel=3)
        return checkpoint, ignored
    try:
        return _open_entry(entry, source, path)
    except (_StaleEntry, _DamagedEntry):  # the GGUF changed meanwhile, or the disk failed us
        return checkpoint, ignored


def _write_entry(entry: Path, source: dict, checkpoint: GGUFCheckpoint, ignored: list[str]) -> None:
    tensors = checkpoint.tensors
    records, data_bytes = {}, 0
    for name in tensors:
        info = tensors.info(name)
        records[name] = {"gguf_name": info.gguf_name, "quant_type": info.quant_type,
                         "shape": list(info.shape), "offset": data_bytes, "file_offset": info.file_offset,
                         "rope_heads": info.rope_heads}
        data_bytes = _aligned(data_bytes + 4 * math.prod(info.shape))
    vocabulary = checkpoint.vocabulary
    manifest = json.dumps({
        "source": source, "architecture": checkpoint.architecture, "hf_config": checkpoint.hf_config,
        "metadata": dict(checkpoint.metadata), "ignored": ignored, "tensors": records,
        "data_bytes": data_bytes,
        "vocabulary": {"tokens": vocabulary.tokens, "token_types": vocabulary.token_types,
                       "merges": vocabulary.merges},
    }).encode()
    entry.parent.mkdir(parents=True, exist_ok=True)
    total = _aligned(_HEADER.size + len(manifest)) + data_bytes + 4 * len(records)
    free = shutil.disk_usage(entry.parent).free
    if total > free:
        raise OSError(f"it needs {total / 2**30:.2f} GiB, {free / 2**30:.2f} GiB are free")
    fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=f".{entry.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_HEADER.pack(_MAGIC, len(manifest), zlib.crc32(manifest)))
            f.write(manifest)
            f.write(bytes(_aligned(f.tell()) - f.tell()))
            checksums = []
            for name in tensors:
                buffer = np.ascontiguousarray(tensors[name], dtype=np.float32).data.cast("B")
                checksums.append(zlib.crc32(buffer))
                f.write(buffer)
                f.write(bytes(_aligned(buffer.nbytes) - buffer.nbytes))
            f.write(np.asarray(checksums, "<u4").tobytes())
        os.replace(tmp, entry)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _open_entry(entry: Path, source: dict, path: Path) -> tuple[GGUFCheckpoint, list[str]]:
    """The checkpoint a verified cache entry holds, its arrays views of the memory-mapped file.

    Raises FileNotFoundError (no entry), _StaleEntry (written for another source) or _DamagedEntry.
    """
    with open(entry, "rb") as f:
        if os.fstat(f.fileno()).st_size < _HEADER.size:
            raise _DamagedEntry("shorter than its header")
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    magic, manifest_bytes, crc = _HEADER.unpack_from(buffer)
    data_start = _aligned(_HEADER.size + manifest_bytes)
    if magic != _MAGIC:
        raise _DamagedEntry("not a dflash_jax GGUF cache file")
    if data_start > len(buffer):
        raise _DamagedEntry("truncated manifest")
    manifest_text = buffer[_HEADER.size:_HEADER.size + manifest_bytes]
    try:
        manifest = json.loads(manifest_text)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise _DamagedEntry(f"unreadable manifest: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("source") != source:
        raise _StaleEntry()
    if zlib.crc32(manifest_text) != crc:
        raise _DamagedEntry("manifest checksum mismatch")
    records = manifest["tensors"]
    size = data_start + manifest["data_bytes"] + 4 * len(records)
    if len(buffer) != size:
        raise _DamagedEntry(f"{len(buffer)} bytes, expected {size}")
    checksums = dict(zip(records, np.frombuffer(buffer, "<u4", len(records), size - 4 * len(records)).tolist()))
    infos = {name: TensorInfo(r["gguf_name"], r["quant_type"], tuple(r["shape"]), r["file_offset"], r["rope_heads"])
             for name, r in records.items()}
    verified: set[str] = set()
    parsed = functools.cache(lambda: _parse_gguf(path)[0].tensors)

    def view(name: str) -> np.ndarray:  # `buffer` stays alive with this closure
        array = np.frombuffer(buffer, np.float32, count=math.prod(infos[name].shape),
                              offset=data_start + records[name]["offset"])
        if name not in verified:
            if zlib.crc32(array) != checksums[name]:
                warnings.warn(f"GGUF cache entry {entry} is damaged ({name} fails its checksum): reading "
                              f"it from {path.name}; the entry is rebuilt on the next load", stacklevel=3)
                entry.unlink(missing_ok=True)
                return np.array(parsed()[name]).reshape(-1)
            verified.add(name)
        return array

    vocabulary = manifest["vocabulary"]
    checkpoint = GGUFCheckpoint(
        path=path, architecture=manifest["architecture"], hf_config=manifest["hf_config"],
        tensors=GGUFTensors(infos, view, path), metadata=manifest["metadata"],
        vocabulary=Vocabulary(tuple(vocabulary["tokens"]), tuple(vocabulary["token_types"]),
                              tuple(vocabulary["merges"])))
    return checkpoint, manifest["ignored"]


# --------------------------------------------------------------------------------------------
# tokenizer


def _template_text(tok) -> str:
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(v) for v in template.values())
    return template or ""


def _encoding_adds(tok, token_id, at_start: bool) -> bool:
    """Whether encoding with special tokens wraps text in `token_id` (at the start or the end)."""
    if token_id is None:
        return False
    with_special = tok("x", add_special_tokens=True)["input_ids"]
    plain = tok("x", add_special_tokens=False)["input_ids"]
    edge = with_special[:1] if at_start else with_special[-1:]
    return with_special != plain and edge == [token_id]


_CONTROL_TOKEN, _USER_DEFINED_TOKEN = 3, 4  # llama.cpp token types


def _tokenizer_from_gguf_only(path: Path, meta: Mapping[str, Any], vocabulary: Vocabulary):
    """A byte-level BPE tokenizer built straight from the GGUF metadata with `tokenizers`.

    transformers' own GGUF tokenizer path imports torch, which must never be needed at run time,
    so the vocabulary, merges, special tokens and chat template are read here. Only the "gpt2"
    (byte-level BPE) tokenizer model is supported; "smollm"/"llama-bpe"-style pre-tokenizers that
    split digits one by one get a Digits pre-tokenizer, as llama.cpp does.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer model {kind!r} is not supported (only byte-level BPE, "
                         "'gpt2'); load the target from a Hugging Face directory with its tokenizer.json")
    tokens, types = vocabulary.tokens, vocabulary.token_types
    merges = [tuple(m.split(" ", 1)) for m in vocabulary.merges]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                   fuse_unk=False, continuing_subword_prefix="", end_of_word_suffix=""))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if meta.get("tokenizer.ggml.pre") in ("smollm", "llama-bpe", "llama3", "qwen2", "deepseek-llm"):
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    special = [t for t, kind in zip(tokens, types) if kind in (_CONTROL_TOKEN, _USER_DEFINED_TOKEN)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

    def token(key: str):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=token("bos_token_id"), eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"), pad_token=token("padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"))
    tok.add_bos_token = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    tok.add_eos_token = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if tok.add_bos_token and tok.bos_token:  # the plain post-processor below never adds it
        from tokenizers import processors

        backend = tok.backend_tokenizer
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tok.bos_token} $A", pair=f"{tok.bos_token} $A $B",
            special_tokens=[(tok.bos_token, tok.bos_token_id)])
    tok.name_or_path = str(path)
    return tok


def gguf_tokenizer(source: "str | Path | GGUFCheckpoint"):
    """A transformers fast tokenizer built from the GGUF's own vocabulary, merges, special tokens
    and chat template (no hub access), made safe for chat use:

    * If the BOS token is written literally by the chat template (ChatML files mark
      ``<|im_start|>`` as BOS), encoding never prepends it, so a templated prompt starts with
      exactly one such token however it is encoded.
    * ``eos_token`` is the token that ends a chat turn (``<|im_end|>`` for ChatML) when the
      template uses one, and no EOS is ever appended to an encoded prompt.
    * ``pad_token`` falls back to ``eos_token`` when the file names none.
    """
    if isinstance(source, GGUFCheckpoint):  # reuse the parsed file instead of reading it again
        path, meta, vocabulary = source.path, source.metadata, source.vocabulary
    else:
        path = _existing_gguf(source)
        reader = _open_reader(path)
        meta, vocabulary = _scalar_metadata(reader), _vocabulary(reader)
    tok = _tokenizer_from_gguf_only(path, meta, vocabulary)
    template = _template_text(tok)
    vocab = tok.get_vocab()

    if template:
        turn_end = next((t for t in _TURN_END_TOKENS if t in template and t in vocab), None)
        if turn_end is not None and tok.eos_token != turn_end:
            tok.eos_token = turn_end
        if tok.bos_token and tok.bos_token in template and getattr(tok, "add_bos_token", False):
            tok.add_bos_token = False
    if getattr(tok, "add_eos_token", False):
        tok.add_eos_token = False
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token

    # Belt and braces across transformers versions: if the post-processor still wraps text in
    # special tokens that the template writes itself (or an EOS), replace it by a plain one.
    bad_bos = bool(template) and bool(tok.bos_token) and tok.bos_token in template and _encoding_adds(tok, tok.bos_token_id, at_start=True)
    if bad_bos or _encoding_adds(tok, tok.eos_token_id, at_start=False):
        from tokenizers import processors

        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="$A:0", pair="$A:0 $B:1", special_tokens=[]
        )
    return tok
