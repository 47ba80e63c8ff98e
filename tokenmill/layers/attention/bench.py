"""Micro-benchmark: reference vs CPU attention backend on SmolLM2-135M attention shapes.

Not a test: prints medians and the reference/cpu time ratio (> 1 means the CPU path is
faster). Run with ``python -m tokenmill.layers.attention.bench``.
"""

from __future__ import annotations

import math
import random
import statistics
import time

import torch

from tokenmill.layers.attention.base import AttentionBackend, get_attention_backend
from tokenmill.layers.attention.metadata import AttentionMetadata

# SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64; engine default block size 16.
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def _make_inputs(runs: list[tuple[int, int]], seed: int = 0) -> tuple:
    """Random query/K/V and a cache with scrambled block tables for (query_len, seq_len) runs."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(s / BLOCK_SIZE) for _, s in runs]
    num_blocks = sum(needed) + 8
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in needed]
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    meta = AttentionMetadata.build([q for q, _ in runs], [s for _, s in runs], tables,
                                   BLOCK_SIZE, "cpu")
    t = meta.num_tokens
    query = torch.randn(t, NUM_HEADS, HEAD_DIM, generator=gen)
    key = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    value = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    return query, key, value, k_cache, v_cache, meta


def _time_ms(backend: AttentionBackend, inputs: tuple) -> float:
    start = time.perf_counter()
    backend.forward(*inputs, HEAD_DIM ** -0.5)
    return (time.perf_counter() - start) * 1e3


def _race(ref: AttentionBackend, cpu: AttentionBackend, inputs: tuple,
          repeats: int, warmup: int) -> tuple[float, float]:
    """Median ms of each backend. Runs alternate so that load from other processes on a
    shared machine hits both sides alike instead of skewing one of them."""
    ref_ms, cpu_ms = [], []
    with torch.inference_mode():
        for i in range(warmup + repeats):
            r, c = _time_ms(ref, inputs), _time_ms(cpu, inputs)
            if i >= warmup:
                ref_ms.append(r)
                cpu_ms.append(c)
    return statistics.median(ref_ms), statistics.median(cpu_ms)


def _cases() -> dict[str, list[tuple[int, int]]]:
    rng = random.Random(1)
    decode = [(1, rng.randint(200, 500)) for _ in range(32)]
    return {
        "decode x32 (ctx 200-500)": decode,
        "prefill 512 (fresh)": [(512, 512)],
        "prefill chunk 256 after 768": [(256, 1024)],
        "mixed: chunk 256 + decode x32": [(256, 256)] + decode,
    }


def run_attention_bench(repeats: int = 9, warmup: int = 2) -> dict[str, float]:
    """Print and return the reference/cpu median-time ratio per case."""
    ref, cpu = get_attention_backend("reference"), get_attention_backend("cpu")
    ratios = {}
    print(f"threads={torch.get_num_threads()}  heads={NUM_HEADS}/{NUM_KV_HEADS} "
          f"head_dim={HEAD_DIM} block_size={BLOCK_SIZE}  median of {repeats}")
    for name, runs in _cases().items():
        inputs = _make_inputs(runs)
        ref_ms, cpu_ms = _race(ref, cpu, inputs, repeats, warmup)
        ratios[name] = ref_ms / cpu_ms
        print(f"{name:32s} reference {ref_ms:8.2f} ms   cpu {cpu_ms:8.2f} ms   "
              f"ratio {ratios[name]:5.2f}x")
    return ratios


if __name__ == "__main__":
    run_attention_bench()
