"""`tokenmill bench structured` on a tiny model: it runs, both modes generate the same token
count, and the compile figures are there. Speed itself is never asserted."""
import json
import random

from tokenmill.bench.schemas import random_schema
from tokenmill.entrypoints.cli import main
from tokenmill.structured.params import StructuredOutputsParams


def test_bench_structured_reports_rows_and_compile_times(tiny_structured_dir, tmp_path):
    out = tmp_path / "s.json"
    rc = main(["bench", "structured", "--model", tiny_structured_dir, "--batch-sizes", "1,3",
               "--output-len", "6", "--num-schemas", "5", "--repeats", "1", "--json", str(out),
               "--output-dir", str(tmp_path / "report"), "--no-progress"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [r["batch"] for r in result["rows"]] == [1, 3]
    assert all(r["plain_tok_s"] > 0 and r["json_schema_tok_s"] > 0
               and r["json_schema_no_forced_tok_s"] > 0 for r in result["rows"])
    assert result["compile"]["num_schemas"] == 5
    assert 0 < result["compile"]["p50_ms"] <= result["compile"]["p99_ms"]
    assert (tmp_path / "report" / "structured.md").exists()


def test_random_schemas_are_valid_and_compile(compiler):
    rng = random.Random(1)
    for _ in range(30):
        compiler.compile(StructuredOutputsParams(json=random_schema(rng)))
