"""tokenmill:moe_* on /metrics: the routing counts an MoE engine reports arrive as Prometheus
counters (per layer and expert, dropped, per expert-parallel rank) that advance by deltas and
survive a counter reset; a dense model exports none."""
import re

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.snapshot import EngineSnapshot, SnapshotCursor, snapshot_counters
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tests.models.test_moe_architectures import build_tiny_moe


def _series(text: str, name: str) -> dict:
    return {labels: float(v) for labels, v in re.findall(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M)}


def _load(counts, per_rank=None):
    load = {"num_layers": len(counts), "num_experts": len(counts[0]), "counts": counts,
            "routed": sum(map(sum, counts)), "dropped": 0, "imbalance": [1.5] * len(counts)}
    if per_rank is not None:
        load.update(per_rank=per_rank, rank_imbalance=1.2)
    return load


def test_counters_advance_by_deltas_and_survive_a_reset():
    metrics = ServerMetrics("m")
    metrics.on_engine_snapshot(EngineSnapshot(expert_load=_load([[3, 1], [0, 4]], per_rank=[4, 4])))
    metrics.on_engine_snapshot(EngineSnapshot(expert_load=_load([[5, 1], [0, 6]], per_rank=[5, 7])))
    metrics.on_engine_snapshot(EngineSnapshot(expert_load=_load([[1, 0], [0, 0]], per_rank=[1, 0])))  # reset
    metrics.on_engine_snapshot(EngineSnapshot(expert_load=_load([[2, 0], [0, 1]], per_rank=[2, 1])))
    text = metrics.render().decode()
    tokens = _series(text, "tokenmill:moe_expert_tokens_total")
    assert tokens['expert="0",layer="0",model_name="m"'] == 6       # 3, +2, reset, +1
    assert tokens['expert="1",layer="1",model_name="m"'] == 6 + 1
    ranks = _series(text, "tokenmill:moe_rank_tokens_total")
    assert ranks['model_name="m",rank="0"'] == 6 and ranks['model_name="m",rank="1"'] == 8
    assert _series(text, "tokenmill:moe_layer_imbalance")['layer="1",model_name="m"'] == 1.5
    assert _series(text, "tokenmill:moe_dropped_tokens_total") == {'model_name="m"': 0.0}


def test_dense_model_exports_no_moe_series():
    metrics = ServerMetrics("m")
    metrics.on_engine_snapshot(EngineSnapshot())
    assert "tokenmill:moe_" not in metrics.render().decode()


@pytest.fixture(scope="module")
def moe_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_moe")
    build_tiny_moe("qwen2_moe", path)
    return LLM(model=str(path), skip_tokenizer_init=True, num_kv_blocks=64, block_size=4)


def test_engine_snapshots_reach_the_metrics(moe_llm):
    engine = moe_llm.llm_engine
    metrics, cursor = ServerMetrics("tiny"), SnapshotCursor()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for prompt in ([5, 9, 13, 2, 8], [40, 41, 42]):
        moe_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        engine.get_stats()   # a fresh reading: snapshots reuse one up to a second old
        metrics.on_engine_snapshot(snapshot_counters(engine, cursor))
    stats = engine.get_stats()["moe"]
    tokens = _series(metrics.render().decode(), "tokenmill:moe_expert_tokens_total")
    assert sum(tokens.values()) == stats["routed"] > 0
    for layer, row in enumerate(stats["counts"]):
        for expert, n in enumerate(row):
            assert tokens.get(f'expert="{expert}",layer="{layer}",model_name="tiny"', 0.0) == n
