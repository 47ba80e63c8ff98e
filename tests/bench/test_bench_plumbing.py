"""Benchmark plumbing on a tiny model (a few tokens): the commands run and report the
fields the closing notes quote. Speed itself is never asserted."""
import json

import pytest

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


@pytest.mark.slow
def test_bench_latency_torch_compile_rows_and_compile_time(tiny_llama_dir, tmp_path):
    """--torch-compile measures a compiled engine after the eager one, with ratios and the
    compile time; the compiled model computes the same tokens."""
    from tokenmill import LLM, SamplingParams
    out = tmp_path / "l.json"
    rc = main(["bench", "latency", "--model", tiny_llama_dir, "--context-lens", "24",
               "--decode-tokens", "2", "--repeats", "1", "--torch-compile", "--json", str(out),
               "--output-dir", str(tmp_path)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [r["mode"] for r in result["rows"]] == ["eager", "torch.compile"]
    assert result["rows"][1]["prefill_vs_eager"] > 0 and "compile_s" in result
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 40))}]
    outs = [LLM(model=tiny_llama_dir, skip_tokenizer_init=True, torch_compile=c).generate(
        prompts, params, use_tqdm=False)[0].outputs[0] for c in (False, True)]
    assert outs[0].token_ids == outs[1].token_ids
    for a, b in zip(outs[0].logprobs, outs[1].logprobs):
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a if t in b)


def test_bench_quant_takes_checkpoints_and_kv_schemes(tiny_llama_dir, tmp_path):
    from tokenmill import LLM
    from tokenmill.models.loader import open_checkpoint
    from tokenmill.quantization import writer
    from tokenmill.quantization.quantize import QuantizeArgs, _quantize_tensors, linear_prefixes
    ckpt = str(tmp_path / "rtn4")
    source = open_checkpoint(tiny_llama_dir)
    model = LLM(model=tiny_llama_dir, skip_tokenizer_init=True).engine.model
    args = QuantizeArgs(model=tiny_llama_dir, method="rtn", output=ckpt, bits=4, group_size=32)
    written = _quantize_tensors(args, dict(source.iter_tensors()), linear_prefixes(model), None, model)
    writer.write_checkpoint(ckpt, source.hf_config, written, writer.quantization_config("rtn", 4, 32))
    out = tmp_path / "q.json"
    rc = main(["bench", "quant", "--model", tiny_llama_dir,
               "--schemes", f"none,{ckpt},kv:int8,kv:bf16,int8:q8",
               "--batch-sizes", "1", "--prompt-len", "4", "--prefill-len", "8", "--steps", "2",
               "--json", str(out), "--output-dir", ""])
    assert rc == 0
    result = json.loads(out.read_text())
    schemes = result["schemes"]
    assert set(schemes) == {"none", "rtn4", "kv:int8", "kv:bf16", "int8:q8"}
    # every bench's machine facts carry the process's peak RSS (here: five engines loaded)
    assert result["machine_after"]["peak_rss_mb"] >= result["machine"]["peak_rss_mb"] > 50
    assert schemes["int8:q8"]["weight_bytes"] < schemes["none"]["weight_bytes"]
    assert schemes["rtn4"]["weight_bytes"] < schemes["none"]["weight_bytes"]
    assert schemes["kv:int8"]["weight_bytes"] == schemes["none"]["weight_bytes"]
    assert all(row["decode_b1_tok_s"] > 0 and row["prefill_tok_s"] > 0
               and row["decode_b1_x_floor"] > 0 for row in schemes.values())
