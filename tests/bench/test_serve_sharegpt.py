"""`tokenmill bench serve --dataset sharegpt` prompts: read through data/sharegpt.py, so a file
cut off mid-record (as the packaged ShareGPT V3 copy is) loads, and the cached copy is found
without ``--dataset-path``. Files are written here; no network."""
import json

import pytest

from tokenmill.bench.serve import sharegpt_prompts
from tokenmill.data.sharegpt import SHAREGPT, iter_conversations, split_of

ANSWER = "a" * 40   # 40 characters: 10 tokens by the bench's 4-characters-a-token rule


def _record(i: int, first: str = "human") -> dict:
    return {"id": f"conv{i}", "conversations": [
        {"from": first, "value": f"question {i}"}, {"from": "gpt", "value": ANSWER},
        {"from": "human", "value": "and then?"}]}


def write_truncated(path, records: list[dict]) -> str:
    """A ShareGPT-format JSON array with its last record cut off mid-string."""
    text = json.dumps(records, indent=2)
    cut = text.rindex('"value"')
    path.write_text(text[:cut + 12], encoding="utf-8")
    return str(path)


@pytest.fixture
def truncated(tmp_path):
    records = [_record(i) for i in range(5)] + [_record(5, first="gpt")] + [_record(6)]
    return write_truncated(tmp_path / "sharegpt.json", records)


def test_truncated_file_is_not_json_but_loads_record_by_record(truncated):
    with open(truncated) as f, pytest.raises(json.JSONDecodeError, match="Unterminated string"):
        json.load(f)
    convs = list(iter_conversations(truncated))
    # conv5 opens with an answer and conv6 is the cut-off tail: both dropped
    assert [c[0]["content"] for c in convs] == [f"question {i}" for i in range(5)]
    assert all(c[0]["role"] == "user" and c[1] == {"role": "assistant", "content": ANSWER}
               for c in convs)


def test_split_filter_keeps_only_that_split(truncated):
    benchmark = list(iter_conversations(truncated, "benchmark"))
    expected = [f"question {i}" for i in range(5) if split_of(f"conv{i}") == "benchmark"]
    assert [c[0]["content"] for c in benchmark] == expected


def test_sharegpt_prompts_from_a_truncated_file(truncated):
    prompts = sharegpt_prompts(truncated, num=7, output_len=64, seed=0)
    assert len(prompts) == 7   # 5 conversations, cycled
    assert {p for p, _ in prompts} == {f"question {i}" for i in range(5)}
    assert all(n == len(ANSWER) // 4 for _, n in prompts)
    assert {n for _, n in sharegpt_prompts(truncated, 3, output_len=6, seed=0)} == {6}   # capped
    assert sharegpt_prompts(truncated, 5, 64, seed=1) == sharegpt_prompts(truncated, 5, 64, seed=1)


def test_sharegpt_prompts_find_the_cached_copy(tmp_path):
    cached = tmp_path / "data" / SHAREGPT.filename
    cached.parent.mkdir()
    ids = [i for i in range(200) if split_of(f"conv{i}") == "benchmark"][:4]
    write_truncated(cached, [_record(i) for i in ids] + [_record(999)])
    prompts = sharegpt_prompts(None, num=4, output_len=64, seed=0, cache_dir=str(tmp_path))
    assert sorted(p for p, _ in prompts) == sorted(f"question {i}" for i in ids)


def test_no_usable_conversation_is_an_error(tmp_path):
    path = write_truncated(tmp_path / "bad.json", [_record(0, first="gpt"), _record(1)])
    with pytest.raises(ValueError, match="no conversations"):
        sharegpt_prompts(path, 2, 16, 0)
