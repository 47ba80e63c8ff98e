"""Sampler: filtering vs a per-row reference, distribution, greedy, seeds."""
import math
import random

import pytest
import torch

from tokenmill.sample.metadata import RowSamplingState, build_sampling_metadata, make_request_generator
from tokenmill.sample.penalties import apply_logits_processors
from tokenmill.sample.sampler import Sampler, filtered_probs
from tokenmill.sampling_params import SamplingParams

CPU = torch.device("cpu")


def reference_filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature -> top-k -> top-p -> min-p for one row, in float64 with explicit loops."""
    x = logits.double() / params.temperature
    vocab = x.numel()
    order = sorted(range(vocab), key=lambda i: -x[i].item())
    keep = set(order[:params.top_k]) if params.top_k > 0 else set(order)

    def probs_over(kept):
        z = torch.full((vocab,), float("-inf"), dtype=torch.float64)
        for i in kept:
            z[i] = x[i]
        return z.softmax(0)

    probs = probs_over(keep)
    if params.top_p < 1.0:  # smallest most-likely prefix whose mass reaches top_p
        kept, mass = set(), 0.0
        for i in order:
            if i in keep and mass < params.top_p:
                kept.add(i)
                mass += probs[i].item()
        keep = kept
        probs = probs_over(keep)
    if params.min_p > 0.0:
        top = probs.max().item()
        keep = {i for i in keep if probs[i].item() >= params.min_p * top}
        probs = probs_over(keep)
    return probs


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.7]),
        top_k=rng.choice([0, -1, 1, 3, vocab // 2, vocab + 5]),
        top_p=rng.choice([1.0, 0.9, 0.5, 0.05]),
        min_p=rng.choice([0.0, 0.05, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.2]),
        presence_penalty=rng.choice([0.0, 0.4]),
    )


def make_rows(params_list, vocab, seeds=None, rng=None):
    rng = rng or random.Random(0)
    rows = []
    for i, params in enumerate(params_list):
        seed = seeds[i] if seeds else None
        generator = make_request_generator(seed, CPU) if seed is not None else None
        prompt = [rng.randrange(vocab) for _ in range(5)]
        output = [rng.randrange(vocab) for _ in range(3)]
        rows.append(RowSamplingState(params, prompt, output, generator))
    return rows


@pytest.mark.parametrize("batch,vocab,seed", [(12, 30, 0), (8, 500, 1)])
def test_filtering_and_selection_match_reference(batch, vocab, seed):
    rng = random.Random(seed)
    rows = make_rows([random_params(rng, vocab) for _ in range(batch)], vocab, rng=rng)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 2
    meta = build_sampling_metadata(rows, vocab, CPU, shared_generator=torch.Generator().manual_seed(seed))
    processed = apply_logits_processors(logits, meta)
    tokens = Sampler()(logits, meta).sampled_token_ids
    random_probs = filtered_probs(processed[meta.random_rows], meta) if meta.random_row_ids else None
    for i, row in enumerate(rows):
        if row.params.is_greedy:
            assert tokens[i].item() == processed[i].argmax().item()
            continue
        want = reference_filtered_probs(processed[i], row.params)
        got = random_probs[meta.random_row_ids.index(i)]
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)
        assert want[tokens[i]].item() > 0, "sampled a token the filters removed"


def test_fast_path_all_greedy_is_argmax():
    vocab = 64
    logits = torch.randn(9, vocab)
    rows = make_rows([SamplingParams(temperature=0.0)] * 9, vocab)
    out = Sampler()(logits, build_sampling_metadata(rows, vocab, CPU))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None


# Chi-square critical values at significance 0.001 by degrees of freedom (scipy.stats.chi2.ppf(0.999, df)).
CHI2_CRIT_0001 = {3: 16.266, 4: 18.467, 5: 20.515, 7: 24.322}


def chi_square(counts: torch.Tensor, probs: torch.Tensor, num: int) -> tuple[float, int]:
    support = probs > 0
    expected = probs[support] * num
    stat = (((counts[support] - expected) ** 2) / expected).sum().item()
    return stat, int(support.sum()) - 1


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8, min_p=0.05),
])
def test_sampled_distribution_matches_softmax(params):
    # 40k draws of one 8-token distribution, batched as 40k rows; alpha = 0.001 per case.
    vocab, num = 8, 40_000
    row_logits = torch.tensor([1.2, -0.3, 0.5, 2.0, 0.0, -1.5, 0.9, 0.3])
    rows = [RowSamplingState(params, [0], [], None)] * num
    meta = build_sampling_metadata(rows, vocab, CPU, shared_generator=torch.Generator().manual_seed(123))
    tokens = Sampler()(row_logits.expand(num, vocab).contiguous(), meta).sampled_token_ids
    counts = torch.bincount(tokens, minlength=vocab).double()
    probs = reference_filtered_probs(row_logits, params)
    assert counts[probs == 0].sum() == 0, "a filtered-out token was sampled"
    stat, dof = chi_square(counts, probs, num)
    assert stat < CHI2_CRIT_0001[dof], (stat, dof)


def test_top_k_never_outside_top_k():
    vocab, num = 100, 2000
    logits = torch.randn(num, vocab, generator=torch.Generator().manual_seed(5))
    rows = make_rows([SamplingParams(temperature=2.0, top_k=4)] * num, vocab)
    meta = build_sampling_metadata(rows[:1] * num, vocab, CPU)
    tokens = Sampler()(logits, meta).sampled_token_ids
    top4 = logits.topk(4, dim=-1).indices
    assert (top4 == tokens.unsqueeze(1)).any(dim=1).all()


def test_top_k_1_and_tiny_top_p_are_argmax():
    vocab = 50
    logits = torch.randn(64, vocab)
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)):
        meta = build_sampling_metadata([RowSamplingState(params, [1], [], None)] * 64, vocab, CPU)
        assert torch.equal(Sampler()(logits, meta).sampled_token_ids, logits.argmax(-1))


def test_never_samples_zero_probability_with_extreme_logits():
    # One token dominates so everything else underflows to p == 0 after softmax.
    vocab = 1000
    logits = torch.full((256, vocab), -1e4)
    logits[:, 17] = 1e4
    meta = build_sampling_metadata([RowSamplingState(SamplingParams(temperature=0.01), [1], [], None)] * 256,
                                   vocab, CPU)
    assert (Sampler()(logits, meta).sampled_token_ids == 17).all()


def run_steps(rows, logits_per_step, device=CPU):
    sampler, out = Sampler(), []
    for logits in logits_per_step:
        meta = build_sampling_metadata(rows, logits.shape[1], device)
        out.append(sampler(logits.to(device), meta).sampled_token_ids.tolist())
    return out


def check_seeded_invariance(device):
    vocab, steps = 300, 6
    gen = torch.Generator().manual_seed(9)
    target_logits = [torch.randn(vocab, generator=gen) for _ in range(steps)]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def seeded_row(p, seed):
        return RowSamplingState(p, [1], [], make_request_generator(seed, device) if seed is not None else None)

    alone = run_steps([seeded_row(params, 1234)], [lg.unsqueeze(0) for lg in target_logits], device)
    alone = [step[0] for step in alone]
    rng = random.Random(3)
    for position, batch in [(0, 4), (3, 5), (6, 7)]:
        rows = [seeded_row(params, 1234) if i == position else
                seeded_row(random_params(rng, vocab), rng.choice([None, 77 + i])) for i in range(batch)]
        logits = []
        for lg in target_logits:
            step = torch.randn(batch, vocab, generator=gen)
            step[position] = lg
            logits.append(step)
        got = [step[position] for step in run_steps(rows, logits, device)]
        assert got == alone, (position, batch)


def test_seeded_row_is_batch_and_position_invariant():
    check_seeded_invariance(CPU)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_seeded_row_is_batch_and_position_invariant_cuda():
    check_seeded_invariance(torch.device("cuda"))


def test_different_seeds_differ_and_same_seed_repeats():
    vocab, steps = 1000, 8
    logits = [torch.zeros(1, vocab)] * steps  # uniform: any two seeds collide with prob 1e-3 per step

    def tokens(seed):
        row = RowSamplingState(SamplingParams(temperature=1.0, seed=seed), [1], [],
                               make_request_generator(seed, CPU))
        return [s[0] for s in run_steps([row], logits)]

    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2)
    assert tokens(-5) != tokens(5)
    assert tokens(2**63 - 1) == tokens(2**63 - 1)


def test_seeded_uniform_draws_are_roughly_uniform():
    # Guards against a noise bug that would bias seeded rows (e.g. clamping to a constant).
    vocab, num = 4, 4000
    rows = [RowSamplingState(SamplingParams(temperature=1.0, seed=s), [1], [], make_request_generator(s, CPU))
            for s in range(num)]
    tokens = Sampler()(torch.zeros(num, vocab), build_sampling_metadata(rows, vocab, CPU)).sampled_token_ids
    counts = torch.bincount(tokens, minlength=vocab).double()
    stat, dof = chi_square(counts, torch.full((vocab,), 1 / vocab, dtype=torch.float64), num)
    assert stat < CHI2_CRIT_0001[dof]
    assert math.isfinite(stat)


def test_the_argmax_it_is_given_picks_every_token():
    """Greedy rows and the random rows' race both go through the Sampler's argmax: the C
    kernel the runner passes on CPU gives the same tokens as torch's, seeded rows included."""
    from tokenmill.layers import cpu_ops
    if not cpu_ops.available():
        pytest.skip("the CPU kernels do not run here")
    rng, vocab = random.Random(7), 3000
    params = [random_params(rng, vocab) for _ in range(10)]
    calls = []

    def counted(x):
        calls.append(x.shape)
        return cpu_ops.argmax_rows(x)
    logits = torch.randn(10, vocab, generator=torch.Generator().manual_seed(7)) * 3

    def sample(argmax):
        rows = make_rows(params, vocab, seeds=list(range(10)), rng=random.Random(1))
        meta = build_sampling_metadata(rows, vocab, CPU)
        return Sampler(argmax)(logits, meta).sampled_token_ids
    assert torch.equal(sample(counted), sample(Sampler().argmax))
    assert len(calls) == 2   # the random rows' race, then every row's argmax
