"""The dequantisation cache of GGUF checkpoints.

Parsing a GGUF (its vocabulary is ~100k small strings) and dequantising it take seconds, so by
default the first `read_gguf` of a file writes everything a load needs (config, metadata,
vocabulary, float32 tensors) into one file under the user cache directory
(``dflash_jax._resources.user_cache_dir("gguf")``), and later reads memory-map it. An entry is keyed
by the GGUF's resolved path; its size and modification time, the cache format and the ``gguf``
package version are checked on every read (a mismatch rebuilds the entry), and so are a CRC32 of the
manifest and the entry's size (a damaged or partial entry is rebuilt with a warning, never used);
each tensor's own CRC32 is checked when it is first read (a damaged one is read from the GGUF
instead, with a warning, and the entry rebuilt on the next read). Entries are written
to a temporary file and renamed into place, so concurrent processes never see half an entry.
``DFLASH_JAX_GGUF_CACHE=0`` or ``read_gguf(path, cache=False)`` turns the cache off.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import math
import mmap
import os
import shutil
import struct
import tempfile
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from dflash_jax._resources import user_cache_dir
from dflash_jax.formats.gguf_file import GGUFCheckpoint, GGUFTensors, parse_gguf, TensorInfo, Vocabulary

CACHE_ENV = "DFLASH_JAX_GGUF_CACHE"  # "0" turns the dequantisation cache off

# One file per GGUF: header (magic, manifest length, CRC32 of the manifest), the JSON manifest,
# zero padding to _ALIGN, the float32 tensors, each starting at a multiple of _ALIGN from the data
# start, then the CRC32 of each tensor's bytes (uint32, in the manifest's order). A tensor's
# checksum is verified when it is first read: a CPU decode of a GGUF reads only a few of them as
# floats (the rest from the file's own blocks), and checking the whole entry on every load would
# read all of it (544 MB for SmolLM2), time spent and every page of it counted in the process's
# memory.

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


def cached_checkpoint(path: Path, directory: Path) -> tuple[GGUFCheckpoint, list[str]]:
    entry, source = cache_entry_path(path, directory), _source_stamp(path)
    try:
        return _open_entry(entry, source, path)
    except (OSError, _StaleEntry):  # no entry yet (or no access to it), or one for another source
        pass
    except _DamagedEntry as e:
        warnings.warn(f"GGUF cache entry {entry} is damaged ({e}): rebuilding it from {path.name}",
                      stacklevel=3)
    checkpoint, ignored = parse_gguf(path)
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
    parsed = functools.cache(lambda: parse_gguf(path)[0].tensors)

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
