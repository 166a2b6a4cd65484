"""Minimal lazy safetensors reader/writer on numpy + ml_dtypes (bf16 without torch).

Reading memory-maps the file and returns one tensor at a time, so a checkpoint is never held twice.
The header is checked when the file is opened (its length, its JSON, every tensor's dtype, shape and
byte range against the file size): a damaged file raises CheckpointError naming it, never a numpy or
struct error later.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Iterator, Mapping

import ml_dtypes
import numpy as np

from dflash_jax._errors import CheckpointError

# safetensors dtype code -> numpy dtype, and back.
SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
SAFETENSORS_CODES = {np.dtype(v): k for k, v in SAFETENSORS_DTYPES.items()}
HEADER_LENGTH_BYTES = 8


def _is_index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class SafetensorsFile(Mapping):
    """A read-only mapping name -> np.ndarray backed by a memory map of one .safetensors file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no safetensors file at {self.path}")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(HEADER_LENGTH_BYTES)
            if len(head) < HEADER_LENGTH_BYTES:
                raise self._damaged(f"{size} bytes, too short for the {HEADER_LENGTH_BYTES}-byte header length")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - HEADER_LENGTH_BYTES:
                raise self._damaged(f"the header length field says {header_len} bytes but the file has "
                                    f"{size} (truncated, or not a safetensors file)")
            raw_header = f.read(header_len)
        try:
            header = json.loads(raw_header)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._damaged(f"the header is not valid JSON ({e})") from e
        if not isinstance(header, dict):
            raise self._damaged(f"the header is a JSON {type(header).__name__}, not an object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise self._damaged("__metadata__ is not an object")
        self.metadata = metadata
        self._data_start = HEADER_LENGTH_BYTES + header_len
        data_size = size - self._data_start
        for name, entry in header.items():
            self._check_entry(name, entry, data_size)
        self._entries = header
        self._mmap = None

    def _damaged(self, problem: str) -> CheckpointError:
        return CheckpointError(f"damaged safetensors file {self.path}: {problem}")

    def _check_entry(self, name: str, entry, data_size: int) -> None:
        if not isinstance(entry, dict):
            raise self._damaged(f"the header entry of tensor {name!r} is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPES:
            raise self._damaged(f"tensor {name!r} has unknown dtype {dtype!r}; "
                                f"known: {sorted(SAFETENSORS_DTYPES)}")
        if not (isinstance(shape, list) and all(_is_index(d) for d in shape)):
            raise self._damaged(f"tensor {name!r} has an invalid shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_index(o) for o in offsets)
                and offsets[0] <= offsets[1]):
            raise self._damaged(f"tensor {name!r} has invalid data_offsets {offsets!r}")
        begin, end = offsets
        if end > data_size:
            raise self._damaged(f"tensor {name!r} ends at byte {end} of the data but the data holds "
                                f"only {data_size} bytes (truncated file)")
        want = math.prod(shape) * np.dtype(SAFETENSORS_DTYPES[dtype]).itemsize
        if end - begin != want:
            raise self._damaged(f"tensor {name!r} of shape {shape} and dtype {dtype} needs {want} bytes "
                                f"but data_offsets span {end - begin}")

    def _buffer(self):
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mmap

    def __getitem__(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        begin, end = entry["data_offsets"]
        raw = self._buffer()[self._data_start + begin:self._data_start + end]
        return raw.view(SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def save_safetensors(tensors: Mapping[str, np.ndarray], path: str | Path, metadata: dict | None = None):
    """Write tensors (numpy, bf16 via ml_dtypes allowed) in the safetensors format."""
    header, offset, arrays = {}, 0, []
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        if array.dtype not in SAFETENSORS_CODES:
            raise ValueError(f"tensor {name}: dtype {array.dtype} cannot be saved")
        header[name] = {"dtype": SAFETENSORS_CODES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for array in arrays:
            f.write(array.tobytes())
    tmp.replace(path)
