"""ngram_first: prompt lookup drafts where the context repeats, the drafter (EAGLE-3 here)
elsewhere. Output stays identical to no speculation, both sources draft, and the drafter's
context cache stays complete on steps where lookup served a request."""
import pytest

from tests.spec.drafter_reference import PROMPTS, run
from tests.spec.test_eagle3 import CheckingProposer
from tokenmill import LLM, SamplingParams
from tokenmill.config import SpeculativeConfig
from tokenmill.spec.eagle3 import Eagle3Proposer
from tokenmill.spec.lookup_first import LookupFirstProposer


def lookup_first_llm(model_dir, **kw):
    return LLM(model=model_dir, skip_tokenizer_init=True, num_threads=1, num_kv_blocks=40,
               max_num_batched_tokens=24, max_num_seqs=8, **kw,
               speculative_config=dict(method="eagle3", num_speculative_tokens=3, adaptive=False,
                                       ngram_first=True, prompt_lookup_min=2))


@pytest.fixture(scope="module")
def plain_outputs(looping_llama_dir):
    llm = LLM(model=looping_llama_dir, skip_tokenizer_init=True, num_kv_blocks=256, num_threads=1)
    return run(llm, PROMPTS, n=40)


def test_greedy_equals_plain_with_both_sources_drafting(looping_llama_dir, plain_outputs):
    llm = lookup_first_llm(looping_llama_dir)
    runner = llm.engine.runner
    proposer = runner.spec.proposer
    assert isinstance(proposer, LookupFirstProposer) and isinstance(proposer.drafter, Eagle3Proposer)
    assert proposer.needs_lookahead and proposer.aux_layers == proposer.drafter.aux_layers
    # every EAGLE-3 chain checked against a dense one over recomputed features: a step that
    # lookup drafted for must still reach the drafter's context cache
    proposer.drafter = checker = CheckingProposer(proposer.drafter, runner)
    for _ in range(2):   # cold, then warm prefix cache
        assert run(llm, PROMPTS, n=40) == plain_outputs
    assert proposer.drafts_by["lookup"] > 10 and proposer.drafts_by["drafter"] > 10
    assert checker.checked > 20
    mem = llm.get_memory_stats()
    assert mem["num_free_blocks"] == mem["num_total_blocks"]


def test_seeded_sampling_equals_plain(looping_llama_dir):
    params = [SamplingParams(temperature=1.0, max_tokens=24, seed=7 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]

    def sample(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    plain = sample(LLM(model=looping_llama_dir, skip_tokenizer_init=True, num_kv_blocks=256, num_threads=1))
    assert sample(lookup_first_llm(looping_llama_dir)) == plain


@pytest.mark.parametrize("extra, match", [
    (dict(method="ngram", ngram_first=True), "already 'ngram'"),
    (dict(method="eagle3", ngram_first="yes"), "true or false"),
])
def test_config_errors(extra, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(num_speculative_tokens=3, **extra)


class _Modes:
    """A controller stub: always k drafts, in mode 1 (lookup only) but every ``every``-th step,
    which is mode 0 (lookup, then the drafter)."""

    def __init__(self, k: int, every: int) -> None:
        self.k, self.every, self.step = k, every, 0

    def choose(self, batch_size):
        self.step += 1
        return self.k, 0 if self.step % self.every == 0 else 1

    def record(self, *args, **kwargs):
        pass

    def estimated_speedup(self):
        return 0.0


def test_lookup_only_mode_leaves_the_drafter_out_but_keeps_its_context(looping_llama_dir, plain_outputs):
    """Mode 1 (the adaptive controller's cheaper arm): prompt lookup drafts and the drafter
    drafts for nobody, yet it records every step's features, so the chains it drafts in the
    mode-0 steps between match a dense drafter over recomputed features. Output equals plain
    decoding."""
    llm = lookup_first_llm(looping_llama_dir)
    runner = llm.engine.runner
    proposer = runner.spec.proposer
    assert len(proposer.modes) == 2
    proposer.drafter = checker = CheckingProposer(proposer.drafter, runner)
    runner.spec.controller = _Modes(3, every=4)
    assert run(llm, PROMPTS, n=40) == plain_outputs
    assert proposer.drafts_by["lookup"] > 10 and runner.spec.stats.cheaper_mode_steps > 20
    assert 0 < proposer.drafts_by["drafter"] and checker.checked > 10
    runner.spec.controller = _Modes(3, every=10**9)       # mode 1 only
    proposer.reset_counts()
    recorded = []   # rows of features written to the drafter's context (the tiny drafter's
    real_record = checker.record   # chains barely depend on it, so count them as well)
    checker.record = lambda f: recorded.append(sum(f.counts)) or real_record(f)
    assert run(llm, PROMPTS, n=40) == plain_outputs
    assert proposer.drafts_by["lookup"] > 10 and proposer.drafts_by["drafter"] == 0
    assert sum(recorded) + checker.pending.rows >= sum(map(len, plain_outputs))
