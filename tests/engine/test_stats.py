from tokenmill.engine.stats import WINDOW, EngineStats, Series
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams


def test_series_mean_is_exact_and_window_bounded():
    s = Series()
    for i in range(WINDOW + 500):
        s.add(float(i))
    assert s.count == WINDOW + 500 and len(s.recent) == WINDOW
    assert abs(s.mean_ms() - 1000.0 * (WINDOW + 499) / 2) < 1e-6
    assert s.since(WINDOW + 498) == [float(WINDOW + 498), float(WINDOW + 499)]
    assert s.since(s.count) == []


def test_on_finished_records_latency_ttft_tpot():
    stats = EngineStats()
    r = Request("a", [1, 2, 3], SamplingParams(), max_tokens=4, arrival_time=10.0)
    r.first_scheduled_time, r.first_token_time, r.finished_time = 10.5, 11.0, 14.0
    r.output_token_ids = [5, 6, 7, 8]
    stats.on_finished(r)
    snap = stats.snapshot(num_preemptions=2, prefix_hit_rate=0.5)
    assert snap["avg_latency_ms"] == 4000.0 and snap["avg_ttft_ms"] == 1000.0
    assert snap["avg_tpot_ms"] == 1000.0 and snap["avg_queue_time_ms"] == 500.0
    assert snap["num_preemptions"] == 2 and snap["num_requests"] == 1
