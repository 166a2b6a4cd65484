"""The conformance suite: every target family of the library (one row each in support/families.py)
passes the same checks. The checks are here; the test modules tests/families/test_conformance_<group>.py run
them over the rows of their group (`GROUPS`: a few families per module, so that pytest-xdist's
`--dist loadfile` spreads the suite over its processes), each with one line:
`globals().update(conformance.tests("<group>"))`. tests/families/test_family_conformance.py checks that every
family of the library has a row and every row a group.

Against transformers' class of the family (float32, tiny random models saved with save_pretrained,
every variant of the row): logits and captured layers; right-padded rows through the cached,
chunked prefill equal each row alone, and the next cached step continues them; greedy decoding,
plain and speculative with a random drafter, equals transformers' greedy `generate`; the name
table's export writes back the saved tensors. Greedy speculative decoding equals plain greedy
decoding with rejections at every block position: on the loaded target against transformers' greedy
continuations (on our own tiny target against `plain_greedy_rows` without torch, or where the row
says `tiny_rejections`). On our own tiny target of the row's config (no torch):
speculative sampling keeps the target's distribution (chi-square); the compiled decode step and
decode loop touch no whole cache buffer. The 8-device sharded equality is
test_sharded_generate's. A family's own behaviour (MXFP4, the delta rule's forms, sinks, its
config errors) stays in its own test file.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import families
from support.families import FAMILIES
from support.sampling import V
from support.speculative import check_rejections_at_every_position, check_sampling_lossless, tiny_drafter
from support.tolerance import assert_model_close

# The test module of each group is tests/families/test_conformance_<group>.py. No group is much costlier than the
# others (their default checks took 73-157 s each, one process on 2 busy shared cores, 2026-12-06): the
# hybrids' and MoE families' programs compile slowest.
GROUPS = {
    "dense": ("qwen3", "llama", "gpt_oss", "gemma4"),
    "moe": ("qwen3_moe", "glm4_moe", "minimax_m2"),
    "deepseek_v3": ("deepseek_v3",),
    "qwen3_5": ("qwen3_5", "qwen3_next"),
    "qwen3_5_moe": ("qwen3_5_moe",),
}

# ragged prompts for the greedy checks, shorter and longer than gpt-oss's window of 4
PROMPTS = [list(map(int, np.random.default_rng(5).integers(0, 40, size=n))) for n in (2, 11, 19)]

_CHECKS = []  # (test function, check of `families.params`, its keywords, argument name)


def _over_rows(check: str, argname: str = "key", **params):
    """Registers a test of this suite, parametrised (by `tests`) over `families.params(check, **params)`
    of a group's rows."""
    def register(test):
        _CHECKS.append((test, check, params, argname))
        return test
    return register


def tests(group: str) -> dict:
    """The suite's tests (and its `hf_pairs` and `hf_greedy` fixtures) for the rows of `group`, by name: a
    test module's namespace."""
    rows = GROUPS[group]
    family = lambda param: param.values[0] if isinstance(param.values[0], str) else param.values[0][0]  # noqa: E731
    out = {"hf_pairs": hf_pairs, "hf_greedy": hf_greedy}
    for test, check, params, argname in _CHECKS:
        copy = functools.wraps(test)(lambda *args, _test=test, **kwargs: _test(*args, **kwargs))
        chosen = [p for p in families.params(check, **params) if family(p) in rows]
        out[test.__name__] = pytest.mark.parametrize(argname, chosen)(copy)
    return out


# ---------------------------------------------------------------------------------------------
# Against transformers

@pytest.fixture(scope="module")
def hf_pairs(tmp_path_factory):
    """(family, variant) -> (row, transformers' model, our target loaded from its save_pretrained
    directory, the directory), each built once for the module."""
    from dflash_jax import load_target

    built = {}

    def get(key):
        if key not in built:
            family, variant = key
            directory = tmp_path_factory.mktemp(f"{family}-{variant}")
            model = families.make_hf(family, directory, variant=variant)
            built[key] = FAMILIES[family], model, load_target(directory, tokenizer=False), directory
        return built[key]

    return get


@pytest.fixture(scope="module")
def hf_greedy(hf_pairs):
    """key -> transformers' greedy continuations of `PROMPTS` (`hf_generate`, the row's max_new_tokens),
    computed once for the module: the plain and speculative greedy checks and the rejections compare with the same."""
    done = {}

    def get(key):
        if key not in done:
            row, model, _, _ = hf_pairs(key)
            done[key] = hf_generate(model, PROMPTS, row.max_new_tokens)
        return done[key]

    return get


