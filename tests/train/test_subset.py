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
