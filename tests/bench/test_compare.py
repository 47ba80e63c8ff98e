"""`bench compare` plumbing on a tiny model: tokenmill and transformers each run in their own
process on the same token ids, missing peers are rows (not errors), and the report files
appear. Speed is never asserted."""
import json

import pytest

from tokenmill.bench.compare import agreement, goals
from tokenmill.bench.peers import canonical, missing_reason
from tokenmill.entrypoints.cli import main


def test_agreement_counts_whole_prompts_and_prefixes():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert agreement(ref, ref, 4) == (1.0, 1.0)
    assert agreement([[1, 2, 3, 4], [5, 6, 0, 8]], ref, 4) == (0.5, 0.75)
    assert agreement([[1, 2, 3, 9], [5, 6, 7, 8]], ref, 3) == (1.0, 1.0)   # only the first L count


def test_goals_are_ratios_of_ok_rows():
    rows = [{"engine": "tokenmill", "precision": "fp32", "status": "ok", "decode_tok_s": 30.0,
             "prefill_tok_s": 500.0, "throughput_tok_s": 300.0, "decode_x_floor": 1.2},
            {"engine": "transformers", "precision": "fp32", "status": "ok", "decode_tok_s": 10.0,
             "prefill_tok_s": 400.0, "throughput_tok_s": 140.0},
            {"engine": "llama.cpp", "precision": "gguf", "status": "not installed"}]
    by_goal = {g["goal"]: g for g in goals(rows)}
    assert by_goal["fp32 batch-1 decode vs transformers fp32"]["value"] == 3.0
    assert by_goal["fp32 batch-1 decode vs transformers fp32"]["met"] is True
    assert by_goal["fp32 batch-1 decode, multiple of its floor"]["met"] is True
    assert by_goal["gguf batch-1 decode vs llama.cpp on the same file"]["met"] is None


def test_llamacpp_gguf_is_compared_with_the_q8_activation_row():
    """llama.cpp rounds activations to 8 bits on a quantized file: its counterpart is
    tokenmill's gguf-q8 row when there is one, else the gguf row."""
    from tokenmill.bench.compare import add_comparisons

    def row(engine, precision, decode):
        return {"engine": engine, "precision": precision, "name": f"{engine} {precision}",
                "status": "ok", "decode_tok_s": decode, "prefill_tok_s": 100.0,
                "throughput_tok_s": 50.0, "peak_rss_bytes": 2**30, "output_token_ids": [[1, 2]]}
    rows = [row("tokenmill", "fp32", 20.0), row("tokenmill", "gguf", 40.0),
            row("tokenmill", "gguf-q8", 60.0), row("llama.cpp", "gguf", 50.0)]
    add_comparisons(rows, 2, 10.0, 16)
    assert rows[3]["tokenmill_vs"]["against"] == "tokenmill gguf-q8"
    assert rows[3]["tokenmill_vs"]["decode"] == 1.2
    by_goal = {g["goal"]: g for g in goals(rows)}
    assert by_goal["tokenmill gguf-q8 batch-1 decode vs llama.cpp on the same file"]["value"] == 1.2
    del rows[2]
    add_comparisons(rows, 2, 10.0, 16)
    assert rows[2]["tokenmill_vs"]["against"] == "tokenmill gguf"


def test_rounds_merge_to_per_measure_medians():
    from tokenmill.bench.compare import merge_rounds

    def row(decode, rss, status="ok"):
        return {"name": "x", "engine": "x", "precision": "fp32", "status": status,
                "decode_tok_s": decode, "prefill_tok_s": 2 * decode, "throughput_tok_s": 3 * decode,
                "peak_rss_bytes": rss}
    merged = merge_rounds([[row(10.0, 5), {"name": "y", "status": "not installed"}],
                           [row(30.0, 7), {"name": "y", "status": "not installed"}],
                           [row(20.0, 6), {"name": "y", "status": "not installed"}]])
    assert merged[0]["decode_tok_s"] == 20.0 and merged[0]["throughput_tok_s"] == 60.0
    assert merged[0]["peak_rss_bytes"] == 7 and merged[0]["rounds"]["decode_tok_s"] == [10.0, 30.0, 20.0]
    assert merged[1]["status"] == "not installed"
    failed_once = merge_rounds([[row(10.0, 5, "error: boom")], [row(12.0, 5)], [row(16.0, 5)]])
    assert failed_once[0]["status"] == "ok" and failed_once[0]["decode_tok_s"] == 14.0
    assert failed_once[0]["failed_rounds"] == 1
    assert merge_rounds([[row(1.0, 5, "error: a")], [row(1.0, 5, "error: b")]])[0]["status"] == "error: a"


