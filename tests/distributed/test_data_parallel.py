"""DataParallelEngine over two spawned replica processes ("mp") on the tiny random Llama:
the same outputs as one engine, aborts, aggregated stats, prefix-aware routing, a replica
killed mid-request, and no process left behind."""
import asyncio
import os
import random
import signal
import time

import pytest

from tests.distributed.procs import (child_pids, drain, run_to_completion, settle_children,
                                     start_resource_tracker, tiny_config)
from tokenmill.engine.data_parallel import DataParallelEngine, create_engine
from tokenmill.platform import usable_cores
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.distributed


def random_ids(rng, length, vocab=384):
    return [rng.randrange(3, vocab) for _ in range(length)]


@pytest.fixture(scope="module")
def baseline():
    start_resource_tracker()
    return child_pids()


@pytest.fixture(scope="module")
def single(tiny_llama_dir):
    return LLMEngine(tiny_config(tiny_llama_dir))


@pytest.fixture(scope="module")
def dp2(tiny_llama_dir, baseline):
    engine = create_engine(tiny_config(tiny_llama_dir, dp=2, num_threads=None))
    assert isinstance(engine, DataParallelEngine)
    yield engine
    engine.shutdown()
    assert settle_children(baseline) == set()


def per_replica(engine, key):
    return [r[key] for r in engine.get_stats()["replicas"]]


def mixed_requests(seed=0):
    """Greedy (with logprobs), seeded sampling, and n=2 seeded, over varied prompt lengths."""
    rng = random.Random(seed)
    reqs = {}
    for i in range(8):
        ids = random_ids(rng, rng.randint(5, 40))
        if i % 3 == 0:
            params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1)
        elif i % 3 == 1:
            params = SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=12)
        else:
            params = SamplingParams(temperature=1.0, seed=200 + i, n=2, max_tokens=10)
        reqs[f"r{i}"] = (ids, params)
    return reqs


def test_outputs_match_one_engine(dp2, single):
    before = per_replica(dp2, "num_requests")
    reqs = mixed_requests()
    got, want = run_to_completion(dp2, reqs), run_to_completion(single, reqs)
    assert set(got) == set(reqs)
    for request_id in reqs:
        a, b = got[request_id].outputs, want[request_id].outputs
        assert [c.token_ids for c in a] == [c.token_ids for c in b], request_id
        assert [c.finish_reason for c in a] == [c.finish_reason for c in b]
        if b[0].cumulative_logprob is not None:
            assert a[0].cumulative_logprob == pytest.approx(b[0].cumulative_logprob, abs=1e-4)
    after = per_replica(dp2, "num_requests")
    assert all(x > y for x, y in zip(after, before)), "both replicas must have served requests"


