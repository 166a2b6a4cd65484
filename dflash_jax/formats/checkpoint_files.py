"""The tensors of a Hugging Face model directory, whichever way it was saved:

  model.safetensors.index.json + shards   |  model.safetensors
  pytorch_model.bin.index.json + shards   |  pytorch_model.bin     (these two need torch)

`open_checkpoint(directory)` returns a read-only mapping HF name -> numpy array that reads lazily
(safetensors are memory-mapped; .bin shards are loaded with torch's mmap on first use).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Mapping

import ml_dtypes
import numpy as np

from dflash_jax._errors import CheckpointError, ConfigError, TorchRequiredError
from dflash_jax.formats.safetensors_io import SafetensorsFile
from dflash_jax.models.config import read_json

SAFETENSORS_INDEX, SAFETENSORS = "model.safetensors.index.json", "model.safetensors"
TORCH_INDEX, TORCH_BIN = "pytorch_model.bin.index.json", "pytorch_model.bin"
CHECKPOINT_FILES = (SAFETENSORS_INDEX, SAFETENSORS, TORCH_INDEX, TORCH_BIN)  # in order of preference


def _import_torch(path: Path):
    try:
        import torch
    except ImportError as e:
        raise TorchRequiredError(
            f"{path} is a PyTorch checkpoint and torch is not installed: `pip install torch` (the CPU "
            "build is enough), or convert it once where torch is installed (a drafter: `python -m "
            "dflash_jax.convert to-hf SRC DST`; a model: transformers' save_pretrained(..., "
            "safe_serialization=True))") from e
    return torch


class TorchBinFile(Mapping):
    """name -> numpy array of one pytorch_model*.bin (a state dict), loaded on first access."""

    def __init__(self, path: Path):
        self.path = path
        if not path.is_file():
            raise FileNotFoundError(f"no PyTorch checkpoint file at {path}")
        self._torch = _import_torch(path)
        self._state = None

    def _tensors(self) -> dict:
        if self._state is None:
            torch = self._torch
            try:
                state = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # torch raises RuntimeError, pickle errors, EOFError ... on bad files
                raise CheckpointError(f"damaged PyTorch checkpoint {self.path}: {e}") from e
            if not (isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values())):
                raise CheckpointError(f"{self.path} is not a state dict of tensors")
            self._state = state
        return self._state

    def __getitem__(self, name: str) -> np.ndarray:
        tensor = self._tensors()[name].detach().contiguous()
        if tensor.dtype == self._torch.bfloat16:  # numpy has no bf16: reinterpret the bits
            return tensor.view(self._torch.int16).numpy().view(ml_dtypes.bfloat16)
        return tensor.numpy()

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors())

    def __len__(self) -> int:
        return len(self._tensors())


class IndexedCheckpoint(Mapping):
    """The shards listed by an index file ({"weight_map": {name: shard file}}) as one mapping."""

    def __init__(self, index: Path, open_file: Callable[[Path], Mapping]):
        weight_map = read_json(index).get("weight_map") if index.is_file() else None
        if not (isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values())):
            raise ConfigError(f"{index}: expected {{\"weight_map\": {{tensor name: shard file}}}}")
        self.index = index
        files = {f: open_file(index.parent / f) for f in sorted(set(weight_map.values()))}
        self._where = {name: files[f] for name, f in weight_map.items()}

    def __getitem__(self, name: str) -> np.ndarray:
        shard = self._where[name]
        try:
            return shard[name]
        except KeyError:
            raise CheckpointError(f"{self.index} maps tensor {name!r} to {shard.path}, which does not "
                                  "hold it") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def checkpoint_file(directory: Path) -> Path | None:
    """The file that describes the weights of `directory` (see CHECKPOINT_FILES), if any."""
    return next((directory / f for f in CHECKPOINT_FILES if (directory / f).is_file()), None)


def open_checkpoint(directory: str | Path) -> Mapping[str, np.ndarray]:
    """All tensors of a Hugging Face model directory. FileNotFoundError when it holds none of
    CHECKPOINT_FILES; TorchRequiredError for a .bin checkpoint without torch."""
    directory = Path(directory)
    found = checkpoint_file(directory)
    if found is None:
        raise FileNotFoundError(f"no weights in {directory}: expected one of {', '.join(CHECKPOINT_FILES)}")
    if found.name == SAFETENSORS_INDEX:
        return IndexedCheckpoint(found, SafetensorsFile)
    if found.name == SAFETENSORS:
        return SafetensorsFile(found)
    if found.name == TORCH_INDEX:
        return IndexedCheckpoint(found, TorchBinFile)
    return TorchBinFile(found)
