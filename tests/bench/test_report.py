"""The report writer: valid JSON, a markdown table, a PNG chart, from any bench's rows."""
import json

from tokenmill.bench.report import Chart, flatten, markdown_table, progress, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_write_report_makes_json_markdown_and_png(tmp_path):
    rows = [{"engine": "tokenmill", "decode_tok_s": 41.5, "rss": {"mb": 700.0}, "ok": True},
            {"engine": "llama.cpp", "decode_tok_s": None, "rss": {"mb": 310.2}, "note": "a|b"}]
    result = {"bench": "demo", "model": "tiny", "machine": {"load_avg_1m": 0.5}, "rows": rows,
              "goals": [{"goal": "decode", "met": False}]}
    paths = write_report("demo", result, str(tmp_path / "out"), rows,
                         Chart("engine", ("decode_tok_s", "rss.mb"), title="demo"))
    assert json.loads(open(paths["json"]).read()) == result
    md = open(paths["md"]).read()
    assert md.startswith("# tokenmill bench demo")
    assert "| engine | decode_tok_s | rss.mb | ok | note |" in md
    assert "| llama.cpp | — | 310.2 |" in md and "a\\|b" in md      # None and pipes survive
    assert "## goals" in md and "load_avg_1m=0.5" in md
    with open(paths["png"], "rb") as f:
        assert f.read(8) == PNG_MAGIC


def test_line_chart_and_no_chart_without_numbers(tmp_path):
    rows = [{"context_len": 8, "tok_s": 1.0}, {"context_len": 16, "tok_s": 2.0}]
    paths = write_report("lat", {"rows": rows}, str(tmp_path), rows,
                         Chart("context_len", ("tok_s",), kind="line"))
    assert open(paths["png"], "rb").read(8) == PNG_MAGIC
    paths = write_report("none", {}, str(tmp_path), [{"a": "x"}], Chart("a", ("missing",)))
    assert "png" not in paths and (tmp_path / "none.md").exists()


def test_flatten_and_table_shapes():
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == {"a.b": 1, "a.c.d": 2, "e": 3}
    table = markdown_table([{"x": 1}, {"y": 12345.678}])
    assert table.splitlines()[0] == "| x | y |" and "12,345.7" in table
    assert markdown_table([]) == "(no rows)\n"


def test_progress_bar_can_be_disabled():
    with progress(3, "quiet", enabled=False) as bar:
        bar.update()
        bar.set_postfix_str("x")
