"""What the server (/metrics) and the dashboard read from an engine, and how the figures of
data-parallel replicas add up.

The free functions take an LLMEngine and read its scheduler, stats and speculative decoder;
``DataParallelEngine`` offers the same results as methods (``snapshot_counters``,
``dashboard_view``, ``request_spec_stats``), built from its replicas' own readings with the
``merge_*`` functions here. Callers run them in the thread that owns the engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tokenmill.distributed import serial
from tokenmill.structured.stats import merge_counters as merge_structured
from tokenmill.utils.moe_stats import merge_expert_loads


@serial.register
@dataclass
class EngineSnapshot:
    """Engine state read in the engine thread after each step (for /metrics)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0          # fraction of KV blocks in use, 0..1
    num_preemptions: int = 0             # cumulative
    num_failed_steps: int = 0            # cumulative: steps whose execution raised
    num_prompt_tokens: int = 0           # cumulative, of finished requests
    num_generation_tokens: int = 0       # cumulative
    prefix_cache_queries: int = 0        # cumulative prompt tokens looked up
    prefix_cache_hits: int = 0
    new_queue_times: tuple = ()          # seconds, requests finished since the last snapshot
    spec_decode: Optional[dict] = None   # cumulative speculative counters (None: no speculation)
    new_spec_requests: tuple = ()        # RequestSpecStats of requests finished since the last one
    expert_load: Optional[dict] = None   # cumulative MoE routing counts (None: a dense model)
    structured_outputs: Optional[dict] = None   # cumulative (LLMEngine.structured_output_counters)


@dataclass
class SnapshotCursor:
    """How many per-request samples earlier snapshots already handed out."""

    num_queue_times_seen: int = 0
    num_spec_seen: int = 0


def snapshot_counters(engine, cursor: SnapshotCursor) -> EngineSnapshot:
    """``engine``'s counters now, with the queue times / speculative requests finished since
    ``cursor`` (which advances)."""
    sched, stats = engine.scheduler, engine.stats
    new_queue_times = tuple(stats.queue_times.since(cursor.num_queue_times_seen))
    cursor.num_queue_times_seen = stats.queue_times.count
    spec, spec_counters, new_spec = engine.spec_decoder, None, ()
    if spec is not None:
        spec_counters = spec.stats.counters()
        new_spec = tuple(spec.stats.finished_since(cursor.num_spec_seen))
        cursor.num_spec_seen = spec.stats.num_finished
    return EngineSnapshot(
        num_running=len(sched.running), num_waiting=len(sched.waiting),
        kv_cache_usage=sched.kv.usage, num_preemptions=sched.num_preemptions,
        num_failed_steps=stats.num_failed_steps,
        num_prompt_tokens=stats.num_prompt_tokens,
        num_generation_tokens=stats.num_generated_tokens,
        prefix_cache_queries=sched.kv.prefix_stats.num_queries,
        prefix_cache_hits=sched.kv.prefix_stats.num_hits,
        new_queue_times=new_queue_times, spec_decode=spec_counters,
        new_spec_requests=new_spec,
        # at most a second old: with worker ranks each reading is a round trip
        expert_load=engine.expert_load(max_age_s=1.0),
        structured_outputs=engine.structured_output_counters())


def merge_snapshots(snapshots: list[EngineSnapshot]) -> EngineSnapshot:
    """One snapshot for several replicas: counts add up; KV usage is the mean (replicas are
    built from one config, so their pools are alike)."""
    if not snapshots:
        return EngineSnapshot()
    total = EngineSnapshot(kv_cache_usage=sum(s.kv_cache_usage for s in snapshots) / len(snapshots))
    for name in ("num_running", "num_waiting", "num_preemptions", "num_failed_steps", "num_prompt_tokens",
                 "num_generation_tokens", "prefix_cache_queries", "prefix_cache_hits"):
        setattr(total, name, sum(getattr(s, name) for s in snapshots))
    total.new_queue_times = tuple(q for s in snapshots for q in s.new_queue_times)
    total.new_spec_requests = tuple(r for s in snapshots for r in s.new_spec_requests)
    total.spec_decode = merge_spec_counters([s.spec_decode for s in snapshots if s.spec_decode])
    total.expert_load = merge_expert_loads([s.expert_load for s in snapshots if s.expert_load])
    total.structured_outputs = merge_structured([s.structured_outputs for s in snapshots
                                                 if s.structured_outputs])
    return total


