"""`tokenmill bench collectives`: the alpha-beta fit on exact data, and one real two-rank gloo
run on tiny messages (structure only; speed itself is never asserted)."""
import math

import pytest

from tokenmill.bench import collectives
from tokenmill.bench.collectives import fit_alpha_beta, format_table, measure


def test_fit_recovers_alpha_beta_and_keeps_them_physical():
    alpha, beta = 50e-6, 2e9                                    # 50 µs, 2 GB/s
    pts = [(b, alpha + b / beta) for b in (2304, 9216, 73728, 589824, 4194304)]
    f = fit_alpha_beta(pts)
    assert f["alpha_us"] == pytest.approx(50.0, rel=1e-6)
    assert f["beta_gb_s"] == pytest.approx(2.0, rel=1e-6)
    assert f["max_rel_err"] < 1e-9
    # times falling with size: no negative bandwidth, a flat fit (beta infinite)
    flat = fit_alpha_beta([(1000, 3e-4), (10_000, 2e-4)])
    assert flat["alpha_us"] > 0 and flat["beta_gb_s"] == math.inf
    # a line through the origin extended below zero: alpha clamps to 0, beta stays positive
    origin = fit_alpha_beta([(1000, 1e-7), (1_000_000, 1e-3)])
    assert origin["alpha_us"] >= 0 and 0 < origin["beta_gb_s"] < math.inf


def test_cli_registers_bench_collectives():
    from tokenmill.entrypoints.cli import build_parser
    args = build_parser().parse_args(["bench", "collectives", "--world-size", "2",
                                      "--sizes", "64,512", "--repeats", "3"])
    assert args.func is collectives.run
    assert (args.world_size, args.sizes, args.repeats) == (2, "64,512", 3)


@pytest.mark.distributed
def test_two_gloo_ranks_time_all_reduce_and_all_gather():
    result = measure(world_size=2, sizes=(64, 4096, 65536), repeats=2, warmup=1, timeout=60)
    assert result["backend"] == "gloo" and result["world_size"] == 2
    assert result["threads_per_rank"] >= 1
    rows = result["rows"]
    assert [(r["op"], r["elements"]) for r in rows] == [
        (op, n) for op in ("all_reduce", "all_gather") for n in (64, 4096, 65536)]
    for r in rows:
        assert r["bytes"] == 4 * r["elements"]
        assert 0 < r["min_us"] <= r["median_us"] <= r["p90_us"] and r["mean_us"] > 0
        assert r["algbw_gb_s"] > 0 and r["busbw_gb_s"] > 0
    # world 2: a ring all-reduce moves 2(n-1)/n = 1 x the bytes, an all-gather 1/2
    ar = [r for r in rows if r["op"] == "all_reduce"]
    ag = [r for r in rows if r["op"] == "all_gather"]
    assert all(r["busbw_gb_s"] == r["algbw_gb_s"] for r in ar)
    assert all(r["busbw_gb_s"] == pytest.approx(r["algbw_gb_s"] / 2, rel=2e-3) for r in ag)
    for key in ("fit", "fit_mean"):
        for op in ("all_reduce", "all_gather"):
            f = result[key][op]
            assert math.isfinite(f["alpha_us"]) and f["alpha_us"] >= 0
            assert f["beta_gb_s"] > 0
    assert result["machine"]["usable_cores"] >= 1 and result["machine"]["cpu_model"]
    table = format_table(result)
    assert "all_reduce" in table and "fit (median) all_gather" in table


def test_measure_rejects_a_single_rank():
    with pytest.raises(ValueError):
        measure(world_size=1)
