"""Speculative decoding end to end on a tiny random Llama: for every method greedy output equals
no speculation on a mixed batch (with chunked prefill, preemption, prefix caching, logprobs,
penalties); seeded sampling is identical with and without speculation; an always-wrong
drafter is harmless; counters; nothing held at idle."""
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.request import RequestStatus

PROMPTS = [[(17 * i + 5 * j) % 380 + 3 for j in range(n)] for i, n in
           enumerate([5, 9, 1, 23, 40, 3, 17, 64, 2, 31])]
PROMPTS[1] = PROMPTS[1] * 3             # repeats: something for n-gram lookup to find
PROMPTS[6] = PROMPTS[6][:6] * 5
METHODS = {
    "ngram": dict(method="ngram", prompt_lookup_min=1, prompt_lookup_max=3),
    "layer_skip": dict(method="layer_skip", num_layers=1),
    "draft_model": dict(method="draft_model"),      # model filled in: a second tiny model
    "medusa": dict(method="medusa"),
    "eagle": dict(method="eagle"),
    "eagle3": dict(method="eagle3"),       # random head with its own paged KV
    # its runners-up too: three candidates at depth 1, two at depth 2 (spec/draft_tree.py)
    "eagle3_tree": dict(method="eagle3", speculative_token_tree="[(0,), (1,), (2,), (0, 0), (0, 1)]"),
    "dflash": dict(method="dflash"),       # random drafter (one layer, blocks of 16)
}


