"""Generation on a device mesh (`dflash_jax.sharding`): greedy speculative output on 8 simulated CPU
devices equals the 1-device output token for token in float32: a tiny Qwen3 target (q/k norms, untied
head) on tensor x data = 2 x 4 (a tiny Llama one, no q/k norms, tied embeddings, runs on 4 x 2 with one
kv head by default, below; both on all of 2 x 4, 4 x 2 and 8 x 1 with their kv heads under `make
test-all`), a Qwen3.5-MoE hybrid (Gated DeltaNet layers, routed experts over an `expert` axis, shared
ones) on expert x tensor x data = 2 x 2 x 2 (and under `make test-all` a Qwen3-MoE target on expert x
tensor = 4 x 2 and on all 8 devices of `expert`), with ragged prompts. The compiled programs' parameter
shardings are the rules' and no weight the rules split is replicated (the decode state's, the state
rules'); the sharded decode loop copies no cache (`make test-all`); models loaded with a mesh are placed
by the rules as they are read, shard by shard (a Qwen3-MoE's experts under `make test-all`); kv heads
fewer than the tensor axis are replicated over the shards that need them, the KV caches too (a 2-kv-head
Qwen3 on tensor x data = 4 x 2, a 1-kv-head Llama on 4 x 2 (and 2 x 4 under `make test-all`),
speculative (plain under `make test-all`), a 1-kv-head Qwen3.5 hybrid on 2 x 4 whose Gated DeltaNet
weights, conv tails and states the compiled programs split over `tensor`: speculative and plain, one
device's tokens); a kv-head count the tensor axis neither divides nor is a multiple of is refused with
an error naming the weight; speculative sampling on a mesh keeps the target's exact distribution
(tests/decode/test_sampling.py's chi-square); and two processes joined by jax.distributed, the prompts given to
one, generate as one device does.

The multi-device checks run in a subprocess (`sharded_run`; `extra_run` for the slow ones; 8
devices: conftest pins this process to 1), which writes its findings as JSON for the tests below.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.devices import run_8_devices, xla_flags

ROOT = Path(__file__).resolve().parents[2]
MESHES = {"tensor2_data4": dict(tensor=2, data=4), "tensor4_data2": dict(tensor=4, data=2),
          "tensor8_data1": dict(tensor=8, data=1),
          # a mixture-of-experts target's experts over `expert`
          "expert4_tensor2": dict(expert=4, tensor=2, data=1), "expert8": dict(expert=8, data=1),
          "expert2_tensor2_data2": dict(expert=2, tensor=2, data=2)}
PROMPTS = [[3, 9, 4], [7, 1, 2, 5, 8, 6, 11], [12], [5, 5, 20, 31, 2]]  # ragged, B=4
ODD_PROMPTS = PROMPTS[:3]  # B=3: data does not divide it, so the batch is replicated
MAX_NEW = 12


def _configs():
    from dflash_jax.drafters.config import DrafterConfig
    from dflash_jax.models.config import LinearAttentionConfig, ModelConfig, MoEConfig

    vocab = 64
    qwen3 = ModelConfig(arch="qwen3", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=8, num_kv_heads=8, head_dim=8, qk_norm=True,
                        max_position_embeddings=2048)  # room for test_sharded_decode_loop_copies_no_cache
    llama = ModelConfig(arch="llama", vocab_size=vocab, hidden_size=64, intermediate_size=96, num_layers=2,
                        num_heads=16, num_kv_heads=8, head_dim=4, qk_norm=False, tie_word_embeddings=True,
                        max_position_embeddings=256)
    # a Qwen3.5 hybrid: a Gated DeltaNet layer (2 key heads, 4 value heads: on tensor=2 its weights and
    # its conv tail and state split over `tensor`, each device its own heads) and a gated attention
    # layer (heads split over tensor)
    qwen3_5 = ModelConfig(arch="qwen3_5", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=2,
                          num_heads=8, num_kv_heads=8, head_dim=8, qk_norm=True, partial_rotary_factor=0.25,
                          layer_types=("linear_attention", "full_attention"),
                          linear=LinearAttentionConfig(conv_kernel_dim=4, num_key_heads=2, num_value_heads=4,
                                                       key_head_dim=8, value_head_dim=8), max_position_embeddings=256)
    # a Qwen3.5-MoE hybrid: the same layers, every MLP 4 routed experts (over `expert`) and a
    # shared one (over `tensor`)
    qwen3_5_moe = dataclasses.replace(qwen3_5, arch="qwen3_5_moe",
                                      moe=MoEConfig(num_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                                    shared_expert_intermediate_size=32, norm_topk_prob=True))
    # a Qwen3-MoE target: 8 experts, 2 per token, split over `expert` (and `tensor` within each)
    qwen3_moe = dataclasses.replace(qwen3, arch="qwen3_moe", moe=MoEConfig(num_experts=8, num_experts_per_tok=2,
                                                                           intermediate_size=32, norm_topk_prob=True))
    drafter = DrafterConfig(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=8, num_kv_heads=8,
                            head_dim=8, vocab_size=vocab, num_target_layers=2, target_layer_ids=(0, 1),
                            block_size=4, mask_token_id=vocab - 1, max_position_embeddings=256)
    return {"qwen3": qwen3, "llama": llama, "qwen3_5_moe": qwen3_5_moe, "qwen3_moe": qwen3_moe,
            # fewer kv heads than the tensor axis: each kv head replicated over the shards that need it
            "qwen3_kv2": dataclasses.replace(qwen3, num_kv_heads=2),
            "llama_kv1": dataclasses.replace(llama, num_kv_heads=1),
            # the hybrid with one kv head: Gated DeltaNet split and gated attention's kv head replicated
            "qwen3_5_kv1": dataclasses.replace(qwen3_5, num_kv_heads=1)}, drafter


def _models(name: str):
    from dflash_jax.drafters.drafter import Drafter, drafter_param_shapes
    from dflash_jax.models.target import Target, target_param_shapes
    from support.families import drawn_params

    targets, drafter_config = _configs()
    config = targets[name]
    drafter_config = dataclasses.replace(drafter_config, num_kv_heads=config.num_kv_heads)
    # on the host: placed on each mesh by slicing there, no program compiled per shard
    target = Target(config, drawn_params(target_param_shapes(config), 0, host=True))
    drafter = Drafter(drafter_config, drawn_params(drafter_param_shapes(drafter_config), 1, host=True))
    return target, drafter


def _sharding_problems(generator, expected_of) -> list[str]:
    """Where the compiled prefill's and decode loop's parameter input shardings differ from the
    rules (`expected_of(model) -> shardings`), or a weight the rules split came out replicated.
    An argument a program never reads has no sharding (None): allowed in the prefill only (it
    reads the drafter's context projections, not its block layers)."""
    import jax

    from dflash_jax.decode.loop import state_shardings

    problems = []
    for (kind, _), executable in generator._compiled.items():
        state_rules = jax.tree_util.tree_leaves(state_shardings(generator.mesh, executable.out_info))
        for i, (g, w) in enumerate(zip(jax.tree_util.tree_leaves(executable.output_shardings), state_rules)):
            if not g.is_equivalent_to(w, len(jax.tree_util.tree_leaves(executable.out_info)[i].shape)):
                problems.append(f"{kind} output leaf {i}: compiled {g}, the state rules {w.spec}")
        args = executable.input_shardings[0]
        for model, got_tree in (("target", args[0]), ("drafter", args[1]))[: 1 if generator.drafter is None else 2]:
            got = jax.tree_util.tree_leaves_with_path(got_tree, is_leaf=lambda x: x is None)
            want = jax.tree_util.tree_leaves(expected_of(model))
            params = jax.tree_util.tree_leaves(generator._target_params if model == "target"
                                               else generator._drafter_params)
            if len(got) != len(want):
                problems.append(f"{kind} {model}: {len(got)} param shardings, the rules give {len(want)}")
                continue
            for (path, g), w, p in zip(got, want, params):
                name = f"{kind} {model}{jax.tree_util.keystr(path)}"
                if g is None:
                    if kind != "prefill":
                        problems.append(f"{name}: unused by the {kind} program")
                    continue
                if not g.is_equivalent_to(w, p.ndim):
                    problems.append(f"{name}: compiled {g.spec}, the rules {w.spec}")
                if any(entry is not None for entry in w.spec) and g.is_fully_replicated:
                    problems.append(f"{name}: the rules split it ({w.spec}) but it is replicated")
    return problems


def save_target_dir(target, directory: Path) -> None:
    """An HF directory (config.json + model.safetensors) of a Qwen3, Llama or Qwen3-MoE Target built
    in memory."""
    from dflash_jax.formats.names import params_to_hf, target_rules
    from dflash_jax.formats.safetensors_io import save_safetensors

    c = target.config
    directory.mkdir(parents=True, exist_ok=True)
    architecture = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
    hf = {"architectures": [architecture[c.arch]],
          "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
          "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
          "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
          "max_position_embeddings": c.max_position_embeddings, "rope_theta": c.rope_theta,
          "tie_word_embeddings": c.tie_word_embeddings, "torch_dtype": "float32"}
    if c.num_experts:
        hf.update(num_experts=c.num_experts, num_experts_per_tok=c.moe.num_experts_per_tok,
                  moe_intermediate_size=c.moe.intermediate_size, norm_topk_prob=c.moe.norm_topk_prob)
    (directory / "config.json").write_text(json.dumps(hf))
    save_safetensors(params_to_hf(target_rules(c), target.params, c.num_layers), directory / "model.safetensors")


# The default suite runs these (model, mesh) pairs; `make test-all` adds EXTRA_CASES in a second
# subprocess (`extra_run`): the rest of the tensor x data shapes for Qwen3 and Llama (whose Llama on
# tensor=4 x data=2 the 1-kv-head Llama of LAYOUT_CASES stands for by default: the same mesh and layers,
# its kv heads replicated), the Qwen3-MoE target (experts over `expert` and, within each, `tensor`; the
# MoE hybrid's stand for them by default: routed experts over `expert`, the rest over `tensor`) on
# expert x tensor = 4 x 2 and all 8 devices on `expert`, and the whole-buffer check of the sharded
# decode loops.
DEFAULT_MESHES = {"qwen3": ["tensor2_data4"], "qwen3_5_moe": ["expert2_tensor2_data2"]}
EXTRA_MESHES = {"qwen3": ["tensor4_data2", "tensor8_data1"],
                "llama": ["tensor4_data2", "tensor2_data4", "tensor8_data1"],
                "qwen3_moe": ["expert4_tensor2", "expert8"]}


def _mesh_cases(meshes, mesh_names_of, found, generators):
    """Each model's one-device reference and its output and compiled shardings on each of its meshes
    (and, for Qwen3 on tensor=2 x data=4, the odd batch and the stream), into `found`."""

    from dflash_jax import sharding
    from dflash_jax.engine.generator import Generator

    for name, mesh_names in mesh_names_of.items():
        target, drafter = _models(name)
        reference = Generator(target, drafter, backend="xla")  # one device, the same XLA numerics
        case = {"reference": {}, "meshes": {}, "odd_batch": {}, "problems": {}, "stream": {}}
        result = reference.generate(PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=())
        case["reference"]["even"], case["histogram"] = result.tokens, result.histogram().tolist()
        for mesh_name in mesh_names:
            mesh = meshes[mesh_name]
            generator = generators[name, mesh_name] = Generator(target, drafter, mesh=mesh)
            case["meshes"][mesh_name] = generator.generate(PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=()).tokens
            expected = {"target": sharding.param_shardings(mesh, generator._target_params, target.config),
                        "drafter": sharding.param_shardings(mesh, generator._drafter_params, drafter.config)}
            case["problems"][mesh_name] = _sharding_problems(generator, expected.__getitem__)
        if name == "qwen3" and "tensor2_data4" in mesh_names:  # B=3: replicated batch; and the stream
            generator = generators[name, "tensor2_data4"]
            case["odd_batch"] = generator.generate(ODD_PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=()).tokens
            rows = [[] for _ in PROMPTS]
            for chunk in generator.stream(PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=()):
                rows = [r + c for r, c in zip(rows, chunk)]
            case["stream"] = rows
        found[name] = case


# Fewer kv heads than the tensor axis (each replicated over the shards that need it, the KV caches
# too) and a Qwen3.5 hybrid whose Gated DeltaNet is split over `tensor`: greedy tokens, speculative
# and plain, against one device. The default suite runs LAYOUT_CASES (in `sharded_run`: 2 copies of
# each kv head, Qwen3's two on tensor=4 and the hybrid's one on tensor=2; 4 copies, Llama's one on
# tensor=4), `make test-all` EXTRA_LAYOUT_CASES: 4 copies of each of two kv heads, Llama's one kv head
# in 2 copies (as Qwen3's and the hybrid's), a hybrid whose 2 linear key heads the tensor axis (4)
# does not divide (its linear layers replicated), and the plain (drafterless) runs of Qwen3's and
# Llama's tensor=4 x data=2 cases. Those two stand for each other by default: their speculative runs
# replicate the same target's kv heads (the drafter's too), and the hybrid's plain run on tensor=2 x
# data=4 is the plain decode loop over replicated kv heads and their caches.
LAYOUT_CASES = [("qwen3_kv2", "tensor4_data2", "speculative"), ("llama_kv1", "tensor4_data2", "speculative"),
                ("qwen3_5_kv1", "tensor2_data4", "speculative"), ("qwen3_5_kv1", "tensor2_data4", "plain")]
EXTRA_LAYOUT_CASES = [(model, mesh, kind) for model, mesh in (("qwen3_kv2", "tensor8_data1"),
                                                              ("llama_kv1", "tensor2_data4"),
                                                              ("qwen3_5_kv1", "tensor4_data2"))
                      for kind in ("speculative", "plain")] + [("qwen3_kv2", "tensor4_data2", "plain"),
                                                               ("llama_kv1", "tensor4_data2", "plain")]


def _compiled_layout(generator) -> dict:
    """From the compiled decode loop: each cache array's global shape and its shard's on one device
    (out shardings), each Gated DeltaNet weight's (its parameter input shardings), and under
    "gathers" the result type and op name of each of its float all-gathers and all-to-alls (what
    moving a weight would take)."""
    import re

    import jax

    loop = next(executable for (kind, _), executable in generator._compiled.items() if kind != "prefill")
    shapes = jax.tree_util.tree_leaves_with_path(loop.out_info)
    found = {}
    for (path, info), placed in zip(shapes, jax.tree_util.tree_leaves(loop.output_shardings)):
        name = jax.tree_util.keystr(path)
        if "cache" in name and info.ndim >= 4:
            found[name] = [list(info.shape), list(placed.shard_shape(info.shape))]
    params = jax.tree_util.tree_leaves_with_path(generator._target_params)
    for (path, param), placed in zip(params, jax.tree_util.tree_leaves(loop.input_shardings[0][0])):
        name = jax.tree_util.keystr(path)
        if "linear_attn" in name:
            found[name] = [list(param.shape), list(placed.shard_shape(param.shape))]
    gathers = [(line, re.findall(r"= ((?:f|bf)\d+\[[^\]]*\])\S* (?:all-gather|all-to-all)\(", line))
               for line in loop.as_text().splitlines()]
    found["gathers"] = [[kinds[0], (re.findall(r'op_name="([^"]*)"', line) or [""])[0]]
                        for line, kinds in gathers if kinds]
    return found


def _layout_cases(meshes, cases, found) -> None:
    """`cases` ((model, mesh, kind) of LAYOUT_CASES) into `found`: per model, one device's plain greedy
    tokens (the target's own continuation, which greedy speculative decoding equals), and per mesh and
    kind ("speculative", "plain") the tokens, the compiled shardings' problems and `_compiled_layout`."""
    from dflash_jax import sharding
    from dflash_jax.engine.generator import Generator

    for name in dict.fromkeys(model for model, _, _ in cases):
        target, drafter = _models(name)
        case = found[name] = {"meshes": {}, "problems": {}, "layout": {}}
        case["reference"] = Generator(target, None, backend="xla").generate(
            PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=()).tokens
        for kind, pair_drafter in (("speculative", drafter), ("plain", None)):
            for mesh_name in [mesh for model, mesh, k in cases if (model, k) == (name, kind)]:
                mesh, key = meshes[mesh_name], f"{mesh_name}/{kind}"
                generator = Generator(target, pair_drafter, mesh=mesh)
                case["meshes"][key] = generator.generate(PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=()).tokens
                expected = {"target": sharding.param_shardings(mesh, generator._target_params, target.config)}
                if pair_drafter is not None:
                    expected["drafter"] = sharding.param_shardings(mesh, generator._drafter_params, drafter.config)
                case["problems"][key] = _sharding_problems(generator, expected.__getitem__)
                case["layout"][key] = _compiled_layout(generator)


def _whole_buffer_ops(generator) -> list[str]:
    """test_decode_hlo's check on the partitioned decode loop: every instruction carrying the
    capacity (1024) is an alias or an in-place row update, so no cache is copied."""
    from support.hlo import whole_buffer_ops

    from dflash_jax.engine.generator import prompt_bucket
    from dflash_jax.kernels import KEY_TILE, round_up

    cfg, args, _ = generator._prepare(PROMPTS, max_new_tokens=960, temperature=0.0, top_k=0, top_p=1.0,
                                      stop_token_ids=(), block_size=None, seed=0, acceptance="exact")
    capacity = round_up(prompt_bucket(max(map(len, PROMPTS))) + cfg.max_new_tokens + cfg.block_size, KEY_TILE)
    assert capacity == 1024, capacity
    _, loop, _ = generator._executables(cfg, args, "decode")
    return whole_buffer_ops(loop.as_text(), capacity)


def _moe_loaded(meshes, generators, workdir: str) -> dict:
    """A Qwen3-MoE target loaded onto expert=4 x tensor=2: every weight by the rules, each device's
    block read from only the tensors it overlaps (each expert's tensors read once per tensor shard
    holding a slice of it, not once per device), and generating from it agrees."""
    import jax

    from dflash_jax import sharding
    from dflash_jax.formats import checkpoint_files
    from dflash_jax.loading.target_loader import load_target

    moe_target, moe_drafter = _models("qwen3_moe")
    moe_mesh = meshes["expert4_tensor2"]
    save_target_dir(moe_target, Path(workdir) / "moe")
    reads: dict = {}
    read_tensor = checkpoint_files.SafetensorsFile.__getitem__

    def counted(self, name):
        reads[name] = reads.get(name, 0) + 1
        return read_tensor(self, name)

    checkpoint_files.SafetensorsFile.__getitem__ = counted
    try:
        moe_loaded = load_target(Path(workdir) / "moe", tokenizer=False, mesh=moe_mesh)
    finally:
        checkpoint_files.SafetensorsFile.__getitem__ = read_tensor
    rules = sharding.param_shardings(moe_mesh, moe_loaded.params, moe_loaded.config)
    moe_placement = [jax.tree_util.keystr(path) for (path, x), want in zip(
        jax.tree_util.tree_leaves_with_path(moe_loaded.params), jax.tree_util.tree_leaves(rules))
        if not x.sharding.is_equivalent_to(want, x.ndim)]
    expert_reads = sorted({n for name, n in reads.items() if ".experts." in name})
    tokens = generators["qwen3_moe", "expert4_tensor2"].bind(moe_loaded, moe_drafter).generate(
        PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=()).tokens
    return {"placement": moe_placement, "expert_reads": expert_reads, "tokens": tokens}


def extra_run(out: str, workdir: str) -> None:
    """The slow multi-device checks (EXTRA_MESHES, the Qwen3-MoE target loaded with a mesh, the MoE
    loop's whole-buffer check) -> `out`."""
    import jax

    from dflash_jax import sharding

    assert len(jax.devices()) == 8, jax.devices()
    found: dict = {}
    generators: dict = {}
    meshes = {name: sharding.make_mesh(**sizes) for name, sizes in MESHES.items()}
    _mesh_cases(meshes, EXTRA_MESHES, found, generators)
    _layout_cases(meshes, EXTRA_LAYOUT_CASES, found.setdefault("layouts", {}))
    found["moe_loaded"] = _moe_loaded(meshes, generators, workdir)
    found["whole_buffer_ops"] = {"qwen3": _whole_buffer_ops(generators["qwen3", "tensor4_data2"]),
                                 "qwen3_moe": _whole_buffer_ops(generators["qwen3_moe", "expert8"])}
    Path(out).write_text(json.dumps(found))


def sharded_run(out: str, workdir: str, sampling_params: str | None = None) -> None:
    """The default multi-device checks; findings to `out` (JSON). sampling_params: a pickle of
    `support.sampling.sampling_pair()`'s params (target, drafter), made by the parent process, which
    builds that pair anyway (its initialisers compiled there, not again here); None: built here."""
    import jax

    from dflash_jax import sharding
    from dflash_jax.engine.generator import Generator
    from dflash_jax.loading.drafter_io import load_drafter, save_drafter
    from dflash_jax.loading.target_loader import load_target

    assert len(jax.devices()) == 8, jax.devices()
    found: dict = {}
    meshes = {name: sharding.make_mesh(**sizes) for name, sizes in MESHES.items()}
    generators = {}
    _mesh_cases(meshes, DEFAULT_MESHES, found, generators)
    _layout_cases(meshes, LAYOUT_CASES, found.setdefault("layouts", {}))

    # Loaded with a mesh: every weight on the rules' shards as read; generating from them agrees.
    target, drafter = _models("qwen3")
    mesh = meshes["tensor2_data4"]
    save_target_dir(target, Path(workdir) / "target")
    save_drafter(drafter, Path(workdir) / "drafter")
    loaded = load_target(Path(workdir) / "target", tokenizer=False, mesh=mesh)
    loaded_drafter = load_drafter(Path(workdir) / "drafter", target=loaded, mesh=mesh)
    placement = []
    for model, config in ((loaded, loaded.config), (loaded_drafter, loaded_drafter.config)):
        rules = sharding.param_shardings(mesh, model.params, config)
        for (path, x), want in zip(jax.tree_util.tree_leaves_with_path(model.params), jax.tree_util.tree_leaves(rules)):
            if not x.sharding.is_equivalent_to(want, x.ndim):
                placement.append(f"{type(model).__name__}{jax.tree_util.keystr(path)}: {x.sharding}, rules {want.spec}")
    # the same specs and mesh: the tensor2_data4 programs run the loaded weights (no new compile)
    generator = generators["qwen3", "tensor2_data4"].bind(loaded, loaded_drafter)
    found["loaded"] = {"mesh_kept": loaded.mesh is mesh and loaded_drafter.mesh is mesh, "placement": placement,
                       "tokens": generator.generate(PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=()).tokens}

    # A kv-head count (6) the tensor axis (4) neither divides nor is a multiple of (12 query heads,
    # which it divides): refused, naming the weight. (2 kv heads on 4 are replicated: LAYOUT_CASES.)
    mesh = meshes["tensor4_data2"]
    errors = {}
    narrow = dataclasses.replace(target.config, num_heads=12, num_kv_heads=6)
    import numpy as np

    from dflash_jax.drafters.drafter import Drafter
    from dflash_jax.models.target import Target, target_param_shapes

    # zeros of the right shapes (refused before any is read; no init program to compile)
    narrow_target = Target(narrow, jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype),
                                                          target_param_shapes(narrow)))
    for what, call in (("generator", lambda: Generator(narrow_target, None, mesh=mesh)),
                       ("load_target", lambda: (save_target_dir(narrow_target, Path(workdir) / "narrow"),
                                                load_target(Path(workdir) / "narrow", tokenizer=False, mesh=mesh)))):
        try:
            call()
            errors[what] = None
        except ValueError as e:
            errors[what] = str(e)
    found["errors"] = errors

    # Lossless sampling on a mesh: test_sampling's sharpened pair, tensor=2 x data=4, its samples
    # checked against the exact distribution by the test below.
    from support.sampling import DRAFTER, PROMPT, SAMPLES, TARGET, sampling_pair

    if sampling_params is None:
        pair = sampling_pair()
        target_params, drafter_params = jax.device_get((pair[0].params, pair[1].params))
    else:
        import pickle

        target_params, drafter_params = pickle.loads(Path(sampling_params).read_bytes())
    sampler = Generator(Target(TARGET, target_params), Drafter(DRAFTER, drafter_params),
                        mesh=sharding.make_mesh(tensor=2, data=4))
    result = sampler.generate([PROMPT] * SAMPLES, max_new_tokens=3,
                              stop_token_ids=(), temperature=1.0, seed=11)
    found["sampling"] = {"tokens": result.tokens, "tau": result.tau,
                         "problems": _sharding_problems(sampler, lambda model: sharding.param_shardings(
                             sampler.mesh, sampler._target_params if model == "target" else sampler._drafter_params,
                             (sampler.target if model == "target" else sampler.drafter).config))}
    Path(out).write_text(json.dumps(found))


