"""Shared benchmark plumbing: machine facts printed beside every number, medians, random
prompts, and the physical floor (bandwidth and GEMM rate measured in the same run)."""
from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from typing import Callable, Optional, Sequence

import torch

from tokenmill.bench.report import Chart, write_report


def machine_info() -> dict:
    """Load, threads and versions; ``peak_rss_mb``: this process's peak resident memory so
    far (taken at the end of a bench, the peak of everything it ran in-process);
    ``huge_pages``: whether 2 MB pages were available to the engine's weights and KV cache."""
    from tokenmill.utils.hugepages import supported
    load1, load5, _ = os.getloadavg()
    return {"load_avg_1m": round(load1, 2), "load_avg_5m": round(load5, 2),
            "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "peak_rss_mb": peak_rss_mb(), "huge_pages": supported()}


def peak_rss_mb() -> float:
    import resource
    # ru_maxrss is in KiB on Linux (bytes on macOS, where the figure reads 1024x too high)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def median_of(fn: Callable[[], float], repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
    for _ in range(warmup):
        fn()
    values = [fn() for _ in range(repeats)]
    return statistics.median(values), values


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int = 0) -> list[dict]:
    """Token-id prompts of a fixed length, away from the special ids at the start of the
    vocabulary, so every engine sees exactly the same tokens."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab_size) for _ in range(input_len)]}
            for _ in range(num)]


def measure_bandwidth_gbps(num_bytes: int = 256 * 1024**2, repeats: int = 5,
                           device: torch.device = torch.device("cpu")) -> float:
    """Memory bandwidth from a large copy: bytes read + bytes written per second (of the
    GPU's memory for a CUDA ``device``, timed between synchronizations)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def once() -> float:
        sync()
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        return 2 * num_bytes / (time.perf_counter() - t) / 1e9
    return median_of(once, repeats)[0]


def measure_read_bandwidth_gbps(num_bytes: int = 256 * 1024**2, repeats: int = 9) -> float:
    """CPU memory read bandwidth, what a decode step's weight and KV reads are bound by: the
    fastest of ``repeats`` sums over a buffer far larger than the caches (slower runs are
    other work on the box; this memory's speed also drifts between runs, so floors should
    take the faster of a measurement before and one after). The buffer sits on 2 MB pages
    where the system has them: through 4 KB pages the same sum read ~20 % slower on a VM
    (utils/hugepages.py), and the engine reads its weights and KV cache through huge pages."""
    from tokenmill.utils.hugepages import anonymous_map
    pages = anonymous_map(num_bytes, huge=True)
    src = torch.frombuffer(pages, dtype=torch.float32, count=num_bytes // 4)
    src.fill_(1.0)

    def once() -> float:
        t = time.perf_counter()
        src.sum()
        return num_bytes / (time.perf_counter() - t) / 1e9
    return max(once() for _ in range(repeats))


def measure_gemm_gflops(n: int = 1024, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)

    def once() -> float:
        t = time.perf_counter()
        torch.mm(a, b)
        return 2 * n**3 / (time.perf_counter() - t) / 1e9
    return median_of(once, repeats)[0]


def emit(result: dict, json_path: Optional[str], output_dir: Optional[str] = None,
         rows: Optional[Sequence[dict]] = None, chart: Optional[Chart] = None,
         name: Optional[str] = None) -> None:
    """Print the result as JSON (stdout), write it to ``json_path`` if given, and write the
    JSON / markdown / PNG report to ``output_dir`` if given (rows default to result["rows"])."""
    print(json.dumps(result, indent=2))
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    if output_dir:
        if rows is None:
            rows = result.get("rows") if isinstance(result.get("rows"), list) else [result]
        paths = write_report(name or str(result.get("bench", "bench")), result, output_dir,
                             rows, chart)
        print("wrote " + ", ".join(paths.values()), file=sys.stderr)
