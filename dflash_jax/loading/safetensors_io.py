"""Minimal lazy safetensors reader/writer on numpy + ml_dtypes (bf16 without torch).

Reading memory-maps the file and returns one tensor at a time, so a checkpoint is never held twice.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterator, Mapping

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
DTYPE_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


class SafetensorsFile(Mapping):
    """A read-only mapping name -> np.ndarray backed by a memory map of one .safetensors file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no safetensors file at {self.path}")
        with open(self.path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        self.metadata = header.pop("__metadata__", {}) or {}
        self._entries = header
        self._data_start = 8 + header_len
        self._mmap = None

    def _buffer(self):
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mmap

    def __getitem__(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        raw = self._buffer()[self._data_start + begin:self._data_start + end]
        return raw.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


class ShardedCheckpoint(Mapping):
    """All tensors of a Hugging Face directory: model.safetensors or an index of shards."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        single = directory / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {f: SafetensorsFile(directory / f) for f in sorted(set(weight_map.values()))}
            self._where = {name: files[f] for name, f in weight_map.items()}
        elif single.is_file():
            file = SafetensorsFile(single)
            self._where = {name: file for name in file}
        else:
            raise FileNotFoundError(
                f"no model.safetensors or model.safetensors.index.json in {directory}")

    def __getitem__(self, name: str) -> np.ndarray:
        return self._where[name][name]

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)


def save_safetensors(tensors: Mapping[str, np.ndarray], path: str | Path, metadata: dict | None = None):
    """Write tensors (numpy, bf16 via ml_dtypes allowed) in the safetensors format."""
    header, offset, arrays = {}, 0, []
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        if array.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name}: dtype {array.dtype} cannot be saved")
        header[name] = {"dtype": DTYPE_NAMES[array.dtype], "shape": list(array.shape),
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