@pytest.fixture(scope="module")
def findings(tmp_path_factory):
    import pickle

    import jax

    from support.sampling import sampling_pair

    # test_sampling's pair, built here (its initialisers compiled in this process, which
    # test_sampling_on_a_mesh_matches_the_target_distribution needs them in anyway), handed over
    target, drafter = sampling_pair()
    path = tmp_path_factory.mktemp("sharded-generate") / "sampling-params.pkl"
    path.write_bytes(pickle.dumps(jax.device_get((target.params, drafter.params))))
    return run_8_devices(f"sharded_run({{out}}, {{tmp}}, {str(path)!r})", "test_sharded_generate")


@pytest.fixture(scope="module")
def extra_findings():
    return run_8_devices("extra_run({out}, {tmp})", "test_sharded_generate")


CASES = [(model, mesh) for model, meshes in DEFAULT_MESHES.items() for mesh in meshes]
EXTRA_CASES = [(model, mesh) for model, meshes in EXTRA_MESHES.items() for mesh in meshes]


@pytest.mark.slow  # make test-all
@pytest.mark.parametrize("model, mesh", EXTRA_CASES)
def test_more_meshes_equal_one_device(extra_findings, model, mesh):
    """Llama on the rest of the tensor x data shapes, Qwen3-MoE's experts over all 8 devices: the
    one-device tokens, the rules' compiled shardings; the MoE's sharded loop copies no cache."""
    case = extra_findings[model]
    assert case["meshes"][mesh] == case["reference"]["even"]
    assert case["problems"][mesh] == []
    assert extra_findings["whole_buffer_ops"] == {"qwen3": [], "qwen3_moe": []}


