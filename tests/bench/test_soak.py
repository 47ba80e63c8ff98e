"""`tokenmill bench soak`: the 60-second version against a real server (tiny random model),
and the ledger's checks shown to fire on crafted violations."""
import json

import pytest

from tests.entrypoints.openai.conftest import smollm2_path  # noqa: F401 (fixture)
from tokenmill.bench.soak import parse_duration
from tokenmill.bench.soak_client import Outcome, RequestPlan, SoakRequest, check_choices
from tokenmill.bench.soak_ledger import Ledger, parse_metrics, rss_slope_mb_per_1000
from tokenmill.entrypoints.cli import main


@pytest.fixture(scope="module")
def soak_model_dir(tmp_path_factory, smollm2_path):
    """A tiny random Llama with SmolLM2's tokenizer and chat template, 512 positions."""
    from tests.conftest import save_tiny_chat_llama
    from tokenmill.models.loader import load_tokenizer
    path = tmp_path_factory.mktemp("soak_llama")
    return save_tiny_chat_llama(path, load_tokenizer(smollm2_path), max_position_embeddings=512)


@pytest.mark.slow   # 60 s of load by design
def test_sixty_second_soak_has_no_violations(soak_model_dir, tmp_path):
    """16 blocks of 16 tokens hold one long request (~170 tokens) but not two: preemption
    is certain. In 60 s RSS is still warming up (oneDNN's primitive cache fills, one
    kernel per new GEMM shape), so the slope bound here only catches a gross leak (1 MB a
    request); the 10-minute soak measures the real slope."""
    out = tmp_path / "soak.json"
    status = main(["bench", "soak", "--model", soak_model_dir, "--duration", "60s",
                   "--request-rate", "5", "--num-kv-blocks", "16", "--num-threads", "1",
                   "--max-rss-slope-mb", "1000",
                   "--json", str(out), "--output-dir", "", "--no-progress"])
    result = json.loads(out.read_text())
    assert status == 0 and result["num_violations"] == 0, result["violations"]
    kinds = result["requests_by_outcome"]
    assert kinds["completed"] >= 100 and kinds.get("aborted", 0) >= 10, kinds
    assert result["preemptions"] > 0 and result["twins_compared"] >= 10
    assert result["server_exit_status"] == 0


def _outcome(index, kind="completed", texts=None, reasons=None, n=1):
    texts = texts if texts is not None else {k: "x" for k in range(n)}
    reasons = reasons if reasons is not None else {k: "length" for k in range(n)}
    return Outcome(index, kind, 200, texts, reasons, n)


def _req(index, twin_of=None, stream=False, **body):
    return SoakRequest(index, "completions", stream, {"n": 1, **body}, twin_of=twin_of)


def test_ledger_catches_twins_that_differ_and_double_endings():
    ledger = Ledger()
    ledger.record(_req(0), _outcome(0, texts={0: "abc"}))
    ledger.record(_req(1, twin_of=0, stream=True), _outcome(1, texts={0: "abd"}))
    ledger.record(_req(2), _outcome(2))
    ledger.record(_req(3, twin_of=2, stream=True), _outcome(3, kind="aborted"))  # not compared
    assert ledger.check_twins() == 1
    assert len(ledger.violations) == 1 and "differ" in ledger.violations[0]
    ledger.record(_req(2), _outcome(2))
    assert "ended twice" in ledger.violations[-1]


def _metrics(stop=0, length=0, abort=0, error=0, e400=0, running=0):
    lines = [f'tokenmill:request_success_total{{finished_reason="{r}",model_name="m"}} {v}'
             for r, v in (("stop", stop), ("length", length), ("abort", abort), ("error", error))]
    lines += [f'tokenmill:request_errors_total{{model_name="m",status="400"}} {e400}',
              f'tokenmill:num_requests_running{{model_name="m"}} {running}',
              "# HELP a comment line", 'tokenmill:kv_cache_usage_perc{model_name="m"} 0.0']
    return parse_metrics("\n".join(lines))


def test_ledger_counters_match_and_mismatch():
    ledger = Ledger()
    ledger.record(_req(0), _outcome(0, reasons={0: "stop"}))
    ledger.record(_req(1), _outcome(1, n=2, reasons={0: "length", 1: "stop"}))
    ledger.record(_req(2, n=2), _outcome(2, kind="aborted", n=2))
    ledger.record(_req(3), _outcome(3, kind="bad_input"))
    before = _metrics()
    # one aborted sample finished in the server before it saw the hang-up: allowed
    ledger.check_counters(before, _metrics(stop=3, length=1, abort=1, e400=1))
    assert ledger.violations == []
    ledger.check_counters(before, _metrics(stop=2, length=1, abort=2, e400=0))   # a 400 lost
    assert any("HTTP 400" in v for v in ledger.violations)
    ledger.violations.clear()
    ledger.check_counters(before, _metrics(stop=2, length=1, abort=1, error=1, e400=1))
    assert any("error=1" in v for v in ledger.violations)
    ledger.violations.clear()
    ledger.check_idle(_metrics(running=1))
    assert any("not idle" in v for v in ledger.violations)


def test_completed_answers_are_checked_on_their_own():
    req = SoakRequest(0, "chat", False, {"n": 2}, stop=" the", schema=True)
    out = _outcome(0, n=2, texts={0: "in the end", 1: '{"name": "a"}'},
                   reasons={0: "length", 1: "stop"})
    check_choices(req, out)
    assert any("stop string" in v for v in out.violations)
    assert any("schema" in v for v in out.violations)
    out = _outcome(0, n=2, reasons={0: "length"})
    check_choices(_req(0), out)
    assert any("n=2" in v for v in out.violations)


def test_rss_slope_ignores_warm_up_and_sees_growth():
    flat = [(i * 10, 500 * 2**20 + (100 * 2**20 if i < 10 else 0)) for i in range(40)]
    assert rss_slope_mb_per_1000(flat) == 0.0
    leaking = [(i * 10, 500 * 2**20 + i * 10 * 2**20 // 10) for i in range(40)]   # 0.1 MB/req
    assert rss_slope_mb_per_1000(leaking) == pytest.approx(100, rel=0.01)
    assert rss_slope_mb_per_1000(leaking[:3]) is None


def test_plan_mixes_every_kind_and_is_seeded():
    a = [RequestPlan(3, 0.25, "m").next() for _ in range(1)]
    plan, again = RequestPlan(3, 0.25, "m"), RequestPlan(3, 0.25, "m")
    reqs = [plan.next() for _ in range(400)]
    assert [r.body for r in reqs] == [again.next().body for _ in range(400)]
    assert a[0].body == reqs[0].body
    assert sum(r.twin_of is not None for r in reqs) > 20
    assert sum(r.bad_input for r in reqs) > 3 and sum(r.abort_after is not None for r in reqs) > 50
    assert {r.endpoint for r in reqs} == {"chat", "completions"} and {r.stream for r in reqs} == {True, False}
    assert any(r.schema for r in reqs) and any(r.stop for r in reqs)
    assert any(r.body.get("n") == 2 for r in reqs)


def test_parse_duration():
    assert parse_duration("10m") == 600 and parse_duration("90") == 90 and parse_duration("1h") == 3600
    with pytest.raises(ValueError, match="duration"):
        parse_duration("ten")
    with pytest.raises(ValueError, match="positive"):
        parse_duration("0s")
