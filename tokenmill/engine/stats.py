"""Engine statistics: request counts, token counts, latency, throughput, preemptions, and the
memory figures behind ``get_memory_stats()``.

Averages come from running sums (exact over the engine's life); the per-request samples are
kept in bounded windows, so a long-running server's memory stays flat."""
from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from tokenmill.request import Request

WINDOW = 10_000   # recent per-request samples kept for percentiles / benchmarks


class Series:
    """A running mean plus a bounded window of the most recent values."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.recent: deque = deque(maxlen=WINDOW)

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.recent.append(value)

    def mean_ms(self) -> float:
        return 1000.0 * self.total / self.count if self.count else 0.0

    def since(self, seen: int) -> list[float]:
        """Values added after the first ``seen`` (as many as the window still holds)."""
        new = min(self.count - seen, len(self.recent))
        return list(self.recent)[len(self.recent) - new:] if new > 0 else []

    def __getitem__(self, index):
        return list(self.recent)[index]

    def __len__(self) -> int:
        return self.count


@dataclass
class EngineStats:
    start_time: float = field(default_factory=time.monotonic)
    num_requests: int = 0                 # finished samples
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    latencies: Series = field(default_factory=Series)
    ttfts: Series = field(default_factory=Series)
    tpots: Series = field(default_factory=Series)
    queue_times: Series = field(default_factory=Series)
    busy_time: float = 0.0                # seconds spent inside step()
    num_failed_steps: int = 0             # steps whose execution raised (requests isolated)

    def on_finished(self, req: Request) -> None:
        self.num_requests += 1
        self.num_prompt_tokens += req.num_prompt_tokens
        end = req.finished_time or time.monotonic()
        self.latencies.add(end - req.arrival_time)
        if req.first_scheduled_time is not None:
            self.queue_times.add(req.first_scheduled_time - req.arrival_time)
        if req.first_token_time is not None:
            self.ttfts.add(req.first_token_time - req.arrival_time)
            if req.num_output_tokens > 1:
                self.tpots.add((end - req.first_token_time) / (req.num_output_tokens - 1))

    def snapshot(self, num_preemptions: int, prefix_hit_rate: float) -> dict:
        """Terms: ``num_requests`` counts finished (or aborted) sequences, one per sample of a
        request with ``n > 1``; ``num_generated_tokens`` counts every token sampled so far,
        unfinished requests included; ``avg_latency_ms`` is the mean end-to-end latency
        (arrival to finish) of the finished ones; ``throughput_tokens_per_sec`` is generated
        tokens per second of engine busy time (time spent inside ``step()``, so idle gaps
        between calls do not dilute it). Averages are exact over the engine's life."""
        return {
            "num_requests": self.num_requests,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "num_steps": self.num_steps,
            "avg_latency_ms": self.latencies.mean_ms(),
            "avg_ttft_ms": self.ttfts.mean_ms(),
            "avg_tpot_ms": self.tpots.mean_ms(),
            "avg_queue_time_ms": self.queue_times.mean_ms(),
            "throughput_tokens_per_sec": (self.num_generated_tokens / self.busy_time
                                          if self.busy_time else 0.0),
            "num_preemptions": num_preemptions,
            "num_failed_steps": self.num_failed_steps,
            "prefix_cache_hit_rate": prefix_hit_rate,
        }


def module_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers, each shared tensor (a tied head) once."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def decode_read_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one batch-1 decode step streams, the numerator of a decode floor: each
    matmul's values as its kernel reads them (a packed weight's tiled copy where it has one,
    a bf16-mode layer's tiles, else its parameters), norms and biases. Left out: what a step
    reads one row of (an embedding table no matmul shares, RoPE tables) and the row-major
    scales a packed weight keeps beside the tiles that hold them again. Every expert of an
    MoE layer counts (at batch 1 a step reads only its routed ones: an upper bound)."""
    from tokenmill.layers import prepacked
    from tokenmill.layers.rotary import RotaryEmbedding
    def key(t: torch.Tensor) -> tuple:   # a parameter and the tensor it wraps are one
        return t.data_ptr(), t.numel(), t.dtype

    tiles: dict[int, int] = {}     # id(tiled copy) -> bytes (a packed embedding shares its head's)
    replaced: set[tuple] = set()   # tensors whose values the step reads from tiles instead
    read: dict[tuple, torch.Tensor] = {}
    for module in model.modules():
        parts = getattr(module, "packed", None)
        for part in parts if isinstance(parts, list) else ():
            if part.tiled is not None:
                tiles[id(part.tiled)] = part.tiled.nbytes()
                replaced.update(key(t) for t in (part.qweight, part.scales, part.mins) if t is not None)
        bf16 = prepacked.bf16_tiles(module)
        if bf16 is not None:
            tiles[id(bf16)] = bf16.nbytes
            if getattr(module, "weight", None) is not None:
                replaced.add(key(module.weight))
        if isinstance(module, (torch.nn.Embedding, RotaryEmbedding)):
            continue   # one row a step (a tied head holds the same table: counted through it)
        for t in (*module._parameters.values(), *module._buffers.values()):
            if t is not None:
                read[key(t)] = t
    return sum(t.numel() * t.element_size() for k, t in read.items() if k not in replaced) \
        + sum(tiles.values())


def free_memory_bytes(device: torch.device) -> int:
    """Free memory where the model runs: CUDA's free device memory, else the system's
    available memory (``MemAvailable``: free plus reclaimable page cache); 0 when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024   # the file says kB
    except OSError:   # not Linux
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):   # a platform without these names (macOS)
        return 0