def test_replicas_are_separate_processes_with_a_share_of_the_cores(dp2):
    infos = dp2.replica_infos
    assert len({i["pid"] for i in infos} | {os.getpid()}) == 3
    assert [i["num_threads"] for i in infos] == [max(1, usable_cores() // 2)] * 2
    assert dp2.max_model_len == 512 and dp2.tokenizer is None


def test_abort_frees_everything_and_a_reused_id_starts_fresh(dp2, single):
    rng = random.Random(1)
    long_ids, short_ids = random_ids(rng, 20), random_ids(rng, 9)
    dp2.add_request("long", {"prompt_token_ids": long_ids},
                    SamplingParams(max_tokens=400, ignore_eos=True))
    short = SamplingParams(temperature=0.0, max_tokens=8)
    dp2.add_request("short", {"prompt_token_ids": short_ids}, short)
    seen = {}
    while "long" not in seen:
        seen.update({o.request_id: o for o in dp2.step()})
    dp2.abort_request("long")
    # same id again at once, same prompt (so the prefix router picks the same replica)
    again = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    dp2.add_request("long", {"prompt_token_ids": long_ids}, again)
    got = {**{k: o for k, o in seen.items() if o.finished and k == "short"}, **drain(dp2)}
    want = run_to_completion(single, {"long": (long_ids, again),
                                      "short": (short_ids, short)})
    assert got["long"].outputs[0].token_ids == want["long"].outputs[0].token_ids
    assert got["short"].outputs[0].token_ids == want["short"].outputs[0].token_ids
    assert not dp2.has_unfinished_requests()
    mem = dp2.get_memory_stats()
    assert mem["num_total_blocks"] == 2 * 64 == sum(m["num_total_blocks"] for m in mem["replicas"])
    assert mem["num_free_blocks"] == mem["num_total_blocks"] and mem["kv_cache_usage"] == 0.0


def test_stats_add_up_over_replicas(dp2):
    before = dp2.get_stats()
    rng = random.Random(2)
    run_to_completion(dp2, {f"s{i}": (random_ids(rng, 12), SamplingParams(max_tokens=4, ignore_eos=True))
                            for i in range(4)})
    stats = dp2.get_stats()
    assert stats["data_parallel_size"] == 2 and len(stats["replicas"]) == 2
    assert stats["num_requests"] - before["num_requests"] == 4
    for key in ("num_requests", "num_generated_tokens", "prefix_cache_queries"):
        assert stats[key] == sum(r[key] for r in stats["replicas"])
    gained = [a["num_requests"] - b["num_requests"]
              for a, b in zip(stats["replicas"], before["replicas"])]
    assert gained == [2, 2]            # no shared prefix: least loaded alternates


def test_shared_prefix_requests_go_to_one_replica(dp2):
    rng = random.Random(3)
    system = random_ids(rng, 48)                       # three full blocks
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    before = dp2.get_stats()["replicas"]
    # A, then an unrelated U (least loaded: the other replica), then B and C behind A's prefix
    run_to_completion(dp2, {"A": (system + random_ids(rng, 5), params),
                            "U": (random_ids(rng, 53), params),
                            "B": (system + random_ids(rng, 7), params),
                            "C": (system + random_ids(rng, 9), params)})
    mid = dp2.get_stats()["replicas"]
    gained = [a["num_requests"] - b["num_requests"] for a, b in zip(mid, before)]
    assert sorted(gained) == [1, 3]                    # round robin / least loaded: 2 and 2
    owner = gained.index(3)
    run_to_completion(dp2, {"D": (system + random_ids(rng, 6), params)})
    after = dp2.get_stats()["replicas"]
    assert after[owner]["num_requests"] == mid[owner]["num_requests"] + 1
    assert after[owner]["prefix_cache_hits"] - mid[owner]["prefix_cache_hits"] >= 48


def test_bad_input_raises_and_queues_nothing(dp2):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dp2.add_request("bad", {"prompt_token_ids": [1, 2, 10_000]}, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        dp2.add_request("bad", {"prompt_token_ids": []}, SamplingParams())
    with pytest.raises(ValueError, match="cache_salt"):
        dp2.add_request("bad", [5, 6], SamplingParams(), cache_salt=3)
    dp2.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        dp2.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=2))
    assert set(drain(dp2)) == {"dup"}
    with pytest.raises(RuntimeError, match="idle"):
        dp2.add_request("busy", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
        dp2.warmup()
    dp2.abort_request("busy")
    assert not dp2.has_unfinished_requests()


def test_step_returns_at_once_when_idle(dp2):
    t = time.monotonic()
    assert dp2.step() == []
    assert time.monotonic() - t < 0.01


def test_killed_replica_fails_its_requests_and_nothing_hangs(tiny_llama_dir, baseline):
    before = child_pids()
    engine = DataParallelEngine(tiny_config(tiny_llama_dir, dp=2, router="round_robin"))
    try:
        rng = random.Random(4)
        params = SamplingParams(max_tokens=450, ignore_eos=True)
        for i in range(4):                               # round robin: 0, 1, 0, 1
            engine.add_request(f"k{i}", {"prompt_token_ids": random_ids(rng, 20)}, params)
        seen = set()
        while len(seen) < 4:
            seen |= {o.request_id for o in engine.step()}
        os.kill(engine.replica_infos[1]["pid"], signal.SIGKILL)
        finished = drain(engine, timeout=60)
        assert set(finished) == {"k0", "k1", "k2", "k3"}
        for request_id in ("k1", "k3"):
            completion = finished[request_id].outputs[0]
            assert completion.finish_reason == "error" and "replica 1" in completion.error
        for request_id in ("k0", "k2"):
            assert finished[request_id].outputs[0].finish_reason == "length"
            assert len(finished[request_id].outputs[0].token_ids) == 450
        assert not engine.healthy and "exited unexpectedly" in engine.dead_error
        with pytest.raises(RuntimeError, match="replica 1"):
            engine.add_request("late", [5, 6, 7], SamplingParams())
        stats = engine.get_stats()                       # the live replica still answers
        assert len(stats["replicas"]) == 1 and stats["num_requests"] == 2
    finally:
        engine.shutdown()
    assert settle_children(before) == set()


def test_async_engine_serves_a_data_parallel_engine(tiny_llama_dir, baseline):
    """The server's engine thread: outputs, /metrics snapshots, the dashboard view, and a
    replica death turning into failed requests plus an unhealthy engine."""
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.entrypoints import web
    before = child_pids()
    snapshots = []
    engine = AsyncEngine(lambda: DataParallelEngine(tiny_config(tiny_llama_dir, dp=2)))
    engine.stats_listeners.append(snapshots.append)
    engine.start()
    try:
        assert engine.ready.wait(120) and engine.load_error is None, engine.load_error

        async def generate(request_id, max_tokens):
            out = None
            async for out in engine.generate(request_id, [5, 6, 7, 8], SamplingParams(
                    max_tokens=max_tokens, ignore_eos=True)):
                pass
            return out
        out = asyncio.run(generate("a", 6))
        assert out.finished and len(out.outputs[0].token_ids) == 6
        deadline = time.monotonic() + 10     # published right after the output is delivered
        while not (snapshots and snapshots[-1].num_generation_tokens >= 6):
            assert time.monotonic() < deadline, snapshots[-1:]
            time.sleep(0.01)
        view = engine.call(web.engine_view).result(10)
        assert view["num_replicas"] == 2 and view["kv"]["num_blocks"] == 128
        assert len(view["kv"]["map"]) == 128
        pids = engine.call(lambda e: [i["pid"] for i in e.replica_infos]).result(10)

        async def killed():
            handle = await engine.add("b", [9, 10, 11], SamplingParams(max_tokens=450, ignore_eos=True))
            try:
                async for _ in handle:
                    for pid in pids:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:   # killed at an earlier output, which
                            pass                     # raced the engine seeing the death
            finally:
                handle.close()
        with pytest.raises(RuntimeError, match="replica"):
            asyncio.run(killed())
        deadline = time.monotonic() + 10
        while engine.healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.healthy and "replica" in engine.dead_error
    finally:
        engine.stop()
    assert settle_children(before) == set()
