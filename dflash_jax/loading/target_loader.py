"""`load_target`: a Hugging Face directory (safetensors, sharded or not; pytorch_model.bin if torch
is installed) or a GGUF file (Llama architecture) -> `Target` with params and tokenizer."""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import jax.numpy as jnp
from tqdm.auto import tqdm

from dflash_jax.config import ModelConfig, read_config_json
from dflash_jax.loading.names import hf_to_params, target_rules
from dflash_jax.loading.safetensors_io import ShardedCheckpoint
from dflash_jax.target import Target, target_param_shapes

log = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "f32": jnp.float32, "bf16": jnp.bfloat16}


def resolve_dtype(dtype):
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
    return dtype


def _torch_bin_tensors(directory: Path):
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"{directory} holds pytorch_model.bin; reading it needs torch "
                          "(pip install torch), or convert it to safetensors") from e
    files = sorted(directory.glob("pytorch_model*.bin"))
    tensors = {}
    for f in files:
        for name, t in torch.load(f, map_location="cpu", weights_only=True).items():
            tensors[name] = t.float().numpy()
    return tensors


def params_from_tensors(config: ModelConfig, tensors, dtype, desc: str):
    shapes = target_param_shapes(config, dtype)
    rules = target_rules(config)
    total = sum(len(r.hf_names(config.num_layers)) for r in rules)
    with tqdm(total=total, desc=desc, unit="tensor", leave=False, disable=None) as bar:
        return hf_to_params(rules, tensors, shapes, config.num_layers, dtype,
                            allow_extra=lambda n: config.tie_word_embeddings and n == "lm_head.weight",
                            progress=lambda _: bar.update())


def with_generation_eos(config: ModelConfig, directory: Path) -> ModelConfig:
    """Add the stop ids of generation_config.json (e.g. Qwen3's <|im_end|> and <|endoftext|>)."""
    file = directory / "generation_config.json"
    if not file.is_file():
        return config
    eos = json.loads(file.read_text()).get("eos_token_id")
    eos = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    merged = tuple(dict.fromkeys([*config.eos_token_ids, *map(int, eos)]))
    return dataclasses.replace(config, eos_token_ids=merged)


def load_target(path: str | Path, dtype="float32", *, tokenizer=True, attn_impl: str = "auto") -> Target:
    """Load a target model for generation or drafter training.

    path: a Hugging Face model directory (config.json + model.safetensors[.index.json]) or a .gguf
    file. dtype: "float32" or "bfloat16" for params and activations (softmax and norms stay f32).
    """
    path = Path(path)
    dtype = resolve_dtype(dtype)
    if not path.exists():
        raise FileNotFoundError(f"target path does not exist: {path}")
    if path.suffix == ".gguf":
        from dflash_jax.loading.gguf_reader import gguf_tokenizer, read_gguf

        checkpoint = read_gguf(path)
        config = ModelConfig.from_hf_config(checkpoint.hf_config)
        params = params_from_tensors(config, checkpoint.tensors, dtype, f"loading {path.name}")
        tok = gguf_tokenizer(checkpoint) if tokenizer else None
        return Target(config, params, tok, dtype, attn_impl)

    config = with_generation_eos(ModelConfig.from_hf_config(read_config_json(path)), path)
    has_safetensors = (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    if has_safetensors:
        tensors = ShardedCheckpoint(path)
    elif list(path.glob("pytorch_model*.bin")):
        tensors = _torch_bin_tensors(path)
    else:
        raise FileNotFoundError(f"no model.safetensors, safetensors index or pytorch_model.bin in {path}")
    params = params_from_tensors(config, tensors, dtype, f"loading {path.name}")
    tok = None
    if tokenizer and any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
    elif tokenizer:
        log.info("no tokenizer files in %s; Target.tokenizer is None", path)
    return Target(config, params, tok, dtype, attn_impl)
