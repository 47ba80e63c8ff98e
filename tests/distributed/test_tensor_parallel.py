"""Tensor parallelism: TP=2 / TP=3 rank processes give the tokens of one process (greedy
and seeded), logprobs within 1e-4, on float and quantized weights; each rank holds only its
KV heads; a dead rank fails the engine without a hang and leaves no process behind."""
import multiprocessing

import numpy as np
import pytest
import torch

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from tokenmill.runner.executor import WorkerFailedError
from tokenmill.distributed.parallel_state import TPGroup
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams
from tests.entrypoints.openai.conftest import smollm2_path  # noqa: F401 (fixture)

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [3, 3, 8], [12, 40, 11, 6, 6, 1, 30, 22, 19, 4, 5]]


def make_engine(model, tp, quantization=None, shm_collectives=True, num_kv_blocks=64):
    cfg = EngineConfig(model=ModelConfig(model=model, skip_tokenizer_init=True,
                                         quantization=quantization),
                       cache=CacheConfig(block_size=4, num_kv_blocks=num_kv_blocks),
                       parallel=ParallelConfig(tensor_parallel_size=tp,
                                               shm_collectives=shm_collectives))
    return LLMEngine(cfg)


def run(engine, prompts=PROMPTS, max_tokens=8):
    """{request id: (token ids, logprob of each chosen token)}: a greedy request and a
    seeded sampled one per prompt."""
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", {"prompt_token_ids": p},
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2,
                                          ignore_eos=True))
        engine.add_request(f"s{i}", {"prompt_token_ids": p},
                           SamplingParams(temperature=0.9, seed=11 + i, max_tokens=max_tokens,
                                          logprobs=0, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
    return done


def same_outputs(a: dict, b: dict, atol=1e-4) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key][0] == b[key][0], key
        np.testing.assert_allclose(a[key][1], b[key][1], atol=atol, rtol=0)


def tp_vs_single(model, tp, quantization=None, shm_collectives=True):
    single = make_engine(model, 1, quantization)
    expected = run(single)
    split = make_engine(model, tp, quantization, shm_collectives)
    try:
        got = run(split)
        memory = split.get_memory_stats()
    finally:
        split.shutdown()
    same_outputs(expected, got)
    return single, memory


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory):
    """4 heads / 2 KV heads, a tied head and an odd vocabulary (the last rank's rows pad)."""
    from tests.conftest import save_tiny_llama
    path = tmp_path_factory.mktemp("tp_llama")
    save_tiny_llama(path, vocab_size=385, tie_word_embeddings=True, num_hidden_layers=3)
    return str(path)


@pytest.mark.parametrize("quantization,shm", [(None, True), (None, False), ("int8", True),
                                              ("int4-g32", True)],
                         ids=["float", "float-gloo", "int8", "int4-g32"])
def test_tp2_matches_one_process(tied_llama_dir, quantization, shm):
    """shm: small collectives through shared memory; False: all of them over gloo."""
    single, memory = tp_vs_single(tied_llama_dir, 2, quantization, shm)
    ranks = memory["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and memory["tensor_parallel_size"] == 2
    one_rank_kv = single.get_memory_stats()["kv_cache"]
    assert all(r["kv_cache"] * 2 == one_rank_kv for r in ranks)   # 1 of 2 KV heads each
    assert memory["kv_cache"] == one_rank_kv


def test_tp2_under_preemption_matches_one_process(tied_llama_dir):
    """A pool of 10 blocks for 6 requests: the scheduler preempts and recomputes; every rank
    drops and rebuilds the same request state."""
    expected = run(make_engine(tied_llama_dir, 1, num_kv_blocks=10))
    split = make_engine(tied_llama_dir, 2, num_kv_blocks=10)
    try:
        same_outputs(expected, run(split))
        assert split.scheduler.num_preemptions > 0
    finally:
        split.shutdown()


def test_tp2_packed_gguf_matches_one_process(tmp_path):
    pytest.importorskip("gguf")
    from tests.models.test_gguf_reader import write_tiny_llama
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, np.random.default_rng(3))   # Q8_0 / Q4_0 / Q4_1 kept packed
    tp_vs_single(str(path), 2, "gguf")