@pytest.mark.parametrize("model, mesh", CASES)
def test_sharded_greedy_equals_one_device(findings, model, mesh):
    case = findings[model]
    assert case["meshes"][mesh] == case["reference"]["even"]
    assert all(len(row) == MAX_NEW for row in case["reference"]["even"])


def test_a_batch_data_does_not_divide_is_replicated_and_agrees(findings):
    """Three rows on data=4: each row is one device's (a row's tokens do not depend on the rows beside
    it: ODD_PROMPTS are PROMPTS' first three)."""
    assert findings["qwen3"]["odd_batch"] == findings["qwen3"]["reference"]["even"][:len(ODD_PROMPTS)]


def test_sharded_stream_equals_one_device(findings):
    assert findings["qwen3"]["stream"] == findings["qwen3"]["reference"]["even"]


@pytest.mark.parametrize("model, mesh", CASES)
def test_compiled_param_shardings_are_the_rules(findings, model, mesh):
    assert findings[model]["problems"][mesh] == []


def test_load_with_a_mesh_places_every_weight_by_the_rules(findings):
    loaded = findings["loaded"]
    assert loaded["mesh_kept"]
    assert loaded["placement"] == []
    assert loaded["tokens"] == findings["qwen3"]["reference"]["even"]


@pytest.mark.slow  # make test-all; by default test_load_with_a_mesh_places_every_weight_by_the_rules (Qwen3 read
# shard by shard onto tensor x data) and the MoE hybrid's experts over `expert` (test_sharded_greedy_equals_one_device)
def test_an_moe_target_loads_shard_by_shard(extra_findings):
    """Loaded onto expert=4 x tensor=2: placed by the rules; each expert tensor read twice (once per
    tensor shard of its expert's block), never once per device (8); it generates as one device."""
    loaded = extra_findings["moe_loaded"]
    assert loaded["placement"] == []
    assert loaded["expert_reads"] == [2]
    assert loaded["tokens"] == extra_findings["qwen3_moe"]["reference"]["even"]


