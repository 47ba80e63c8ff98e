"""Drafts that race with the target's noise (spec/coupled.py): a drafter whose distribution is
the target's proposes the very token the target samples; a reduced draft vocabulary maps its
noise to the right target ids; greedy rows take the argmax; unseeded random requests are
seeded by the runner only when the drafter couples."""
from types import SimpleNamespace

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.sample.metadata import RowSamplingState, build_sampling_metadata, make_request_generator, step_seed
from tokenmill.sample.sampler import Sampler
from tokenmill.spec.coupled import draft_tokens

V = 300


def target_samples(logits, params, seeds, positions):
    """What the plain sampler draws for each row, its generator seeded as the runner does."""
    rows = [RowSamplingState(p, [1], [], make_request_generator(step_seed(s, n), "cpu"))
            for p, s, n in zip(params, seeds, positions)]
    return Sampler()(logits, build_sampling_metadata(rows, V, "cpu")).sampled_token_ids


def states(params, seeds):
    return [SimpleNamespace(params=p, seed=s, drawn_noise={}, noise_budget=None) for p, s in zip(params, seeds)]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_p=0.9),
                                    SamplingParams(temperature=1.3, top_k=20)])
def test_a_drafter_with_the_targets_distribution_drafts_the_targets_sample(params):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, V, generator=g) * 2
    seeds, positions = list(range(7, 47)), [3 * i for i in range(40)]
    want = target_samples(logits, [params] * 40, seeds, positions)
    got = draft_tokens(logits, states([params] * 40, seeds), positions, V)
    assert torch.equal(got, want)
    # the race is what matches: the drafts are not simply the argmax
    assert (got != logits.argmax(-1)).sum() > 5


def test_a_reduced_vocabulary_races_with_the_noise_of_its_target_ids():
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=1.0)
    logits = torch.randn(60, V, generator=g) * 2
    seeds, positions = list(range(60)), [5] * 60
    want = target_samples(logits, [params] * 60, seeds, positions)
    kept = torch.randperm(V, generator=g)[:V // 2].sort().values   # draft id d is target id kept[d]
    got = draft_tokens(logits[:, kept], states([params] * 60, seeds), positions, V, lambda ids: kept[ids])
    inside = torch.isin(want, kept)   # the target's pick within the draft vocabulary: the same race
    assert inside.sum() > 15
    assert torch.equal(got[inside], want[inside])


def test_greedy_and_unseeded_rows_take_the_argmax():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, V, generator=g)
    rows = states([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
                   SamplingParams(temperature=1.0)], [5, None, 9])
    got = draft_tokens(logits, rows, [0, 0, 0], V)
    assert got[:2].tolist() == logits[:2].argmax(-1).tolist()


@pytest.mark.parametrize("method,couples", [("eagle3", True), ("ngram", False)])
def test_random_requests_get_a_seed_only_when_the_drafter_couples(tiny_llama_dir, method, couples):
    cfg = dict(method=method, num_speculative_tokens=2)
    if method == "ngram":
        cfg.update(prompt_lookup_min=1, prompt_lookup_max=2)
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, speculative_config=cfg, num_kv_blocks=64)
    engine, seen = llm.engine, {}
    ids = {"random": engine.add_request(None, {"prompt_token_ids": [3, 4, 5]}, SamplingParams(temperature=1.0, max_tokens=4)),
           "greedy": engine.add_request(None, {"prompt_token_ids": [3, 4, 6]}, SamplingParams(temperature=0.0, max_tokens=4)),
           "seeded": engine.add_request(None, {"prompt_token_ids": [3, 4, 7]}, SamplingParams(temperature=1.0, seed=42, max_tokens=4))}
    engine.step()
    for name, req_id in ids.items():
        seen[name] = engine.runner.states[req_id].seed
    while engine.has_unfinished_requests():
        engine.step()
    assert (seen["random"] is not None) == couples
    assert seen["greedy"] is None
    assert seen["seeded"] is not None


def test_the_sampler_takes_the_noise_drawn_ahead_and_it_is_the_generators_own():
    from tokenmill.sample.sampler import position_noise
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, V, generator=g)
    params = [SamplingParams(temperature=1.0)] * 5 + [SamplingParams(temperature=0.0)]
    seeds, positions = [11, 12, 13, 14, 15, 16], [0, 4, 9, 9, 2, 1]

    def sample(noise_for):
        rows = [RowSamplingState(p, [1], [], make_request_generator(step_seed(s, n), "cpu"), noise_for(r))
                for r, (p, s, n) in enumerate(zip(params, seeds, positions))]
        return Sampler()(logits, build_sampling_metadata(rows, V, "cpu")).sampled_token_ids
    plain = sample(lambda r: None)
    ahead = sample(lambda r: position_noise(seeds[r], positions[r], V, "cpu") if r % 2 else None)
    assert torch.equal(ahead, plain)
    rigged = torch.full((V,), 1e30)
    rigged[7] = 1e-30   # only token 7 can win the race
    assert sample(lambda r: rigged if r == 1 else None).tolist() == [plain[0].item(), 7, *plain[2:].tolist()]


