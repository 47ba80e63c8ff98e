"""`tokenmill bench collectives`: torch.distributed (gloo) all-reduce and all-gather latency on
this machine, the numbers the tensor-parallel scaling model (docs/scaling.md) is built from.

``--world-size`` processes are started with multiprocessing's spawn method, rendezvous over TCP
on 127.0.0.1 (a free port) and split the cores between them (``cores // world`` torch threads
each). For every message size each collective runs a few untimed warm-up calls, then
``--repeats`` timed calls, each after a barrier; a call's time is the slowest rank's. Per size
the median is reported with the algorithm bandwidth (message bytes / time) and the bus
bandwidth (NCCL-tests' convention: all-reduce x 2(n-1)/n, all-gather x (n-1)/n, what a ring
actually moves per rank), and per collective a fit

    latency(bytes) = alpha + bytes / beta

where ``bytes`` is the message (all-reduce: the tensor reduced; all-gather: the gathered
output). The fit is least squares on relative error (weights 1 / measured time), so that the
microsecond sizes count as much as the megabyte ones, constrained to alpha >= 0 and beta > 0.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time
import traceback
from typing import Optional, Sequence

# elements (float32): one hidden row of SmolLM2 (576), a few rows, a prefill chunk, 4 MiB
DEFAULT_SIZES = (576, 576 * 4, 576 * 32, 576 * 256, 2 ** 20)
OPS = ("all_reduce", "all_gather")
_BYTES_PER_ELEMENT = 4        # float32


def add_parser(sub) -> None:
    from tokenmill.bench.report import add_output_args
    p = sub.add_parser("collectives",
                       help="gloo all-reduce / all-gather latency and bandwidth, alpha-beta fit")
    p.add_argument("--world-size", type=int, default=2, help="processes (ranks)")
    p.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
                   help="message sizes in float32 elements, comma separated")
    p.add_argument("--repeats", type=int, default=50, help="timed calls per size and collective")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before them")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds before the ranks are given up on")
    p.add_argument("--json", default=None)
    add_output_args(p)
    p.set_defaults(func=run)


# -- the ranks ------------------------------------------------------------------------------------
def _rank_main(rank: int, world: int, port: int, sizes: Sequence[int], repeats: int,
               warmup: int, threads: int, queue) -> None:
    """One rank: time every (collective, size) and send {(op, elements): [seconds]} home."""
    try:
        # gloo picks its network device from the hostname unless told; loopback is what we
        # rendezvous on, and a hostname that doesn't resolve would otherwise fail here
        if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        import torch
        import torch.distributed as dist
        torch.set_num_threads(threads)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        try:
            # correctness once: a sum of ranks, and a gather of them
            probe = torch.full((4,), float(rank + 1))
            dist.all_reduce(probe)
            if not torch.all(probe == world * (world + 1) / 2):
                raise RuntimeError(f"all_reduce returned {probe.tolist()}")
            got = [torch.empty(4) for _ in range(world)]
            dist.all_gather(got, torch.full((4,), float(rank)))
            if [int(g[0]) for g in got] != list(range(world)):
                raise RuntimeError(f"all_gather returned {[g.tolist() for g in got]}")
            times = {}
            for n in sizes:
                x = torch.randn(n)
                chunk = max(1, n // world)
                part = torch.randn(chunk)
                outs = [torch.empty(chunk) for _ in range(world)]
                calls = {"all_reduce": lambda: dist.all_reduce(x, op=dist.ReduceOp.SUM),
                         "all_gather": lambda: dist.all_gather(outs, part)}
                for op in OPS:
                    call = calls[op]
                    for _ in range(warmup):
                        call()
                    samples = []
                    for _ in range(repeats):
                        dist.barrier()
                        t0 = time.perf_counter()
                        call()
                        samples.append(time.perf_counter() - t0)
                    times[(op, n)] = samples
            queue.put(("ok", rank, {"times": times, "threads": torch.get_num_threads()}))
        finally:
            dist.destroy_process_group()
    except BaseException:                     # the parent reports it and stops the others
        queue.put(("error", rank, traceback.format_exc()))


def _gather_times(world: int, sizes: Sequence[int], repeats: int, warmup: int,
                  threads: int, timeout: float) -> list[dict]:
    import multiprocessing as mp
    import queue as queue_mod
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    from tokenmill.distributed.parallel_state import free_port   # torch: not at CLI start-up
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world, port, tuple(sizes), repeats, warmup, threads, q))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"bench collectives: ranks timed out after {timeout:.0f} s")
            try:
                status, rank, payload = q.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"bench collectives: a rank exited with code "
                                       f"{dead[0].exitcode} before reporting") from None
                continue
            if status == "error":
                raise RuntimeError(f"bench collectives: rank {rank} failed:\n{payload}")
            results[rank] = payload
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
        q.close()
    return [results[r] for r in range(world)]


# -- the numbers ----------------------------------------------------------------------------------
def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> dict:
    """``points``: (message bytes, seconds). Least squares on relative error of
    seconds = alpha + bytes / beta, with alpha >= 0 and 1/beta >= 0. Returns alpha in µs and
    beta in GB/s (inf when the time doesn't grow with size), and the fit's worst relative error."""
    if not points:
        raise ValueError("fit_alpha_beta needs at least one point")
    w = [1.0 / y for _, y in points]              # residual (pred - y) / y

    def solve_both():
        # weighted normal equations for y = a + b x
        s = sum(wi * wi for wi in w)
        sx = sum(wi * wi * x for wi, (x, _) in zip(w, points))
        sxx = sum(wi * wi * x * x for wi, (x, _) in zip(w, points))
        sy = sum(wi * wi * y for wi, (_, y) in zip(w, points))
        sxy = sum(wi * wi * x * y for wi, (x, y) in zip(w, points))
        det = s * sxx - sx * sx
        if det <= 0:
            return None
        return (sxx * sy - sx * sxy) / det, (s * sxy - sx * sy) / det

    def slope_only():
        num = sum(wi * wi * x * y for wi, (x, y) in zip(w, points))
        den = sum(wi * wi * x * x for wi, (x, _) in zip(w, points))
        return 0.0, (num / den if den > 0 else 0.0)

    def intercept_only():
        return sum(wi * wi * y for wi, (_, y) in zip(w, points)) / sum(wi * wi for wi in w), 0.0

    a_b = solve_both()
    if a_b is None or a_b[1] <= 0:
        a, b = intercept_only()
    elif a_b[0] < 0:
        a, b = slope_only()
        if b <= 0:
            a, b = intercept_only()
    else:
        a, b = a_b
    worst = max(abs(a + b * x - y) / y for x, y in points)
    return {"alpha_us": a * 1e6, "beta_gb_s": (1.0 / b / 1e9) if b > 0 else math.inf,
            "max_rel_err": worst}


def _sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant figures (bandwidths span 1e-4 to 1e2 GB/s)."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def _rounded_fits(points: dict) -> dict:
    out = {}
    for op, pts in points.items():
        f = fit_alpha_beta(pts)
        out[op] = {"alpha_us": round(f["alpha_us"], 2),
                   "beta_gb_s": _sig(f["beta_gb_s"]),
                   "max_rel_err": round(f["max_rel_err"], 3)}
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def measure(world_size: int = 2, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 50,
            warmup: int = 5, threads: Optional[int] = None, timeout: float = 300.0) -> dict:
    """Run the ranks and return {"rows": [...], "fit": {op: {alpha_us, beta_gb_s, ...}}, ...}.

    Each row: op, elements (of the message), bytes, median_us / mean_us / min_us / p90_us (the
    slowest rank's time per call), algbw_gb_s and busbw_gb_s at the median. "fit" is fitted to
    the medians (a typical call); "fit_mean" to the means, which is what a sum of many calls
    (a forward pass's collectives) costs when the distribution has a tail."""
    if world_size < 2:
        raise ValueError("world_size must be at least 2 (a collective needs peers)")
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    sizes = [int(s) for s in sizes]
    if not sizes or min(sizes) < 1:
        raise ValueError("sizes must be positive element counts")
    from tokenmill.platform import usable_cores
    cores = usable_cores()
    threads = threads if threads is not None else max(1, cores // world_size)
    t0 = time.perf_counter()
    per_rank = _gather_times(world_size, sizes, repeats, warmup, threads, timeout)
    wall = time.perf_counter() - t0
    n = world_size
    rows, fit_points, mean_points = [], {op: [] for op in OPS}, {op: [] for op in OPS}
    for op in OPS:
        for size in sizes:
            # a call ends when its slowest rank is done
            calls = [max(r["times"][(op, size)][i] for r in per_rank) for i in range(repeats)]
            med = statistics.median(calls)
            if op == "all_reduce":
                elements, factor = size, 2 * (n - 1) / n
            else:
                elements, factor = max(1, size // n) * n, (n - 1) / n
            nbytes = elements * _BYTES_PER_ELEMENT
            ordered = sorted(calls)
            rows.append({"op": op, "elements": elements, "bytes": nbytes,
                         "median_us": round(med * 1e6, 1),
                         "mean_us": round(statistics.fmean(calls) * 1e6, 1),
                         "min_us": round(ordered[0] * 1e6, 1),
                         "p90_us": round(ordered[min(len(ordered) - 1,
                                                     int(0.9 * len(ordered)))] * 1e6, 1),
                         "algbw_gb_s": _sig(nbytes / med / 1e9),
                         "busbw_gb_s": _sig(nbytes * factor / med / 1e9)})
            fit_points[op].append((nbytes, med))
            mean_points[op].append((nbytes, statistics.fmean(calls)))
    fit, fit_mean = _rounded_fits(fit_points), _rounded_fits(mean_points)
    from tokenmill.bench.common import machine_info
    machine = machine_info()
    machine.update(cpu_model=_cpu_model(), usable_cores=cores)
    return {"bench": "collectives", "backend": "gloo", "world_size": world_size,
            "threads_per_rank": per_rank[0]["threads"], "repeats": repeats, "warmup": warmup,
            "dtype": "float32", "wall_s": round(wall, 2), "fit": fit, "fit_mean": fit_mean,
            "machine": machine,
            "rows": rows}


def format_table(result: dict) -> str:
    lines = [f"gloo collectives, world {result['world_size']}, "
             f"{result['threads_per_rank']} thread(s) per rank, {result['repeats']} calls per size "
             f"({result['machine']['cpu_model']}, {result['machine']['usable_cores']} cores)",
             f"{'op':<11} {'elements':>9} {'bytes':>9} {'median_us':>10} {'mean_us':>9} "
             f"{'min_us':>9} {'p90_us':>9} {'algbw_GB/s':>11} {'busbw_GB/s':>11}"]
    for r in result["rows"]:
        lines.append(f"{r['op']:<11} {r['elements']:>9} {r['bytes']:>9} {r['median_us']:>10.1f} "
                     f"{r['mean_us']:>9.1f} {r['min_us']:>9.1f} {r['p90_us']:>9.1f} "
                     f"{r['algbw_gb_s']:>11.4g} {r['busbw_gb_s']:>11.4g}")
    for label, key in (("median", "fit"), ("mean", "fit_mean")):
        for op, f in result[key].items():
            lines.append(f"fit ({label}) {op}: latency = {f['alpha_us']:.1f} us + bytes / "
                         f"({f['beta_gb_s']:.4g} GB/s)   (worst relative error "
                         f"{f['max_rel_err']:.0%})")
    return "\n".join(lines)


def run(args) -> int:
    from tokenmill.bench.common import emit
    from tokenmill.bench.report import Chart
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    result = measure(world_size=args.world_size, sizes=sizes, repeats=args.repeats,
                     warmup=args.warmup, timeout=args.timeout)
    # the table for people on stderr; stdout stays the JSON, as every bench's
    print(format_table(result), file=sys.stderr)
    emit(result, args.json, args.output_dir,
         chart=Chart("bytes", ("median_us", "busbw_gb_s"), kind="line", series="op",
                     title=f"gloo collectives, world {args.world_size}"))
    return 0
