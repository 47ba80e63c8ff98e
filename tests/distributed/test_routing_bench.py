"""`tokenmill bench routing` end to end on the tiny model (random-token conversations)."""
import json

import pytest

from tokenmill.entrypoints.cli import main

pytestmark = pytest.mark.distributed


def test_prefix_routing_hits_the_cache_more_than_round_robin(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "routing.json"
    assert main(["bench", "routing", "--model", tiny_llama_dir, "--random-prompts",
                 "--num-conversations", "4", "--turns", "2", "--output-len", "4",
                 "--num-threads", "1", "--json", str(out), "--output-dir", "",
                 "--no-progress"]) == 0
    result = json.loads(out.read_text())
    rows = {row["router"]: row for row in result["rows"]}
    assert set(rows) == {"round_robin", "prefix"}
    for row in rows.values():
        assert sum(row["requests_per_replica"]) == 4 * 2 and row["ttft_p99_ms"] >= row["ttft_p50_ms"] > 0
    # every conversation's second turn finds its first turn on the same replica; under
    # round robin some land where only the system prompt is cached
    assert rows["prefix"]["prefix_hit_rate_turns_ge_2"] > rows["round_robin"]["prefix_hit_rate_turns_ge_2"]
    assert result["hit_rate_gain_turns_ge_2"] > 0
    assert '"bench": "routing"' in capsys.readouterr().out