def test_peer_names():
    assert canonical("llamacpp") == "llama.cpp" and canonical("HF") == "transformers"
    with pytest.raises(ValueError):
        canonical("nope")
    assert missing_reason("tokenmill") is None


@pytest.mark.slow
def test_compare_runs_transformers_peer_and_reports_missing_ones(tiny_llama_dir, tmp_path):
    out = tmp_path / "compare.json"
    rc = main(["bench", "compare", "--model", tiny_llama_dir, "--dataset", "random",
               "--peers", "transformers,llama.cpp,vllm", "--num-prompts", "3", "--output-len", "4",
               "--max-input-len", "8", "--prefill-len", "12", "--repeats", "1",
               "--num-threads", "1", "--no-progress", "--json", str(out),
               "--output-dir", str(tmp_path / "report")])
    assert rc == 0
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    tm, hf = rows["tokenmill fp32"], rows["transformers fp32"]
    for row in (tm, hf):
        assert row["status"] == "ok", row.get("traceback")
        assert row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0 and row["throughput_tok_s"] > 0
        assert row["peak_rss_bytes"] > 0
        assert 0.0 <= row["greedy_agreement"] <= 1.0
    assert tm["greedy_agreement"] == 1.0                     # the reference
    assert hf["tokenmill_vs"]["against"] == "tokenmill fp32"
    # llama.cpp is either not installed or has no GGUF here; vLLM is not installed
    assert all(rows[n]["status"] != "ok" for n in ("llama.cpp gguf", "llama.cpp fp32", "vllm fp32"))
    assert "tokenmill gguf" not in rows                     # not a GGUF model: fp32 only
    for ext in ("json", "md", "png"):
        assert (tmp_path / "report" / f"compare.{ext}").stat().st_size > 0