def hf_outputs(model, ids, router=None):
    """transformers' (logits, hidden states, the smallest gap between a router's k-th and (k+1)-th
    largest logit over every token and layer of the routers named `*router`, or None): where the
    gap is far above float32 rounding, both sides choose the same experts."""
    import torch

    gaps = []

    def router_gap(module, args, out):
        logits = out[0].float().sort(-1, descending=True).values
        gaps.append(float((logits[:, module.top_k - 1] - logits[:, module.top_k]).min()))

    routers = [m for n, m in model.named_modules() if router and n.endswith(router)]
    hooks = [m.register_forward_hook(router_gap) for m in routers]
    try:
        with torch.no_grad():
            out = model(input_ids=torch.as_tensor(ids), output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    assert len(gaps) == len(routers)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states], min(gaps) if gaps else None


def hf_generate(model, prompts, max_new_tokens):
    """transformers' greedy continuation of each prompt alone, exactly max_new_tokens long."""
    import torch

    pad = model.config.get_text_config().vocab_size - 1  # not a prompt token
    with torch.no_grad():
        return [model.generate(torch.as_tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                               pad_token_id=pad)[0, len(p):].tolist() for p in prompts]


@_over_rows("parity", variants=True)
def test_logits_and_captured_layers_equal_transformers(hf_pairs, key):
    """The loaded config has transformers' layers, layer kinds and experts; two rows of the row's
    `parity_tokens` positions give its logits and captured layers (in any order, a repeat, the
    middle layer and the last: transformers' last hidden state is after the final norm, and so is
    ours)."""
    row, model, target, _ = hf_pairs(key)
    cfg, text = target.config, model.config.get_text_config()
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size) == (row.name, text.num_hidden_layers, text.hidden_size)
    if getattr(text, "layer_types", None):
        assert list(cfg.layer_types) == list(text.layer_types)
    assert cfg.num_experts == (getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0)
    shared = cfg.moe.shared_expert_intermediate_size if cfg.moe else 0
    assert shared == (getattr(text, "shared_expert_intermediate_size", None)  # DeepSeek-V3 / GLM: n_shared_experts
                      or (getattr(text, "moe_intermediate_size", 0) or 0) * (getattr(text, "n_shared_experts", 0) or 0))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, row.parity_tokens))
    logits, hidden_states, _ = hf_outputs(model, ids)
    capture = (1, 0, 1, cfg.num_layers // 2, cfg.num_layers - 1)
    spec = target.spec

    @jax.jit  # one program (run eagerly, the forward compiles dozens of single operations)
    def forward(params, tokens):
        hidden, features, _ = spec.forward(params, tokens, capture=capture)
        return spec.logits(params, hidden), features

    ours, features = forward(target.params, np.asarray(ids, np.int32))
    features = np.asarray(features)  # sliced on the host (no small program per slice)
    d = cfg.hidden_size
    assert features.shape == (*ids.shape, len(capture) * d)
    assert_model_close(np.asarray(ours), logits, cfg, tokens=ids.shape[1])
    for j, layer in enumerate(capture):
        assert_model_close(features[..., j * d:(j + 1) * d], hidden_states[layer + 1], cfg,
                           tokens=ids.shape[1], err_msg=f"layer {layer}")


@_over_rows("prefill", variants=True)
def test_cached_ragged_prefill_equals_each_row_alone(hf_pairs, key):
    """Right-padded rows through the cached, chunked prefill (the row's lengths, capacity and chunk
    size; a recurrent state stops at its row's length) give each row's logits and captured layers
    as transformers gives that row alone, and the next cached step (one token per row) continues
    them. A row with routers checks that no top-k choice is a near-tie rounding could flip."""
    row, model, target, _ = hf_pairs(key)
    cfg = target.config
    lengths = list(row.prefill["lengths"])
    chunk = {} if row.prefill["chunk_size"] is None else dict(chunk_size=row.prefill["chunk_size"])
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(3, max(lengths) + 1))
    capture = (0, cfg.num_layers // 2, cfg.num_layers - 1)
    spec = target.spec

    # each compiled whole with its logits (one program, not one per operation)
    @jax.jit
    def prefill(params, tokens, cache, num_new):
        hidden, features, cache = spec.prefill(params, tokens, cache, capture=capture, num_new=num_new, **chunk)
        return spec.logits(params, hidden), features, cache

    @jax.jit
    def step(params, tokens, cache):
        return spec.logits(params, spec.forward(params, tokens, cache)[0])

    ours, features, cache = prefill(target.params, np.asarray(ids[:, :max(lengths)], np.int32),
                                    target.init_cache(3, row.prefill["capacity"]), np.asarray(lengths, np.int32))
    assert list(np.asarray(cache.lengths)) == lengths
    nxt = ids[np.arange(3), lengths]
    following = np.asarray(step(target.params, np.asarray(nxt[:, None], np.int32), cache))
    ours, features = np.asarray(ours), np.asarray(features)  # sliced per row on the host
    d = cfg.hidden_size
    for r, n in enumerate(lengths):
        logits, hidden_states, gap = hf_outputs(model, np.concatenate([ids[r, :n], nxt[r:r + 1]])[None], row.router)
        if row.router:
            assert gap > 1e-4  # no top-k choice that float rounding could flip
        assert_model_close(ours[r, :n], logits[0, :n], cfg, tokens=ids.shape[1], err_msg=f"row {r}")
        assert_model_close(following[r, 0], logits[0, n], cfg, tokens=ids.shape[1], err_msg=f"row {r}, next step")
        for j, layer in enumerate(capture):
            assert_model_close(features[r, :n, j * d:(j + 1) * d], hidden_states[layer + 1][0, :n], cfg,
                               tokens=ids.shape[1], err_msg=f"row {r}, layer {layer}")


@_over_rows("greedy", variants=True)
def test_greedy_tokens_equal_transformers_generate(hf_pairs, hf_greedy, key):
    """Ragged prompts in one batch, plain decoding: each row is transformers' greedy `generate` of
    its prompt alone."""
    from dflash_jax.engine.generator import generate

    row, _, target, _ = hf_pairs(key)
    expect = hf_greedy(key)
    assert generate(target, None, PROMPTS, max_new_tokens=row.max_new_tokens, stop_token_ids=()).tokens == expect


@_over_rows("speculative", variants=False)
def test_speculative_greedy_with_a_random_drafter_equals_transformers_generate(hf_pairs, hf_greedy, key):
    """The same prompts decoded speculatively with a random drafter of block 4 (drafts rejected at
    every kind of place, the caches rolled back each cycle)."""
    from dflash_jax.engine.generator import generate

    row, _, target, _ = hf_pairs(key)
    expect = hf_greedy(key)
    drafter = tiny_drafter(target, block_size=4, seed=3)
    assert generate(target, drafter, PROMPTS, max_new_tokens=row.max_new_tokens, stop_token_ids=()).tokens == expect


@_over_rows("export", variants=True)
def test_export_writes_back_the_saved_tensors(hf_pairs, key, tmp_path):
    """The name table's export (`params_to_hf`) of the stacked layout gives back save_pretrained's
    tensors bit for bit (a multimodal checkpoint's text tensors, under its prefix; no lm_head where
    it is tied), and they load back to the same params."""
    from safetensors.numpy import load_file

    from dflash_jax import load_target
    from dflash_jax.formats.names import params_to_hf, target_rules
    from dflash_jax.formats.safetensors_io import save_safetensors

    row, _, _, directory = hf_pairs(key)
    target = load_target(directory, tokenizer=False, layout="stacked")
    cfg = target.config
    saved = load_file(directory / "model.safetensors")
    prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in saved) else "model."
    assert (prefix != "model.") == row.multimodal(key[1])
    exported = params_to_hf(target_rules(cfg, prefix), target.params, cfg.num_layers)
    text = {n: v for n, v in saved.items() if not cfg.family.unused_tensors(n)}  # a vision tower, ...
    if cfg.tie_word_embeddings:
        text.pop("lm_head.weight", None)
    assert sorted(exported) == sorted(text)
    for name, value in exported.items():
        np.testing.assert_array_equal(value, text[name], err_msg=name)
    save_safetensors(exported, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    again = load_target(tmp_path, tokenizer=False, layout="stacked")
    jax.tree_util.tree_map(np.testing.assert_array_equal, again.params, target.params)


# ---------------------------------------------------------------------------------------------
# Speculative decoding (rejections: see its docstring; the rest on our own tiny targets, no torch)

@_over_rows("rejections", "family", variants=False, keys=False)
def test_speculative_greedy_with_rejections_at_every_position(family, monkeypatch, request):
    """Three ragged rows, drafts wrong at a moving position of an 8-token block
    (`check_rejections_at_every_position`): plain greedy decoding bit for bit, every acceptance
    length 1..8, so every cache (a KV cache, a recurrent state, a window) rolled back at every
    position.

    With transformers' class of the row (and no `tiny_rejections`): the module's target loaded from
    transformers' save_pretrained (the first variant) on `PROMPTS`, and the plain greedy decoding is
    transformers' own (`hf_greedy`, computed once for the greedy checks; the rows' wrong positions 3
    apart, so that every acceptance length occurs within the row's 24 new tokens). Otherwise our
    `tiny_target` (the row's `decode_overrides`; no torch) against `plain_greedy_rows` of three
    ragged prompts, 40 new tokens."""
    row = FAMILIES[family]
    if not row.tiny_rejections and families.has_hf(family):
        key = (family, row.default_variant)
        _, _, target, _ = request.getfixturevalue("hf_pairs")(key)
        expect = request.getfixturevalue("hf_greedy")(key)
        check_rejections_at_every_position(target, tiny_drafter(target), PROMPTS, row.max_new_tokens, monkeypatch,
                                           expect=expect, stride=3)
        return
    target = families.tiny_target(family)
    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(0, 40, size=n))) for n in (3, 9, 20)]
    check_rejections_at_every_position(target, tiny_drafter(target), prompts, 40, monkeypatch)