def seeded_outputs(llm, max_tokens: int = 12) -> list:
    """Token ids of four seeded T = 1 (top-p 0.95) requests of 5 to 40 prompt tokens."""
    prompts = [[(17 * i + 5 * j) % 380 + 3 for j in range(n)] for i, n in enumerate([5, 9, 23, 40])]
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=200 + i, max_tokens=max_tokens,
                             ignore_eos=True) for i in range(len(prompts))]
    return [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


@pytest.mark.parametrize("method", ["eagle3", "dflash", "layer_skip", "draft_model", "medusa", "eagle"])
def test_seeded_output_is_plain_with_every_step_drafting(tiny_llama_dir, method, tmp_path):
    """Fixed k (no adaptive k = 0 streaks): every step drafts through the coupled path and
    hands its noise rows to the sampler, and seeded output still equals no speculation."""
    plain = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=64)
    cfg = dict(method=method, num_speculative_tokens=3, adaptive=False)
    if method == "draft_model":
        from tests.conftest import save_tiny_llama
        save_tiny_llama(tmp_path, seed=0, num_hidden_layers=1)
        cfg["model"] = str(tmp_path)
    spec = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=64, speculative_config=cfg)
    proposer, checked = spec.engine.runner.spec.proposer, []
    propose = proposer.propose

    def checking(inp):
        """Each draft raced with the noise of the row that verifies it: output positions
        n0 .. n0 + k - 1, n0 = the tokens emitted so far."""
        drafts = propose(inp)
        for state, d in zip(inp.states, drafts):
            n0 = len(state.output_token_ids)
            assert sorted(state.drawn_noise) == list(range(n0, n0 + len(d)))
            checked.append(len(d))
        return drafts
    proposer.propose = checking
    assert seeded_outputs(spec) == seeded_outputs(plain)
    assert spec.get_stats()["spec_num_draft_tokens"] >= 40 and sum(checked) >= 40


def test_rows_past_the_noise_budget_are_drawn_again_not_kept():
    """A budget with room for one row keeps the first and only counts it; every row handed
    out is the target's noise at its (seed, position) either way."""
    from tokenmill.sample.noise_budget import NoiseBudget
    from tokenmill.sample.sampler import position_noise
    from tokenmill.spec.coupled import noise_row
    budget = NoiseBudget(V * 4)
    a, b = states([SamplingParams(temperature=1.0)] * 2, [11, 12])
    a.noise_budget = b.noise_budget = budget
    rows = [noise_row(a, 3, V, "cpu"), noise_row(b, 3, V, "cpu"), noise_row(a, 4, V, "cpu")]
    assert list(a.drawn_noise) == [3] and b.drawn_noise == {} and budget.used == V * 4
    for row, (seed, pos) in zip(rows, [(11, 3), (12, 3), (11, 4)]):
        assert torch.equal(row, position_noise(seed, pos, V, "cpu"))
    budget.recount([a, b])
    assert budget.used == V * 4
    a.drawn_noise.clear()
    budget.recount([a, b])
    assert budget.used == 0 and budget.take(V * 4)
    with pytest.raises(ValueError, match="noise budget"):
        NoiseBudget(-1)


@pytest.mark.parametrize("rows", [0, 3])
def test_seeded_output_is_plain_whatever_the_noise_budget(tiny_llama_dir, rows):
    """A budget of 0 keeps no drawn row: the sampler draws each one itself, from the same
    (seed, position). A budget of 3 rows keeps 3 a step, to the last step (it is recounted
    each step, so rows of emitted positions stop counting). The output equals no
    speculation either way."""
    prompts = [[(13 * i + 3 * j) % 380 + 3 for j in range(n)] for i, n in enumerate([6, 17, 30])]
    params = [SamplingParams(temperature=1.0, seed=300 + i, max_tokens=12, ignore_eos=True)
              for i in range(len(prompts))]

    def outputs(llm):
        return [o.outputs[0].token_ids for o in
                llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    plain = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=64)
    spec = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=64,
               speculative_config=dict(method="layer_skip", num_speculative_tokens=3, adaptive=False))
    runner = spec.engine.runner
    runner.noise_budget.max_bytes = rows * runner.vocab_size * 4
    proposer, kept = runner.spec.proposer, []
    propose = proposer.propose

    def watching(inp):
        drafts = propose(inp)
        kept.append(sum(len(state.drawn_noise) for state in inp.states))
        return drafts
    proposer.propose = watching
    assert outputs(spec) == outputs(plain)
    assert spec.get_stats()["spec_num_draft_tokens"] >= 20 and len(kept) >= 4
    assert max(kept) == rows and (rows == 0 or kept[-1] > 0)
