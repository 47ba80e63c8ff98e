"""`tokenmill bench serve --dataset sharegpt` against a live server, on a ShareGPT-format file
cut off mid-record as the packaged ShareGPT V3 copy is (a plain json.load fails on it)."""
import json

import pytest

from tests.bench.test_serve_sharegpt import _record, write_truncated
from tests.entrypoints.openai.conftest import MODEL_NAME
from tokenmill.bench import serve as bench_serve

pytestmark = pytest.mark.e2e


def test_bench_serve_sharegpt_truncated_file(server, tmp_path):
    data = write_truncated(tmp_path / "sharegpt.json", [_record(i) for i in range(4)])
    out = tmp_path / "bench.json"
    rc = bench_serve.main(["--base-url", server.url + "/v1", "--model-name", MODEL_NAME,
                           "--dataset", "sharegpt", "--dataset-path", data,
                           "--num-prompts", "3", "--output-len", "4", "--no-warmup",
                           "--no-progress", "--output-json", str(out)])
    assert rc == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["completed"] == 3 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 12   # 40-character answers: 10 tokens, capped at 4
