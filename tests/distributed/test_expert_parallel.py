"""Expert parallelism and tensor-parallel experts: an MoE model split over 2 rank processes
gives the tokens of one process (greedy and seeded), logprobs within 1e-4, float and int8;
with expert parallelism each rank loads only its experts and reports its share of the load."""
import pytest

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.layers import native
from tests.distributed.test_tensor_parallel import run, same_outputs
from tests.models.test_moe_architectures import build_tiny_moe


def make_engine(model, tp, expert_parallel=False, quantization=None, cpu_gemm_dtype="float32", **parallel):
    cfg = EngineConfig(model=ModelConfig(model=model, skip_tokenizer_init=True, quantization=quantization,
                                         cpu_gemm_dtype=cpu_gemm_dtype),
                       cache=CacheConfig(block_size=4, num_kv_blocks=64),
                       parallel=ParallelConfig(tensor_parallel_size=tp,
                                               enable_expert_parallel=expert_parallel, **parallel))
    return LLMEngine(cfg)


@pytest.fixture(scope="module", params=["qwen2_moe", "mixtral"])
def moe_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_tiny_moe(request.param, path)
    return request.param, str(path)


@pytest.fixture(scope="module")
def single(moe_dir):
    engine = make_engine(moe_dir[1], 1)
    engine.reset_expert_load()
    return run(engine), engine.get_stats()["moe"]


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp-experts", "ep"])
def test_split_moe_matches_one_process(moe_dir, single, expert_parallel):
    expected, expected_load = single
    engine = make_engine(moe_dir[1], 2, expert_parallel)
    try:
        engine.reset_expert_load()
        got = run(engine)
        load = engine.get_stats()["moe"]
        memory = engine.get_memory_stats()
    finally:
        engine.shutdown()
    same_outputs(expected, got)
    assert load["counts"] == expected_load["counts"]   # routing is replicated, not split
    if expert_parallel:
        # each rank holds half the experts, and computed exactly their tokens
        num_experts = load["num_experts"]
        halves = [sum(row[e] for row in load["counts"] for e in range(r * num_experts // 2, (r + 1) * num_experts // 2))
                  for r in range(2)]
        assert load["per_rank"] == halves and sum(halves) == load["routed"]
    else:
        assert "per_rank" not in load
    weights = [r["model_weights"] for r in memory["ranks"]]
    assert max(weights) < 0.75 * sum(weights)   # nobody holds the whole model


@pytest.mark.parametrize("quantization", [None, "int8", "int4-g32", "bf16-mode"])
def test_hot_expert_replicas_change_no_token(moe_dir, single, quantization):
    """Each layer's hottest expert copied onto both ranks every 3 steps: the same tokens
    (float, int8 experts quantized as at load, bf16 mode's replicas on bf16 tiles like their
    owners), the replicated experts' pairs split."""
    name, path = moe_dir
    # one architecture per scheme; int4 on Mixtral, whose row-split inputs stay multiples of
    # int4's 32-wide blocks at TP=2 (else that layer falls back to int8 on the ranks only)
    if quantization and name != {"int8": "qwen2_moe", "int4-g32": "mixtral", "bf16-mode": "qwen2_moe"}[quantization]:
        pytest.skip("one architecture per quantized layout")
    gemm = "bfloat16" if quantization == "bf16-mode" else "float32"
    if gemm == "bfloat16" and not native.has_avx512_bf16():
        pytest.skip("CPU without AVX-512 BF16")
    quantization = None if gemm == "bfloat16" else quantization
    expected = single[0] if quantization is None and gemm == "float32" else \
        run(make_engine(path, 1, quantization=quantization, cpu_gemm_dtype=gemm))
    engine = make_engine(path, 2, expert_parallel=True, quantization=quantization, cpu_gemm_dtype=gemm,
                         replicate_hot_experts=1, expert_rebalance_interval=3)
    try:
        engine.reset_expert_load()
        got = run(engine)
        load = engine.get_stats()["moe"]
        plan = engine.expert_balancer.plan
    finally:
        engine.shutdown()
    same_outputs(expected, got)
    assert plan is not None and all(len(layer) == 1 for layer in plan)
    assert sum(load["per_rank"]) == load["routed"]
    n = load["num_experts"]
    by_owner = [sum(row[e] for row in load["counts"] for e in range(r * n // 2, (r + 1) * n // 2)) for r in range(2)]
    assert load["per_rank"] != by_owner   # replicas took part of their owners' tokens


def test_replication_needs_expert_parallelism():
    with pytest.raises(ValueError, match="needs enable_expert_parallel"):
        ParallelConfig(tensor_parallel_size=2, replicate_hot_experts=1)


def test_bad_expert_parallel_layouts_fail_before_starting_ranks(moe_dir, tmp_path):
    from tests.conftest import save_tiny_llama
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts model"):
        dense = tmp_path / "dense"
        save_tiny_llama(dense)
        make_engine(str(dense), 1, expert_parallel=True)
    import json
    from tokenmill.models.registry import check_parallel_layout
    cfg = json.load(open(f"{moe_dir[1]}/config.json"))
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    ranks = 4 if experts % 4 else 8   # heads split (or replicate), experts do not
    if ranks == 8:
        pytest.skip("4 heads do not split over 8 ranks either")
    with pytest.raises(ValueError, match=f"does not divide the {experts} experts"):
        check_parallel_layout(cfg, ranks, expert_parallel=True)
    check_parallel_layout(cfg, ranks, expert_parallel=False)   # slicing each expert works