def test_tp_beyond_kv_heads_replicates_them(tmp_path):
    from tests.conftest import save_tiny_llama
    save_tiny_llama(tmp_path, num_attention_heads=4, num_key_value_heads=1, attention_bias=True)
    single, memory = tp_vs_single(str(tmp_path), 2)
    # each rank keeps the one KV head: as much cache as one process
    assert all(r["kv_cache"] == single.get_memory_stats()["kv_cache"] for r in memory["ranks"])


def test_tp2_with_window_pools_matches_one_process(tmp_path):
    """Tiny Gemma3 (window 8) with its sliding layers in a KV pool of their own, prompts past
    the window in chunks of 16: every rank allocates and indexes the same groups."""
    from tests.models.test_fused_architectures import _save_tiny
    from tokenmill.config import SchedulerConfig
    _, path = _save_tiny("gemma3", tmp_path)
    prompts = [[(11 * i + 5 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([40, 3, 21])]

    def engine(tp):
        return LLMEngine(EngineConfig(
            model=ModelConfig(model=path, skip_tokenizer_init=True),
            cache=CacheConfig(block_size=4, num_kv_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
            parallel=ParallelConfig(tensor_parallel_size=tp)))
    single = engine(1)
    assert [g.window for g in single.kv_layout.groups] == [None, 8]
    expected = run(single, prompts, max_tokens=12)
    split = engine(2)
    try:
        same_outputs(expected, run(split, prompts, max_tokens=12))
    finally:
        split.shutdown()


def real_model_tp_matches(path, tp, prompts):
    """A real GGUF (packed blocks), 6 tokens per request: TP=tp against one process."""
    expected = run(make_engine(path, 1, "gguf"), prompts, max_tokens=6)
    split = make_engine(path, tp, "gguf")
    try:
        same_outputs(expected, run(split, prompts, max_tokens=6))
    finally:
        split.shutdown()


def test_tp3_on_smollm2_matches_one_process(smollm2_path):
    """9 query / 3 KV heads: one KV head per rank; Q4_1 / Q8_0 blocks split packed."""
    real_model_tp_matches(smollm2_path, 3, [[1, 504, 3458, 314, 3575, 282], [1, 9690, 28]])


def test_uneven_splits_are_refused_before_any_process_starts(tied_llama_dir):
    before = len(multiprocessing.active_children())
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        make_engine(tied_llama_dir, 3)
    assert len(multiprocessing.active_children()) == before


def test_a_split_that_would_cut_a_quant_group_is_an_error():
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.quant.checkpoint_methods import GGUFMethod
    fake = TPGroup(rank=1, size=2, group=object())   # built, never communicating
    layer = Linear(96, 8, quant_method=GGUFMethod("i8"), tp=fake, parallel="row")
    assert layer.in_features == 48
    with pytest.raises(ValueError, match="would cut its quantization groups of 32"):
        layer.weight_loader(layer.scales, torch.zeros(8, 3), name="blk.0.attn_output.scales")


def test_rank_loads_only_its_piece_of_a_lazy_tensor():
    from tokenmill.layers.linear import MergedLinear
    fake = TPGroup(rank=1, size=2, group=object())
    layer = MergedLinear(4, [4, 2], ["q", "k"], tp=fake, parallel="column",
                         shard_parts={"k": (1, 0)})   # k replicated: every rank all of it
    full_q = torch.arange(16.0).reshape(4, 4)
    layer.weight_loader(layer.weight, full_q, "q", name="q")
    layer.weight_loader(layer.weight, torch.ones(2, 4), "k", name="k")
    assert torch.equal(layer.weight[:2], full_q[2:]) and torch.equal(layer.weight[2:], torch.ones(2, 4))


def test_the_fused_decode_stack_never_runs_split_layers(tied_llama_dir):
    """Its C loop has no all-reduce: a rank must always run the modules."""
    from tokenmill.models.loader import open_checkpoint
    from tokenmill.models.llama import LlamaForCausalLM
    from tokenmill.runner import fused_stack
    cfg = open_checkpoint(tied_llama_dir).hf_config
    assert fused_stack.stack_kind(LlamaForCausalLM(cfg))
    split = LlamaForCausalLM(cfg, TPGroup(rank=0, size=2, group=object()))
    assert fused_stack.stack_plan(split) is None
    assert not fused_stack.may_apply(split, 1, None, None)


def test_a_killed_rank_fails_the_engine_and_leaves_no_process(tied_llama_dir):
    engine = make_engine(tied_llama_dir, 2)
    procs = list(engine.executor.procs)
    assert all(p.is_alive() for p in procs)
    procs[1].kill()
    procs[1].join(5)
    engine.add_request("x", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4))
    with pytest.raises(WorkerFailedError, match="rank 1"):
        while engine.has_unfinished_requests():
            engine.step()
    engine.shutdown()
    assert not any(p.is_alive() for p in procs)
    assert not [c for c in multiprocessing.active_children() if c.name.startswith("tokenmill-tp")]


def test_tp2_on_gemma3_replicates_its_one_kv_head():
    """Gemma3-270m: 4 query heads / 1 KV head, sliding and global layers, 262k vocabulary,
    K-quant tensors (dequantized) next to packed Q8_0."""
    from tokenmill.models.hub import resolve_model
    try:
        path = resolve_model("gemma3-270m")
    except Exception as e:
        pytest.skip(f"Gemma3 GGUF unavailable: {e}")
    real_model_tp_matches(path, 2, [[2, 818, 5279, 529, 7001, 563], [2, 9259, 236764]])


def test_tp2_over_ray_actors_matches_one_process(tied_llama_dir):
    pytest.importorskip("ray")
    import ray
    expected = run(make_engine(tied_llama_dir, 1))
    cfg = EngineConfig(model=ModelConfig(model=tied_llama_dir, skip_tokenizer_init=True),
                       cache=CacheConfig(block_size=4, num_kv_blocks=64),
                       parallel=ParallelConfig(tensor_parallel_size=2,
                                               distributed_executor_backend="ray"))
    engine = LLMEngine(cfg)   # a local Ray instance of its own
    try:
        same_outputs(expected, run(engine))
        assert [r["rank"] for r in engine.get_memory_stats()["ranks"]] == [0, 1]
    finally:
        engine.shutdown()
        ray.shutdown()


def test_lazy_gguf_pieces_equal_slices_of_the_eager_tensors(tmp_path):
    """A rank's narrowed GGUF tensor (rows, block-aligned columns, q/k heads un-permuted,
    unaligned columns too) holds exactly the eager tensor's values there."""
    pytest.importorskip("gguf")
    from tests.models.test_gguf_reader import write_tiny_llama
    from tokenmill.layers.lazy import LazyTensor, materialize
    from tokenmill.models.loader import open_checkpoint
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, np.random.default_rng(5))
    ckpt = open_checkpoint(str(path))
    eager = dict(ckpt.iter_tensors())
    checked = 0
    for name, lazy in ckpt.iter_tensors(lazy=True):
        full = eager[name]
        if not isinstance(lazy, LazyTensor):
            assert torch.equal(lazy, full)
            continue
        rows, cols = full.shape
        for dim, start, length in [(0, rows // 2, rows // 2), (1, cols // 2, cols // 2),
                                   (0, 16, 16), (0, 3, 10), (1, 5, 7)]:
            assert torch.equal(materialize(lazy.narrow(dim, start, length)),
                               full.narrow(dim, start, length)), (name, dim, start, length)
        checked += 1
    assert checked >= 10


def test_a_dropped_engine_stops_its_ranks(tied_llama_dir):
    import gc
    engine = make_engine(tied_llama_dir, 2)
    procs = list(engine.executor.procs)
    del engine
    gc.collect()
    for p in procs:
        p.join(10)
    assert not any(p.is_alive() for p in procs)


@pytest.mark.parametrize("fmt", ["gptq", "awq", "fp8"])
def test_tp2_on_quantized_checkpoints_matches_one_process(tmp_path, fmt):
    """GPTQ / AWQ int32 packs (split along their packed dims: rows for column-parallel, K
    at group boundaries for row-parallel) and an FP8 checkpoint with per-channel scales."""
    from tests.conftest import save_tiny_llama
    from tokenmill.layers.quant import formats
    from tokenmill.models.loader import open_checkpoint
    from tokenmill.quantization import writer
    from tokenmill.quantization.gptq import rtn
    src = tmp_path / "float"
    save_tiny_llama(src, num_hidden_layers=2)
    source = open_checkpoint(str(src))
    tensors = dict(source.iter_tensors())
    out = {}
    for name in list(tensors):
        if not name.endswith("proj.weight"):
            continue
        prefix, w = name[:-len(".weight")], tensors.pop(name)
        if fmt == "fp8":
            out.update(writer.fp8_tensors(prefix, formats.quantize_fp8(w)))
        else:
            pack = writer.gptq_tensors if fmt == "gptq" else writer.awq_tensors
            out.update(pack(prefix, rtn(w, 4, 32)))
    out.update(tensors)
    qc = writer.quantization_config(fmt, 8 if fmt == "fp8" else 4, 32)
    writer.write_checkpoint(str(tmp_path / fmt), source.hf_config, out, qc)
    single, _ = tp_vs_single(str(tmp_path / fmt), 2)
    assert single.model.quantization_method == {"fp8": "fp8-ckpt"}.get(fmt, fmt)


def test_dp2_of_tp2_replicas_matches_one_process(tied_llama_dir):
    """Each of two replica processes runs its own two rank processes."""
    from tokenmill.engine.data_parallel import create_engine
    expected = run(make_engine(tied_llama_dir, 1))
    cfg = EngineConfig(model=ModelConfig(model=tied_llama_dir, skip_tokenizer_init=True),
                       cache=CacheConfig(block_size=4, num_kv_blocks=64),
                       parallel=ParallelConfig(tensor_parallel_size=2, data_parallel_size=2))
    engine = create_engine(cfg)
    try:
        same_outputs(expected, run(engine))
    finally:
        engine.shutdown()
    assert not [c for c in multiprocessing.active_children() if c.name.startswith("tokenmill")]


def test_ngram_speculation_with_tp2_matches_one_process(tied_llama_dir):
    """Rank 0 drafts (ngram: no collectives); every rank verifies the scheduler's drafts and
    samples the same tokens. Stats come from rank 0."""
    from tokenmill.config import SpeculativeConfig

    def engine(tp, spec):
        cfg = EngineConfig(model=ModelConfig(model=tied_llama_dir, skip_tokenizer_init=True),
                           cache=CacheConfig(block_size=4, num_kv_blocks=64),
                           parallel=ParallelConfig(tensor_parallel_size=tp),
                           speculative=SpeculativeConfig("ngram", 3, adaptive=False) if spec else None)
        return LLMEngine(cfg)
    repetitive = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 9, 9, 9, 9, 9]]
    expected = run(engine(1, False), repetitive, max_tokens=48)
    split = engine(2, True)
    try:
        got = run(split, repetitive, max_tokens=48)
        stats = split.get_stats()
    finally:
        split.shutdown()
    same_outputs(expected, got)
    assert stats["spec_decode"]["method"] == "ngram" and stats["spec_num_draft_tokens"] > 0
    with pytest.raises(ValueError, match="does not run with tensor_parallel_size > 1"):
        LLMEngine(EngineConfig(model=ModelConfig(model=tied_llama_dir, skip_tokenizer_init=True),
                               parallel=ParallelConfig(tensor_parallel_size=2),
                               speculative=SpeculativeConfig("medusa", 2)))


def test_tp2_embeddings_match_one_process(tied_llama_dir):
    """Pooling requests cross the wire to every rank (NewRequestData.pooling_params) and
    their vectors come back from rank 0 (ModelRunnerOutput.pooled)."""
    from tokenmill.pooling_params import PoolingParams

    def embed(engine):
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"m{i}", {"prompt_token_ids": p}, PoolingParams())
            engine.add_request(f"l{i}", {"prompt_token_ids": p}, PoolingParams(pooling_type="last"))
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs.embedding for o in engine.step() if o.finished})
        return done

    expected = embed(make_engine(tied_llama_dir, 1))
    split = make_engine(tied_llama_dir, 2)
    try:
        got = embed(split)
    finally:
        split.shutdown()
    assert got.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], atol=1e-5, rtol=0)