@_over_rows("sampling", "family", variants=False, keys=False)
def test_speculative_sampling_keeps_the_targets_distribution(family):
    """`check_sampling_lossless` on a target of test_sampling's vocabulary (its exact joint
    distribution by enumeration; the row's `sampling_overrides`) and a random drafter of block 4."""
    row = FAMILIES[family]
    target = families.tiny_target(family, seed=3, scale=row.sampling_scale, vocab_size=V + 1, **row.sampling_overrides)
    check_sampling_lossless(target, tiny_drafter(target, block_size=4, seed=5))


# ---------------------------------------------------------------------------------------------
# No whole-cache work (`support.hlo.whole_buffer_ops`; test_decode_hlo has the mechanism's own tests)

@_over_rows("decode_step_hlo", "family", variants=False, keys=False)
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_decode_step_touches_only_new_cache_rows(family, num_tokens):
    """A decode step (1 token) and a verify (4): nothing of a whole cache layer is copied or
    rewritten (gathered and `ragged_dot` experts, recurrent states, windows, sinks)."""
    from support.hlo import CAPACITY, compiled_text, whole_buffer_ops

    target = families.tiny_target(family)
    spec, last = target.spec, target.config.num_layers - 1

    def step(params, tokens, cache):
        hidden, features, cache = spec.forward(params, tokens, cache, capture=(0, last))
        return spec.logits(params, hidden), features, cache

    tokens = jnp.zeros((2, num_tokens), jnp.int32)
    hlo = compiled_text(step, target.params, tokens, spec.init_cache(2, CAPACITY), donate=(2,))
    assert whole_buffer_ops(hlo) == []


@_over_rows("decode_loop_hlo", "family", variants=False, keys=False)
def test_decode_loop_touches_only_new_cache_rows(family):
    """The whole compiled speculative greedy loop of `generate`: its step cost does not follow the
    capacity (prompt bucket + 960 + block, rounded up to 1024)."""
    from dflash_jax.engine import generator as speculative
    from dflash_jax.kernels import KEY_TILE, round_up
    from support.hlo import whole_buffer_ops

    target = families.tiny_target(family, max_position_embeddings=2048)
    generator = speculative.Generator(target, tiny_drafter(target, block_size=4))
    cfg, args, _ = generator._prepare([[1, 2, 3]], max_new_tokens=960, temperature=0.0, top_k=0, top_p=1.0,
                                      stop_token_ids=(), block_size=None, seed=0, acceptance="exact", lookup=0,
                                      min_draft_probability=0.0)
    capacity = round_up(speculative.prompt_bucket(3) + cfg.max_new_tokens + cfg.block_size, KEY_TILE)
    assert capacity == 1024  # a number no other dimension of these models has
    _, loop, _ = generator._executables(cfg, args, "decode")
    assert whole_buffer_ops(loop.as_text(), capacity) == []
