"""Engine statistics: request counts, token counts, latency, throughput, preemptions."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from tokenmill.request import Request


@dataclass
class EngineStats:
    start_time: float = field(default_factory=time.monotonic)
    num_requests: int = 0                 # finished samples
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    latencies: list = field(default_factory=list)
    ttfts: list = field(default_factory=list)
    tpots: list = field(default_factory=list)
    queue_times: list = field(default_factory=list)
    busy_time: float = 0.0                # seconds spent inside step()

    def on_finished(self, req: Request) -> None:
        self.num_requests += 1
        self.num_prompt_tokens += req.num_prompt_tokens
        end = req.finished_time or time.monotonic()
        self.latencies.append(end - req.arrival_time)
        if req.first_scheduled_time is not None:
            self.queue_times.append(req.first_scheduled_time - req.arrival_time)
        if req.first_token_time is not None:
            self.ttfts.append(req.first_token_time - req.arrival_time)
            if req.num_output_tokens > 1:
                self.tpots.append((end - req.first_token_time) / (req.num_output_tokens - 1))

    def snapshot(self, num_preemptions: int, prefix_hit_rate: float) -> dict:
        def ms(values):
            return 1000.0 * statistics.fmean(values) if values else 0.0
        return {
            "num_requests": self.num_requests,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "num_steps": self.num_steps,
            "avg_latency_ms": ms(self.latencies),
            "avg_ttft_ms": ms(self.ttfts),
            "avg_tpot_ms": ms(self.tpots),
            "avg_queue_time_ms": ms(self.queue_times),
            "throughput_tokens_per_sec": (self.num_generated_tokens / self.busy_time
                                          if self.busy_time else 0.0),
            "num_preemptions": num_preemptions,
            "prefix_cache_hit_rate": prefix_hit_rate,
        }
