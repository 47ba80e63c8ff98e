"""Benchmark plumbing on a tiny model (a few tokens): the commands run and report the
fields the closing notes quote. Speed itself is never asserted."""
import json

from tokenmill.entrypoints.cli import main


def test_bench_throughput_reports_both_modes(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "t.json"
    rc = main(["bench", "throughput", "--model", tiny_llama_dir, "--num-prompts", "4",
               "--input-len", "8", "--output-len", "4", "--repeats", "1", "--json", str(out),
               "--output-dir", str(tmp_path / "report")])
    assert rc == 0
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result          # stdout still the JSON
    assert json.loads((tmp_path / "report" / "throughput.json").read_text()) == result
    assert "| continuous batching |" in (tmp_path / "report" / "throughput.md").read_text()
    assert (tmp_path / "report" / "throughput.png").stat().st_size > 0
    assert result["continuous_batching_output_tok_s"] > 0
    assert result["one_at_a_time_output_tok_s"] > 0 and result["speedup"] > 0
    assert "load_avg_1m" in result["machine"]


def test_bench_latency_reports_floor_multiples(tiny_llama_dir, tmp_path):
    out = tmp_path / "l.json"
    rc = main(["bench", "latency", "--model", tiny_llama_dir, "--context-lens", "8,16",
               "--decode-tokens", "3", "--repeats", "1", "--json", str(out),
               "--output-dir", str(tmp_path)])
    assert rc == 0
    assert {"latency.json", "latency.md", "latency.png"} <= {p.name for p in tmp_path.iterdir()}
    rows = json.loads(out.read_text())["rows"]
    assert [r["context_len"] for r in rows] == [8, 16]
    assert all(r["decode_ms_per_token"] > 0 and r["decode_x_floor"] > 0 for r in rows)