def merge_spec_counters(counters: list[dict]) -> Optional[dict]:
    """Speculative counters of several replicas (spec.metrics names): sums, with the rates
    recomputed from the sums and the speedup weighted by verify steps."""
    if not counters:
        return None
    sums = {key: sum(c[key] for c in counters)
            for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                        "num_verify_steps", "draft_time_s", "verify_time_s")}
    width = max(len(c["num_accepted_tokens_per_pos"]) for c in counters)
    per_pos = [sum(c["num_accepted_tokens_per_pos"][j] for c in counters
                   if j < len(c["num_accepted_tokens_per_pos"])) for j in range(width)]
    steps = sums["num_verify_steps"]
    return {**sums, "num_accepted_tokens_per_pos": per_pos,
            "acceptance_rate": (sums["num_accepted_tokens"] / sums["num_draft_tokens"]
                                if sums["num_draft_tokens"] else 0.0),
            "mean_acceptance_length": (1.0 + sums["num_accepted_tokens"] / sums["num_drafts"]
                                       if sums["num_drafts"] else 0.0),
            "estimated_speedup": (sum(c["estimated_speedup"] * c["num_verify_steps"]
                                      for c in counters) / steps if steps else 0.0)}


def dashboard_view(engine) -> dict:
    """The engine's state for the dashboard: queue lengths, cumulative token counts,
    prefix-cache and KV figures with a per-block map ("u" used, "c" cached, "f" free),
    speculative acceptance per draft position."""
    sched, kv = engine.scheduler, engine.scheduler.kv
    blocks = kv.pool.blocks
    cells = "".join("u" if b.ref_cnt > 0 else "c" if b.block_hash is not None else "f" for b in blocks)
    stats = engine.stats
    view = {
        "num_running": len(sched.running), "num_waiting": len(sched.waiting),
        "prompt_tokens_total": stats.num_prompt_tokens,
        "generation_tokens_total": stats.num_generated_tokens,
        "num_preemptions": sched.num_preemptions,
        "prefix_cache_hit_rate": kv.prefix_stats.hit_rate,
        "prefix_cache_queries": kv.prefix_stats.num_queries,
        "prefix_cache_hits": kv.prefix_stats.num_hits,
        "kv": {"num_blocks": len(blocks), "block_size": kv.block_size,
               "num_used": cells.count("u"), "num_cached": cells.count("c"),
               "num_free": cells.count("f"), "usage": kv.usage, "map": cells},
        "spec": None,
    }
    spec = engine.spec_decoder
    if spec is not None:
        view["spec"] = _spec_view(spec.config.method, spec.k_max, spec.stats.counters())
    return view


def _spec_view(method: str, k_max: int, c: dict) -> dict:
    drafts = c["num_drafts"]
    return {"method": method, "num_speculative_tokens": k_max,
            "acceptance_rate": c["acceptance_rate"],
            "mean_acceptance_length": c["mean_acceptance_length"], "num_drafts": drafts,
            "accepted_per_position": [n / drafts if drafts else 0.0
                                      for n in c["num_accepted_tokens_per_pos"]],
            "counters": c}


def merge_dashboard_views(views: list[dict]) -> dict:
    """One dashboard view for several replicas: counts add up, the block maps are joined
    replica after replica (so the map shows every pool), rates come from the sums."""
    if not views:
        raise ValueError("no replica views to merge")
    total = {key: sum(v[key] for v in views)
             for key in ("num_running", "num_waiting", "prompt_tokens_total",
                         "generation_tokens_total", "num_preemptions", "prefix_cache_queries",
                         "prefix_cache_hits")}
    total["prefix_cache_hit_rate"] = (total["prefix_cache_hits"] / total["prefix_cache_queries"]
                                      if total["prefix_cache_queries"] else 0.0)
    kvs = [v["kv"] for v in views]
    kv = {key: sum(k[key] for k in kvs) for key in ("num_blocks", "num_used", "num_cached", "num_free")}
    kv.update(block_size=kvs[0]["block_size"], map="".join(k["map"] for k in kvs),
              usage=kv["num_used"] / kv["num_blocks"] if kv["num_blocks"] else 0.0)
    total["kv"] = kv
    specs = [v["spec"] for v in views if v.get("spec")]
    total["spec"] = None
    if specs:
        merged = merge_spec_counters([s["counters"] for s in specs])
        total["spec"] = _spec_view(specs[0]["method"], specs[0]["num_speculative_tokens"], merged)
    total["num_replicas"] = len(views)
    return total


def request_spec_stats(engine, request_id: str) -> Optional[dict]:
    """A recent or running request's speculative counters; None when the engine does not
    speculate or no longer remembers the request."""
    spec = engine.spec_decoder
    if spec is None:
        return None
    for r in spec.stats.requests():
        if r["request_id"] == request_id:
            return r
    return None


def _register_wire_types() -> None:
    from tokenmill.spec.metrics import RequestSpecStats
    serial.register(RequestSpecStats)


_register_wire_types()