def greedy(n=20, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def run(llm, prompts, params):
    return [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    from tests.conftest import save_tiny_llama
    path = tmp_path_factory.mktemp("tiny_draft")
    save_tiny_llama(path, seed=0, num_hidden_layers=1)   # the target's first layer + its head
    return str(path)


def spec_llm(tiny_llama_dir, draft_dir, method, k=3, adaptive=False, **kw):
    cfg = dict(METHODS[method], num_speculative_tokens=k, adaptive=adaptive)
    if method == "draft_model":
        cfg["model"] = draft_dir
    kw.setdefault("num_kv_blocks", 256)
    return LLM(model=tiny_llama_dir, skip_tokenizer_init=True, speculative_config=cfg, **kw)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=256)


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_equals_plain_in_mixed_batch(tiny_llama_dir, draft_dir, plain, method):
    ref = run(plain, PROMPTS, greedy())
    llm = spec_llm(tiny_llama_dir, draft_dir, method)
    assert run(llm, PROMPTS, greedy()) == ref
    stats = llm.get_stats()
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_draft_tokens"] >= stats["spec_num_drafts"]
    assert stats["spec_mean_acceptance_length"] >= 1.0
    assert sum(stats["spec_accepted_per_position"]) == stats["spec_num_accepted_tokens"]


@pytest.mark.parametrize("method", ["ngram", "eagle3", "eagle3_tree"])
def test_greedy_equals_plain_in_bf16_mode(tiny_llama_dir, draft_dir, method, bf16_kernel):
    """cpu_gemm_dtype bfloat16 multiplies decode rows, verify steps and prefill chunks on the
    bf16 tiles: a row's bits do not depend on how many rows share its matmul, so speculation
    (k + 1 rows a verify step) still gives plain decoding's tokens (one row a step), on
    vdpbf16ps and on AMX tiles alike."""
    params, prompts = greedy(logprobs=1), [{"prompt_token_ids": p} for p in PROMPTS]
    plain16 = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=256,
                  cpu_gemm_dtype="bfloat16")
    ref = plain16.generate(prompts, params, use_tqdm=False)
    llm = spec_llm(tiny_llama_dir, draft_dir, method, cpu_gemm_dtype="bfloat16")
    for o, r in zip(llm.generate(prompts, params, use_tqdm=False), ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        got = [{t: lp.logprob for t, lp in a.items()} for a in o.outputs[0].logprobs]
        assert got == [{t: lp.logprob for t, lp in b.items()} for b in r.outputs[0].logprobs]
    assert llm.get_stats()["spec_num_accepted_tokens"] > 0


@pytest.mark.parametrize("method", ["ngram", "layer_skip", "draft_model", "eagle3", "eagle3_tree", "dflash"])
def test_greedy_equals_plain_with_chunking_and_preemption(tiny_llama_dir, draft_dir, plain, method):
    ref = run(plain, PROMPTS, greedy())
    small = spec_llm(tiny_llama_dir, draft_dir, method, num_kv_blocks=14,
                     max_num_batched_tokens=24, max_num_seqs=8)
    assert run(small, PROMPTS, greedy()) == ref
    assert small.get_stats()["num_preemptions"] > 0
    mem = small.get_memory_stats()
    assert mem["num_free_blocks"] == mem["num_total_blocks"]
    assert not small.engine.scheduler.requests and not small.engine.runner.states


@pytest.mark.parametrize("method", ["ngram", "layer_skip", "eagle3", "eagle3_tree", "dflash"])
def test_logprobs_penalties_and_prefix_cache(tiny_llama_dir, draft_dir, plain, method):
    params = greedy(16, logprobs=2, repetition_penalty=1.3, frequency_penalty=0.4)
    ref = plain.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm = spec_llm(tiny_llama_dir, draft_dir, method)
    for _ in range(2):   # cold, then warm prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        for o, r in zip(outs, ref):
            assert o.outputs[0].token_ids == r.outputs[0].token_ids
            for a, b in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
                assert a.keys() == b.keys()
                assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert llm.get_stats()["prefix_cache_hit_rate"] > 0


@pytest.mark.parametrize("method", list(METHODS))
def test_seeded_sampling_identical_with_and_without_spec(tiny_llama_dir, draft_dir, plain, method):
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_tokens=16,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    ref = [o.outputs[0].token_ids for o in
           plain.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    llm = spec_llm(tiny_llama_dir, draft_dir, method, adaptive=True)
    outs = [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    assert outs == ref


class AlwaysWrongProposer:
    """Proposes, for every position, a token the target's greedy output never has there."""

    needs_lookahead = False
    aux_layers = ()

    def __init__(self, ref: dict, vocab: int):
        self.ref, self.vocab = ref, vocab

    def propose(self, inp):
        out = []
        for s, k in zip(inp.states, inp.num_drafts):
            cont = self.ref[tuple(s.prompt_token_ids)]
            n = len(s.output_token_ids)
            out.append([(cont[min(n + j, len(cont) - 1)] + 1) % self.vocab for j in range(k)])
        return out

    def drop(self, req_ids):
        pass


def test_always_wrong_drafter_still_gives_correct_output(tiny_llama_dir, draft_dir, plain):
    ref = run(plain, PROMPTS, greedy())
    llm = spec_llm(tiny_llama_dir, draft_dir, "ngram", k=4)
    llm.engine.runner.spec.proposer = AlwaysWrongProposer(
        {tuple(p): r for p, r in zip(PROMPTS, ref)}, 384)
    assert run(llm, PROMPTS, greedy()) == ref
    stats = llm.get_stats()
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] == 0


def test_abort_while_speculating_leaves_others_identical(tiny_llama_dir, draft_dir, plain):
    ref = run(plain, PROMPTS, greedy())
    llm = spec_llm(tiny_llama_dir, draft_dir, "layer_skip")
    engine = llm.engine
    ids = [engine.add_request(None, {"prompt_token_ids": p}, greedy()) for p in PROMPTS]
    outs, aborted = {}, None
    while engine.has_unfinished_requests():
        if aborted is None:
            victim = next((r for r in engine.scheduler.requests.values()
                           if r.spec_token_ids and r.status == RequestStatus.RUNNING), None)
            if victim is not None:
                aborted = victim.request_id
                engine.abort_request(aborted)
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    assert aborted is not None
    for rid, r in zip(ids, ref):
        if rid != aborted:
            assert outs[rid] == r
    mem = llm.get_memory_stats()
    assert mem["num_free_blocks"] == mem["num_total_blocks"]


def test_n_samples_and_stop_tokens(tiny_llama_dir, draft_dir, plain):
    llm = spec_llm(tiny_llama_dir, draft_dir, "layer_skip")
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    a = plain.generate([{"prompt_token_ids": PROMPTS[7]}], params, use_tqdm=False)[0]
    b = llm.generate([{"prompt_token_ids": PROMPTS[7]}], params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    ref = run(plain, [PROMPTS[1]], greedy(12))[0]
    stop = ref[5]
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], greedy(12, stop_token_ids=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[:ref.index(stop) + 1] and out.finish_reason == "stop"


def test_config_spellings(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=64,
              speculative_model="[ngram]", num_speculative_tokens=2)
    assert llm.engine.config.speculative.method == "ngram"
    assert llm.engine.config.speculative.num_speculative_tokens == 2
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        LLM(model=tiny_llama_dir, skip_tokenizer_init=True, speculative_config={"methd": "ngram"})
    with pytest.raises(ValueError, match="method"):
        LLM(model=tiny_llama_dir, skip_tokenizer_init=True, speculative_config={"method": "magic"})
