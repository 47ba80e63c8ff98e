"""`bench ablate` plumbing on a tiny model: a couple of ablations run on and off and report a
gain each. Speed is never asserted."""
import json

from tokenmill.entrypoints.cli import main


def test_ablate_reports_a_gain_per_ablation(tiny_llama_dir, tmp_path):
    out = tmp_path / "ablate.json"
    rc = main(["bench", "ablate", "--model", tiny_llama_dir, "--dataset", "random",
               "--only", "paged_kv,continuous_batching,prefix_caching,weight_prepack,q8_tiles",
               "--num-prompts", "4",
               "--output-len", "6", "--max-input-len", "12", "--max-num-seqs", "3",
               "--max-num-batched-tokens", "64", "--repeats", "1", "--num-threads", "1",
               "--no-progress", "--json", str(out), "--output-dir", str(tmp_path / "report")])
    assert rc == 0
    result = json.loads(out.read_text())
    rows = {r["ablation"]: r for r in result["rows"]}
    assert list(rows) == ["paged_kv", "continuous_batching", "prefix_caching", "weight_prepack",
                          "q8_tiles"]
    for row in rows.values():
        assert row["on_tok_s"] > 0 and row["off_tok_s"] > 0 and row["gain"] > 0
    # the contiguous cache fits fewer requests at once than the paged one
    assert rows["paged_kv"]["off_peak_running"] < rows["paged_kv"]["on_peak_running"]
    assert "shared prefix" in rows["prefix_caching"]["workload"]
    assert "no oneDNN-layout copy" in rows["weight_prepack"]["off"]
    assert rows["q8_tiles"]["off"] == "int8, q8 activations without the tiled GEMM"
    assert (tmp_path / "report" / "ablate.png").stat().st_size > 0


def test_ablate_rejects_unknown_names(tiny_llama_dir, tmp_path):
    rc = main(["bench", "ablate", "--model", tiny_llama_dir, "--dataset", "random",
               "--only", "warp_drive", "--output-dir", str(tmp_path)])
    assert rc == 2