@pytest.mark.parametrize("what", ["generator", "load_target"])
def test_kv_heads_the_tensor_axis_does_not_divide_are_refused(findings, what):
    message = findings["errors"][what]
    assert message is not None, f"{what} accepted 6 kv-heads on a tensor axis of 4"
    for word in ("k_proj", "6 kv-heads", "tensor axis of size 4", "[2, 64, 48]"):
        assert word in message, (word, message)





def _check_layout_case(case, model: str, mesh: str, kind: str) -> None:
    """The tokens of one device, the rules' compiled shardings, and KV caches of `tensor` heads (each
    kv head's copies), one per device."""
    key, tensor = f"{mesh}/{kind}", MESHES[mesh]["tensor"]
    assert case["meshes"][key] == case["reference"]
    assert all(len(row) == MAX_NEW for row in case["reference"])
    assert case["problems"][key] == []
    kv = {name: shapes for name, shapes in case["layout"][key].items() if name.endswith((".k", ".v"))}
    assert kv
    assert len(kv) == (4 if kind == "speculative" else 2), kv  # the target's (and the drafter's) k and v
    for name, (shape, shard) in kv.items():
        assert (shape[3], shard[3]) == (tensor, 1), (name, shape, shard)


@pytest.mark.parametrize("model, mesh, kind", LAYOUT_CASES)
def test_kv_heads_fewer_than_the_tensor_axis_are_replicated_and_agree(findings, model, mesh, kind):
    """A 2-kv-head Qwen3 on tensor=4 x data=2, a 1-kv-head Llama on tensor=4 x data=2 (and 2 x 4 under
    `make test-all`), speculative (their plain runs under `make test-all`: LAYOUT_CASES), and a 1-kv-head
    Qwen3.5 hybrid on tensor=2 x data=4, speculative and plain (the drafters' kv heads alike): one device's
    tokens; every KV cache holds `tensor` heads, one per device."""
    _check_layout_case(findings["layouts"][model], model, mesh, kind)


