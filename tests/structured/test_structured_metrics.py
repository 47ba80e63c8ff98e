"""tokenmill:structured_* / grammar_* on /metrics: the engine's constrained-decoding counters
reach Prometheus as deltas between snapshots, and data-parallel replicas' counts add up."""
from tokenmill import SamplingParams
from tokenmill.engine.snapshot import EngineSnapshot, SnapshotCursor, merge_snapshots, snapshot_counters
from tokenmill.entrypoints.openai.metrics import ServerMetrics


def series(text: str, name: str) -> dict:
    """{labels: value} of one metric in Prometheus text."""
    return {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(name + "{")}


def counts(requests=None, forced=0, accepted=0, compiled=0):
    return {"num_requests": requests or {}, "num_failed_requests": 0,
            "num_forced_draft_tokens": forced, "num_forced_accepted_tokens": accepted,
            "num_compiled": compiled, "num_cache_hits": 0, "compile_seconds": 0.01 * compiled}


def test_counters_advance_by_deltas():
    metrics = ServerMetrics("m")
    metrics.on_engine_snapshot(EngineSnapshot(structured_outputs=counts({"json": 2}, 5, 4, 1)))
    metrics.on_engine_snapshot(EngineSnapshot(structured_outputs=counts({"json": 3, "regex": 1},
                                                                        9, 7, 2)))
    text = metrics.render().decode()
    assert series(text, "tokenmill:structured_requests_total") == {
        'kind="json",model_name="m"': 3.0, 'kind="regex",model_name="m"': 1.0}
    assert series(text, "tokenmill:structured_forced_draft_tokens_total") == {'model_name="m"': 9.0}
    assert series(text, "tokenmill:structured_forced_accepted_tokens_total") == {'model_name="m"': 7.0}
    assert series(text, "tokenmill:grammar_compiles_total") == {'model_name="m"': 2.0}


def test_replicas_add_up():
    merged = merge_snapshots([EngineSnapshot(structured_outputs=counts({"json": 2}, 3, 3, 1)),
                              EngineSnapshot(structured_outputs=counts({"choice": 1}, 1, 0, 1)),
                              EngineSnapshot()])
    assert merged.structured_outputs == counts({"choice": 1, "json": 2}, 4, 3, 2)


def test_engine_snapshots_reach_the_metrics(tiny_llm):
    metrics, cursor = ServerMetrics("tiny"), SnapshotCursor()
    engine = tiny_llm.llm_engine
    metrics.on_engine_snapshot(snapshot_counters(engine, cursor))
    before = series(metrics.render().decode(), "tokenmill:structured_requests_total")
    tiny_llm.generate(["a", "b"], SamplingParams(max_tokens=20, structured_outputs={"choice": ["x y z"]}),
                      use_tqdm=False)
    metrics.on_engine_snapshot(snapshot_counters(engine, cursor))
    after = series(metrics.render().decode(), "tokenmill:structured_requests_total")
    key = 'kind="choice",model_name="tiny"'
    assert after[key] - before.get(key, 0.0) == 2.0
