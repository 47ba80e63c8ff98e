"""`tokenmill bench gpu` end to end on a CPU with tiny shapes: the plumbing the prepared GPU
run (scripts/gpu_check.sh) depends on, so a lent GPU's minutes are not lost to a typo."""
import json
import subprocess
import sys


def test_bench_gpu_runs_on_cpu_with_tiny_shapes(tmp_path):
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "bench", "gpu", "--device", "cpu",
           "--fidelity-shape", "tiny", "--shapes", "tiny", "--precisions", "float32,fp8",
           "--batch-sizes", "4", "--context-len", "32", "--decode-tokens", "4",
           "--input-len", "8", "--output-len", "4", "--json", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    rows = result["rows"]
    fidelity = {r["dtype"]: r for r in rows if r["section"] == "fidelity"}
    assert fidelity["float32"]["identical_sequences"] == "8/8"   # fp32 on CPU: exact vs HF
    latency = [r for r in rows if r["section"] == "latency"]
    assert {r["precision"] for r in latency} == {"float32", "fp8"} and len(latency) == 4
    assert all(r["decode_ms_per_token"] > 0 and r["x_floor"] > 0 for r in latency)
    engines = {r["engine"] for r in rows if r["section"] == "throughput"}
    assert engines == {"tokenmill", "hf-transformers"}
    assert all("vs_hf" in r for r in rows if r.get("engine") == "tokenmill")
    assert result["copy_bandwidth_gb_s"] > 0
