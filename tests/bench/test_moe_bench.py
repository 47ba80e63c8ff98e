"""`tokenmill bench moe` end to end on a tiny random shape: the random MoE model and its dense
twin are written once and reused, the rows carry MoE / dense ratios, the expert load counts
every routed pair of the batched run, and the heat map is drawn."""
import json

from tokenmill.bench.moe import RandomMoEShape, write_random_pair
from tokenmill.entrypoints.cli import main

TINY = ["--hidden", "64", "--layers", "2", "--experts", "4", "--expert-intermediate", "32",
        "--heads", "4", "--kv-heads", "2", "--vocab", "300", "--batch", "3", "--prompt-len", "8",
        "--output-len", "5", "--prefill-len", "16", "--loop-tokens", "8", "--repeats", "1"]


def test_bench_moe_reports_ratios_load_and_heatmap(tmp_path):
    out = tmp_path / "out"
    assert main(["bench", "moe", *TINY, "--cache-dir", str(tmp_path / "cache"), "--output-dir", str(out),
                 "--json", str(tmp_path / "moe.json")]) == 0
    result = json.loads((tmp_path / "moe.json").read_text())
    moe, dense = result["rows"]
    assert moe["name"] == "tokenmill-moe" and dense["name"] == "tokenmill-dense-equal-active"
    assert moe["vs_dense.batch_tok_s"] == round(moe["batch_tok_s"] / dense["batch_tok_s"], 3)
    load = result["expert_load"]
    # 3 sequences x (8 prompt tokens + 4 decode steps) through each of 2 layers, top-2
    assert load["num_layers"] == 2 and load["routed"] == 2 * 3 * (8 + 4) * 2
    assert result["fused_vs_loop"]["speedup"] > 0
    assert (out / "moe_heatmap.png").stat().st_size > 0 and (out / "moe.md").exists()


def test_random_pair_has_equal_active_parameters(tmp_path):
    shape = RandomMoEShape(hidden=32, layers=1, experts=4, top_k=2, expert_intermediate=16,
                           heads=2, kv_heads=1, vocab=64)
    moe_dir, dense_dir = write_random_pair(shape, str(tmp_path))
    moe_cfg = json.loads(open(f"{moe_dir}/config.json").read())
    dense_cfg = json.loads(open(f"{dense_dir}/config.json").read())
    assert dense_cfg["intermediate_size"] == moe_cfg["num_experts_per_tok"] * moe_cfg["intermediate_size"]
    assert write_random_pair(shape, str(tmp_path)) == (moe_dir, dense_dir)   # reused