def test_contexts_run_each_row_once_more_at_each_length(tiny_llama_dir, tmp_path):
    """--contexts: prefill and decode at each context, from a process of its own per row,
    with tokenmill's floor and the transformers row compared against tokenmill fp32."""
    out = tmp_path / "compare.json"
    rc = main(["bench", "compare", "--model", tiny_llama_dir, "--dataset", "random",
               "--peers", "transformers", "--num-prompts", "2", "--output-len", "4",
               "--max-input-len", "8", "--prefill-len", "12", "--repeats", "1",
               "--contexts", "40,24,512", "--context-output-len", "5", "--kv-cache-dtype", "fp16",
               "--num-threads", "1", "--no-progress", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    lines = {(line["name"], line["context"]): line for line in result["contexts"]}
    # 512 is the tiny model's whole context: its prompt leaves room for 5 tokens out (and 8 more)
    assert set(lines) == {(n, c) for n in ("tokenmill fp32", "transformers fp32") for c in (24, 40, 499)}
    for line in lines.values():
        assert line["status"] == "ok" and line["decode_tok_s"] > 0 and line["prefill_tok_s"] > 0
        assert line["peak_rss_mb"] > 0
    assert lines[("tokenmill fp32", 40)]["decode_x_floor"] > 0
    assert lines[("transformers fp32", 24)]["tokenmill_vs"]["against"] == "tokenmill fp32"
    tm = next(r for r in result["rows"] if r["name"] == "tokenmill fp32")
    assert tm["kv_cache_dtype"] == "fp16" and tm["kv_bytes_per_token"] > 0
    assert tm["kv_layer_windows"] and all(w is None for w in tm["kv_layer_windows"])   # Llama: all full
    assert any("ctx 40, multiple of its floor" in g["goal"] for g in result["goals"])


def test_contexts_past_the_models_length_take_the_longest_prompt_that_fits():
    from tokenmill.bench import compare_contexts
    assert compare_contexts.fit([512, 2048, 4096, 8192], 8192, 64) == [512, 2048, 4096, 8120]
    assert compare_contexts.fit([8000, 8192, 9000], 8192, 64) == [8000, 8120]   # one prompt each
    assert compare_contexts.fit([512, 8192], 32768, 64) == [512, 8192]
    assert compare_contexts.fit([512, 8192], None, 64) == [512, 8192]
    with pytest.raises(ValueError, match="leaves no prompt"):
        compare_contexts.fit([512], 64, 64)


def test_context_goals_pair_llamacpp_with_its_tokenmill_row():
    from tokenmill.bench import compare_contexts
    rows = [{"name": "tokenmill gguf-q8", "engine": "tokenmill", "precision": "gguf-q8",
             "weight_bytes": 10**8, "kv_bytes_per_token": 10**4},
            {"name": "llama.cpp gguf", "engine": "llama.cpp", "precision": "gguf"}]
    runs = {"tokenmill gguf-q8": {"status": "ok", "peak_rss_bytes": 2**20,
                                  "contexts": {"512": {"prefill_tok_s": 900.0, "decode_tok_s": 150.0}}},
            "llama.cpp gguf": {"status": "ok", "peak_rss_bytes": 2**20,
                               "contexts": {"512": {"prefill_tok_s": 300.0, "decode_tok_s": 100.0}}}}
    lines = compare_contexts.attach(rows, runs, 40.0, {"gguf": ("gguf-q8", "gguf")}, 64)
    lc = next(line for line in lines if line["name"] == "llama.cpp gguf")
    assert lc["tokenmill_vs"] == {"against": "tokenmill gguf-q8", "decode": 1.5, "prefill": 3.0}
    floor = 40e9 / (10**8 + 10**4 * (512 + 32))
    tm = next(line for line in lines if line["name"] == "tokenmill gguf-q8")
    assert tm["decode_x_floor"] == round(floor / 150.0, 2)
    met = {g["goal"]: g["met"] for g in compare_contexts.goals(lines)}
    assert met["tokenmill gguf-q8 decode at ctx 512 vs llama.cpp gguf"] is True
    # a row that streams fewer bytes than it holds (bf16 mode's tiles) takes those for its floor
    rows[0]["decode_weight_bytes"] = 5 * 10**7
    lines = compare_contexts.attach(rows, runs, 40.0, {"gguf": ("gguf-q8", "gguf")}, 64)
    tm = next(line for line in lines if line["name"] == "tokenmill gguf-q8")
    assert tm["decode_x_floor"] == round(40e9 / (5 * 10**7 + 10**4 * (512 + 32)) / 150.0, 2)
    # sliding-window layers read only their window of the cache: two layers, one of window 64
    rows[0]["kv_layer_windows"] = [None, 64]
    lines = compare_contexts.attach(rows, runs, 40.0, {"gguf": ("gguf-q8", "gguf")}, 64)
    tm = next(line for line in lines if line["name"] == "tokenmill gguf-q8")
    step = 5 * 10**7 + 10**4 / 2 * (512 + 32) + 10**4 / 2 * 64
    assert tm["decode_x_floor"] == round(40e9 / step / 150.0, 2)
    with pytest.raises(ValueError):
        compare_contexts.parse("512,-1")


def test_peer_peak_rss_counts_the_processes_it_started():
    """An engine that computes in a child process (vLLM's engine core) is measured whole:
    the peer's peak RSS adds each live descendant's high-water mark to its own."""
    import subprocess
    import sys
    from tokenmill.bench.peers.__main__ import peak_rss_bytes
    from tokenmill.bench.proc_memory import vm_hwm
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; b = bytearray(160 << 20); "
                              "print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        total, children = peak_rss_bytes()
        assert children >= 1
        assert total >= vm_hwm("self") + (150 << 20)
    finally:
        child.kill()
        child.wait()


def test_cpu_isa_avx2_caps_every_row_and_llamacpp_may_run_elsewhere(tiny_llama_dir, tmp_path):
    """--cpu-isa avx2: the tokenmill row's kernels are the AVX2 build and torch's own are
    capped in its process; --llamacpp-python names the environment of the llama.cpp rows."""
    out = tmp_path / "compare.json"
    rc = main(["bench", "compare", "--model", tiny_llama_dir, "--dataset", "random",
               "--peers", "llama.cpp", "--llamacpp-python", str(tmp_path / "no-python"),
               "--cpu-isa", "avx2", "--num-prompts", "2", "--output-len", "4",
               "--max-input-len", "8", "--prefill-len", "12", "--repeats", "1",
               "--num-threads", "1", "--no-progress", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["cpu_isa"] == "avx2"
    rows = {r["name"]: r for r in result["rows"]}
    tm = rows["tokenmill fp32"]
    assert tm["status"] == "ok" and tm["cpu_isa"] == "avx2"
    assert "avx512" not in tm["kernel_flags"] and "-mavx2" in tm["kernel_flags"]
    assert tm["torch_cpu_capability"] == "AVX2"          # ATEN_CPU_CAPABILITY in its process
    assert rows["llama.cpp gguf"]["status"].startswith("no such python")


def test_bf16_row_keeps_bf16_kv_like_vllms_bf16_row_unless_asked_otherwise():
    from tokenmill.bench.compare import row_kv_cache_dtype
    assert row_kv_cache_dtype("bf16", "auto") == "bfloat16"
    assert row_kv_cache_dtype("fp32", "auto") == "auto"
    assert row_kv_cache_dtype("gguf-q8", "auto") == "auto"
    assert row_kv_cache_dtype("bf16", "fp16") == "fp16"
    assert row_kv_cache_dtype("fp32", "fp16") == "fp16"
