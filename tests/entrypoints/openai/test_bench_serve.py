"""`tokenmill bench serve` against a live server: every request completes, the numbers that
must exist do, and the JSON file holds one record per request."""
import json
import os

import pytest

from tests.entrypoints.openai.conftest import MODEL_NAME
from tokenmill.bench import serve as bench_serve
from tokenmill.bench.proc_memory import vm_hwm

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("mode", [["--request-rate", "20"], ["--max-concurrency", "2",
                                                             "--endpoint", "chat"]])
def test_bench_serve_reports(server, tmp_path, capsys, mode):
    out = tmp_path / "bench.json"
    # the peak so far: the bench's reading comes later and a peak only grows (a reading taken
    # after the bench could count the few KB allocated since, and fail by them)
    peak_before = vm_hwm("self")
    rc = bench_serve.main(["--base-url", server.url + "/v1", "--model-name", MODEL_NAME,
                           "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
                           "--slo-ttft-ms", "600000", "--output-json", str(out),
                           "--server-pid", str(os.getpid()), *mode])   # the server runs in this process
    assert rc == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["completed"] == 3 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 12
    assert summary["goodput_rps"] == summary["request_throughput_rps"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert summary[key]["p50"] is not None and summary[key]["p99"] >= summary[key]["p50"]
    assert json.loads(capsys.readouterr().out)["completed"] == 3
    assert summary["server_processes"] >= 1
    assert summary["server_peak_rss_mb"] >= peak_before / 2**20 > 100   # the model is loaded


def test_bench_serve_counts_errors(server):
    args = bench_serve.main(["--base-url", server.url + "/v1", "--model-name", "wrong-model",
                             "--num-prompts", "2", "--output-len", "2", "--no-warmup"])
    assert args == 1
