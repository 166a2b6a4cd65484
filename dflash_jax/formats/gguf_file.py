"""Parse a llama.cpp GGUF checkpoint: a Hugging Face config plus float32 tensors in HF layout.

GGUF stores a 2-D weight with ``ne = [in, out]``; its numpy view (and what
``gguf.quants.dequantize`` returns) is ``[out, in]``, i.e. already PyTorch's Linear layout.
The one layout change llama.cpp's ``convert_hf_to_gguf.py`` makes for Llama is a row
permutation of q_proj / k_proj (weight and bias) from HF's "rotate_half" RoPE pairing to
GGML's interleaved pairing; ``_unpermute_rope_rows`` inverts it exactly as transformers'
``LlamaTensorProcessor._reverse_permute_weights`` does.

`parse_gguf` reads the file itself (each tensor dequantised when it is accessed);
`dflash_jax.formats.gguf_reader.read_gguf` is the entry point, through the dequantisation cache
(`dflash_jax.formats.gguf_cache`).
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama",)

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




# --------------------------------------------------------------------------------------------
# paths


def existing_gguf(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file not found: {p}")
    return p


def open_reader(path: Path):
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


def scalar_metadata(reader) -> dict[str, Any]:
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
        unknown. the CPU backend's `pack_quantized` lays them out for the CPU rows kernel."""
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


def read_vocabulary(reader) -> Vocabulary:
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


def parse_gguf(path: Path) -> tuple[GGUFCheckpoint, list[str]]:
    """(checkpoint dequantising from the file on access, GGUF tensors with no HF counterpart)."""
    reader = open_reader(path)
    meta = scalar_metadata(reader)
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
                                vocabulary=read_vocabulary(reader))
    return checkpoint, ignored
