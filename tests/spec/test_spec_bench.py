"""`tokenmill bench spec` plumbing on a tiny model with 2 tokens: one run covers batch 1 and a
larger batch, grounded and chat prompts, no speculation and each method, temperatures 0 and 1,
and reports the fields the closing note quotes. Speed itself is never asserted."""
import argparse
import json

import pytest

from tokenmill.spec import bench


def main(argv: list[str]) -> int:
    """`tokenmill bench spec ...` through the bench's own parser (the CLI adds it the same way)."""
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="bench_command"))
    args = parser.parse_args(argv[1:])
    return args.func(args)


def test_bench_spec_reports_every_row(tiny_spec_chat_dir, tmp_path):
    out = tmp_path / "spec.json"
    rc = main(["bench", "spec", "--model", tiny_spec_chat_dir, "--batch-sizes", "1,2",
               "--min-prompts", "2", "--max-tokens", "2", "--repeats", "1", "--k", "2",
               "--methods", "ngram,adaptive_layer_skip", "--layer-skip-layers", "1",
               "--prompt-source", "builtin", "--temperature", "1", "--num-threads", "1",
               "--kv-cache-memory", "64", "--json", str(out), "--output-dir", str(tmp_path / "r"),
               "--no-progress"])
    assert rc == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    keys = {(r["workload"], r["temperature"], r["batch"], r["method"]) for r in rows}
    assert keys == {(w, t, b, m) for w in ("grounded", "chat") for t in (0.0, 1.0) for b in (1, 2)
                    for m in ("none", "ngram", "adaptive_layer_skip")}
    for r in rows:
        assert r["tok_s"] > 0 and r["ratio"] > 0
        if r["method"] != "none":
            assert r["tau"] == 0.0 or r["tau"] >= 1.0
            assert len(r["accepted_per_position"]) == 2 and 0 <= r["identical"] <= 1
            assert "est_speedup" in r and "k_chosen" in r
        if r["method"] != "none":     # exact at T = 0 and, seeded, at T = 1
            assert r["identical"] == 1.0
    assert result["prompt_source"] == "builtin"
    assert (tmp_path / "r" / "spec.md").exists() and (tmp_path / "r" / "spec.json").exists()


def test_method_names_choose_adaptive_and_int8_drafters():
    args = argparse.Namespace(drafter=["eagle3=/d/e", "dflash=/d/f"], draft_model=None,
                              layer_skip_layers=4, k=3)
    got = bench._configs(["eagle3", "adaptive_eagle3_int8", "dflash_int8", "ngram"], args)
    assert (got["eagle3"].quantization, got["eagle3"].adaptive) == (None, False)
    assert (got["adaptive_eagle3_int8"].method, got["adaptive_eagle3_int8"].quantization,
            got["adaptive_eagle3_int8"].adaptive, got["adaptive_eagle3_int8"].model) == ("eagle3", "int8", True, "/d/e")
    assert (got["dflash_int8"].method, got["dflash_int8"].quantization) == ("dflash", "int8")
    assert got["ngram"].quantization is None
    with pytest.raises(ValueError, match="unknown method"):
        bench._configs(["ngram_int8"], args)
    both = bench._configs(["adaptive_ngram_eagle3_int8", "adaptive_ngram"], args)
    c = both["adaptive_ngram_eagle3_int8"]
    assert (c.method, c.ngram_first, c.quantization, c.adaptive, c.model,
            c.prompt_lookup_min, c.prompt_lookup_max) == ("eagle3", True, "int8", True, "/d/e", 2, 4)
    assert (both["adaptive_ngram"].method, both["adaptive_ngram"].ngram_first) == ("ngram", False)
    with pytest.raises(ValueError, match="unknown method"):
        bench._configs(["ngram_ngram"], args)


def test_lookup_share_counts_requests_by_source():
    from tokenmill.spec.lookup_first import LookupFirstProposer
    from tokenmill.spec.ngram import NgramProposer
    p = LookupFirstProposer(NgramProposer(2, 4), NgramProposer(1, 1))
    assert bench._lookup_share(p) is None and bench._lookup_share(NgramProposer(1, 2)) is None
    p.drafts_by.update(lookup=3, drafter=1)
    assert bench._lookup_share(p) == 0.75
    p.reset_counts()
    assert p.drafts_by == {"lookup": 0, "drafter": 0}