@pytest.mark.slow  # make test-all
@pytest.mark.parametrize("model, mesh, kind", EXTRA_LAYOUT_CASES)
def test_more_kv_replicated_layouts_agree(extra_findings, model, mesh, kind):
    _check_layout_case(extra_findings["layouts"][model], model, mesh, kind)
    if model == "qwen3_5_kv1":  # tensor=4 does not divide the 2 linear key heads: replicated
        layout = extra_findings["layouts"][model]["layout"][f"{mesh}/{kind}"]
        linear = {n: s for n, s in layout.items() if "linear_attn" in n}
        assert len(linear) == 9 and all(shape == shard for shape, shard in linear.values()), linear
        conv = next(s for n, s in layout.items() if n.endswith(".conv"))
        state = next(s for n, s in layout.items() if n.endswith(".state"))
        assert (conv[1][3], state[1][2]) == (conv[0][3], state[0][2]), (conv, state)  # split over data only


@pytest.mark.parametrize("kind", ["speculative", "plain"])
def test_gated_deltanet_is_split_over_tensor_in_the_compiled_programs(findings, kind):
    """The Qwen3.5 hybrid on tensor=2 x data=4: the compiled loop's Gated DeltaNet weights are each
    split in 2 over `tensor` (in_proj_qkv's columns and conv1d's channels grouped per shard, so each
    device holds its own heads), but for the norm's scale (per head dim, replicated); the conv tail
    and the delta-rule state too (each also over `data` on the batch); the loop all-gathers no float
    array (no weight moves); the output is one device's
    (`test_kv_heads_fewer_than_the_tensor_axis_are_replicated_and_agree`)."""
    import math

    layout = findings["layouts"]["qwen3_5_kv1"]["layout"][f"tensor2_data4/{kind}"]
    linear = {n: s for n, s in layout.items() if "linear_attn" in n}
    assert len(linear) == 9, linear  # in_proj_qkv/z/b/a, conv1d, A_log, dt_bias, norm, out_proj
    for name, (shape, shard) in linear.items():
        assert math.prod(shape) // math.prod(shard) == (1 if "'norm'" in name else 2), (name, shape, shard)
    # no weight, conv tail or state moves between devices (in the checkpoint's channel order they
    # would: a tail and a state all-gathered per step). The speculative loop gathers only the [B, T, D]
    # hidden states the drafter's block and the LM head read (from the vocabulary-split embedding).
    gathers = layout["gathers"]
    # (jax 0.12 names some of them after a slice: a hidden state is an array [B, T, D], rank 3; a conv tail is
    # rank 4 and a state rank 5)
    hidden_state = lambda shape: shape.count(",") == 2  # noqa: E731
    assert all("DrafterModel" in name or "logits" in name or hidden_state(shape) for shape, name in gathers) and (
        kind == "speculative" or not gathers), gathers
    conv = next(s for n, s in layout.items() if n.endswith(".conv"))
    state = next(s for n, s in layout.items() if n.endswith(".state"))
    assert conv[1] == [conv[0][0], conv[0][1] // 4, conv[0][2], conv[0][3] // 2], conv
    assert state[1] == [state[0][0], state[0][1] // 4, state[0][2] // 2, *state[0][3:]], state


def test_rules_on_one_device():
    """The rules themselves, in this process: a tensor axis of 1 splits nothing; the spec of each
    kind of weight; vocabulary axes split only where they divide."""
    from dflash_jax import sharding

    targets, _ = _configs()
    qwen3 = targets["qwen3"]
    spec = lambda path, shape, t: tuple(sharding.param_spec(path, shape, qwen3, t))
    assert spec(("layers", "self_attn", "q_proj", "kernel"), (2, 64, 64), 1) == (None, None, None)
    assert spec(("layers", "self_attn", "k_proj", "kernel"), (2, 64, 64), 4) == (None, None, "tensor")
    assert spec(("layers", "self_attn", "k_proj", "bias"), (2, 64), 4) == (None, "tensor")
    assert spec(("layers", "self_attn", "o_proj", "kernel"), (2, 64, 64), 4) == (None, "tensor", None)
    assert spec(("layers", "self_attn", "o_proj", "bias"), (2, 64), 4) == (None, None)
    assert spec(("layers", "mlp", "down_proj", "kernel"), (2, 128, 64), 4) == (None, "tensor", None)
    assert spec(("layers", "mlp", "up_proj", "kernel"), (2, 64, 128), 4) == (None, None, "tensor")
    assert spec(("layers", "self_attn", "q_norm", "scale"), (2, 8), 4) == (None, None)
    assert spec(("embed_tokens", "embedding"), (64, 64), 4) == ("tensor", None)
    assert spec(("embed_tokens", "embedding"), (66, 64), 4) == (None, None)  # 66 % 4: replicated
    assert spec(("lm_head", "kernel"), (64, 66), 4) == (None, None)
    assert spec(("drafter", "fc", "kernel"), (128, 64), 4) == (None, "tensor")
    assert spec(("draft_head", "kernel"), (64, 32), 4) == (None, "tensor")
    with pytest.raises(ValueError, match=r"mlp/up_proj/kernel of shape \[2, 64, 126\].*tensor axis of size 4"):
        sharding.param_spec(("layers", "mlp", "up_proj", "kernel"), (2, 64, 126), qwen3, 4)
    # MoE experts [L, E, ...]: E over `expert`, Megatron within each expert over `tensor`
    espec = lambda path, shape, t, e: tuple(sharding.param_spec(path, shape, qwen3, t, e))
    assert espec(("layers", "mlp", "gate_proj"), (2, 8, 64, 32), 2, 4) == (None, "expert", None, "tensor")
    assert espec(("layers", "mlp", "down_proj"), (2, 8, 32, 64), 2, 4) == (None, "expert", "tensor", None)
    assert espec(("layers", "mlp", "up_bias"), (2, 8, 32), 2, 4) == (None, "expert", "tensor")
    assert espec(("layers", "mlp", "down_bias"), (2, 8, 64), 2, 4) == (None, "expert", None)
    assert espec(("layers", "mlp", "gate_proj"), (2, 8, 64, 32), 1, 8) == (None, "expert", None, None)
    assert espec(("layers", "mlp", "router", "kernel"), (2, 64, 8), 2, 4) == (None, None, None)
    assert espec(("layers", "self_attn", "q_proj", "kernel"), (2, 64, 64), 1, 4) == (None, None, None)
    expected = r"mlp/gate_proj of shape \[2, 6, 64, 32\]: its 6 experts .* expert axis of size 4"
    with pytest.raises(ValueError, match=expected):
        sharding.param_spec(("layers", "mlp", "gate_proj"), (2, 6, 64, 32), qwen3, 1, 4)
    with pytest.raises(ValueError, match="make_mesh: data=3 x fsdp=1 x tensor=1 needs 3 devices"):
        sharding.make_mesh(data=3)
    assert sharding.parse_mesh("tensor=4,data=2") == {"tensor": 4, "data": 2}
    assert sharding.parse_mesh("expert=4,tensor=2") == {"expert": 4, "tensor": 2}
    with pytest.raises(ValueError, match="'model=2'"):
        sharding.parse_mesh("model=2")


def test_sampling_on_a_mesh_matches_the_target_distribution(findings):
    """Speculative sampling on tensor=2 x data=4 keeps the target's exact distribution (the
    chi-square of tests/decode/test_sampling.py, its seeds and threshold), drafts were accepted, and the
    programs' parameter shardings are the rules'."""
    from support.sampling import SAMPLES, chi_square_pvalue, exact_joint, sampling_pair

    sampled = findings["sampling"]
    samples = [tuple(t) for t in sampled["tokens"]]
    assert len(samples) == SAMPLES and all(len(s) == 3 for s in samples)
    target, _ = sampling_pair()
    assert chi_square_pvalue(samples, exact_joint(target)) > 1e-3
    assert sampled["tau"] > 1.05
    assert sampled["problems"] == []


def distributed_run(out: str, coordinator: str, num_processes: int, process_id: int) -> None:
    """One process of a jax.distributed job (4 CPU devices each): the Qwen3 pair on a tensor=2 x
    data=4 mesh over both processes' devices; the prompts arrive on process 0 only (the others pass
    None: `Generator` broadcasts process 0's) and every process gets every row back (`Generator`
    gathers across processes). Then a prompt process 0 refuses raises on every process."""
    from dflash_jax import sharding

    sharding.initialize_distributed(coordinator, num_processes, process_id)
    import jax

    from dflash_jax.engine.generator import Generator

    target, drafter = _models("qwen3")
    mesh = sharding.make_mesh(tensor=2, data=4)
    generator = Generator(target, drafter, mesh=mesh)
    prompts = PROMPTS if process_id == 0 else None
    result = generator.generate(prompts, max_new_tokens=MAX_NEW, stop_token_ids=())
    try:
        generator.generate([[1], [10**6]] if process_id == 0 else None, max_new_tokens=2)
        refused = None
    except ValueError as e:
        refused = str(e)
    Path(out).write_text(json.dumps({"tokens": result.tokens, "devices": len(jax.devices()),
                                     "local_devices": len(jax.local_devices()), "refused": refused}))


@pytest.mark.slow  # make test-all
def test_two_processes_joined_by_jax_distributed_generate_as_one(findings, tmp_path):
    """Two processes (CPU collectives over gloo) run one sharded generate over their 8 devices, the
    prompts given to process 0 only, and both get one device's tokens; a token id outside the
    vocabulary on process 0 is refused on both."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": xla_flags(4), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(Path(__file__).parent)])}
    procs = [subprocess.Popen([sys.executable, "-c", "import jax; jax.config.update('jax_default_matmul_precision', "
                               f"'highest'); import test_sharded_generate as t; t.distributed_run("
                               f"{str(tmp_path / f'p{i}.json')!r}, 'localhost:{port}', 2, {i})"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    logs = [p.stdout.read() for p in procs]
    if any(codes) and any("collectives" in log.lower() or "gloo" in log.lower() for log in logs):
        pytest.skip("this jax cannot run CPU collectives across processes: " + logs[0][-500:])
    assert codes == [0, 0], [log[-3000:] for log in logs]
    for i in range(2):
        run = json.loads((tmp_path / f"p{i}.json").read_text())
        assert (run["devices"], run["local_devices"]) == (8, 4)
        assert run["tokens"] == findings["qwen3"]["reference"]["even"], i
        assert run["refused"] is not None, i
    assert "token ids must lie in [0, 64)" in json.loads((tmp_path / "p0.json").read_text())["refused"]
    assert "process 0" in json.loads((tmp_path / "p1.json").read_text())["refused"]
