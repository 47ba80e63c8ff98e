"""Adaptive k against simulated workloads (no torch, no clock): a step verifying k drafts costs
c(B, k) and emits E[tokens] = sum_{j<=k} alpha^j per request. The controller must pick k = 0
when speculation does not pay (within 5% of no speculation overall) and a k > 0 when it does."""
import pytest

from tokenmill.spec.adaptive import AdaptiveK, bucket_of
from tokenmill.spec.ngram import lookup


def simulate(alpha: float, cost, batch: int, steps: int = 2000, k_max: int = 4) -> tuple[float, dict]:
    """Returns (goodput with the controller / goodput of plain decoding, k histogram)."""
    ctl = AdaptiveK(k_max)
    tokens = seconds = 0.0
    chosen = {}
    for _ in range(steps):
        k = ctl.choose(batch)
        chosen[k] = chosen.get(k, 0) + 1
        emitted = batch * sum(alpha ** j for j in range(k + 1))
        dt = cost(batch, k)
        ctl.record(batch, k, emitted, dt)
        tokens += emitted
        seconds += dt
    plain = batch / cost(batch, 0)
    return (tokens / seconds) / plain, chosen


def memory_bound(batch, k):        # batch 1 decode: verifying k more tokens is almost free
    return 1.0 + 0.05 * k + 0.02 * k        # + drafting


def compute_bound(batch, k):       # batch 16: cost grows with every token scored
    return 1.0 * (1 + k) + 0.02 * k


@pytest.mark.parametrize("alpha,cost,batch,want_spec", [
    (0.8, memory_bound, 1, True),      # good drafts, cheap verify: speculate
    (0.0, memory_bound, 1, False),     # useless drafts: stop
    (0.8, compute_bound, 16, False),   # same acceptance, but batch makes verify expensive
    (0.3, memory_bound, 16, True),
])
def test_adaptive_choice(alpha, cost, batch, want_spec):
    ratio, chosen = simulate(alpha, cost, batch)
    assert ratio >= 0.95, (ratio, chosen)
    best = max(chosen, key=chosen.get)
    assert (best > 0) == want_spec, chosen
    if want_spec:
        assert ratio > 1.2


def test_batch_buckets_are_separate():
    ctl = AdaptiveK(4)
    for _ in range(500):
        for batch, cost in ((1, memory_bound), (16, compute_bound)):
            k = ctl.choose(batch)
            ctl.record(batch, k, batch * sum(0.8 ** j for j in range(k + 1)), cost(batch, k))
    assert ctl._best(bucket_of(1)) > 0 and ctl._best(bucket_of(16)) == 0


def test_ngram_lookup():
    assert lookup([1, 2, 3, 4, 9, 1, 2], 3, 1, 3) == [3, 4, 9]
    assert lookup([1, 2, 3, 4, 9, 1, 2], 1, 1, 3) == [3]
    assert lookup([5, 6, 7], 3, 1, 3) == []
    # the longest matching suffix wins over a more recent shorter one
    assert lookup([7, 1, 2, 8, 5, 2, 9, 1, 2], 2, 1, 2) == [8, 5]
    assert lookup([1, 2, 1, 2, 1], 4, 1, 1) == [2, 1]   # continues after the latest earlier "1"


def test_expensive_useless_drafter_costs_little_even_on_short_runs():
    # layer_skip-like: each draft costs most of a forward, drafts are almost never right
    ratio, chosen = simulate(0.05, lambda b, k: 1.0 + 0.9 * k, 1, steps=300)
    assert ratio >= 0.95, (ratio, chosen)
    assert chosen.get(4, 0) == 0          # k = 4 never tried: k = 1 already lost


def test_a_steps_cost_includes_the_engine_time_until_the_next_step(tiny_llama_dir):
    """The controller and c(B) are charged what a step costs the engine, not just the
    runner's part: time spent between steps (output processing, the next schedule) is added
    to the step before it. A 20 ms pause in every schedule must show in c(B)."""
    import time

    from tokenmill import LLM, SamplingParams
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=64,
              speculative_config=dict(method="ngram", num_speculative_tokens=2,
                                      prompt_lookup_min=1, prompt_lookup_max=2))
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule
    scheduler.schedule = lambda: time.sleep(0.02) or schedule()
    llm.generate([{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5]}], SamplingParams(temperature=0, max_tokens=24),
                 use_tqdm=False)
    seconds = llm.engine.runner.spec.plain_cost.seconds
    assert seconds and min(seconds.values()) > 0.02
    assert all(arm.rate < 1 / 0.02 * 3 for arm in llm.engine.runner.spec.controller.arms.values())
