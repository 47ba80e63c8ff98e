"""Rejection sampler: exact in distribution (chi-square, significance 1e-3, fixed seeds), a
wrong rule (recover from p instead of the residual) fails the same test, greedy fast path,
seeded point drafts reproduce plain sampling, logprobs of emitted tokens."""
import torch

from tokenmill.sample.metadata import RowSamplingState, build_sampling_metadata, make_request_generator
from tokenmill.sample.rejection import (RejectionSampler, accepted_prefix_lengths, target_probs,
                                        _draft_rows)
from tokenmill.sample.sampler import Sampler
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.exactness import chi_square_gof

ALPHA = 1e-3          # significance level of every goodness-of-fit test here
V = 6
NUM = 20_000          # requests per test


def row_logits():
    # Row 0: after the newest token; row 1: after draft 1; row 2: bonus row.
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, V, generator=g) * 1.5


def make_meta(num_rows, params, generators=None):
    gens = generators or [None] * num_rows
    rows = [RowSamplingState(params, [1], [], g) for g in gens]
    return build_sampling_metadata(rows, V, "cpu", torch.Generator().manual_seed(1))


def batch(drafts_per_req, params=SamplingParams(temperature=1.0)):
    """NUM requests with k = 2 drafts each; returns logits [3 * NUM, V], meta."""
    logits = row_logits().repeat(NUM, 1)
    return logits, make_meta(3 * NUM, params)


def first_two_token_checks(tokens, drafts, p):
    """Token 1 ~ p_0; token 2 given token 1 == x_1 ~ p_1 (rows see x_1 in their context)."""
    first = torch.tensor([t[0] for t in tokens])
    r1 = chi_square_gof(torch.bincount(first, minlength=V), p[0])
    second = torch.tensor([t[1] for t, d in zip(tokens, drafts) if t[0] == d[0] and len(t) > 1])
    r2 = chi_square_gof(torch.bincount(second, minlength=V), p[1])
    return r1, r2


def test_point_drafts_match_target_distribution():
    logits, meta = batch(None)
    p = target_probs(row_logits(), make_meta(3, SamplingParams(temperature=1.0)))
    drafts = [[int(p[0].argmax()), int(p[1].argmin())]] * (NUM // 2) + [[2, 3]] * (NUM // 2)
    out = RejectionSampler()(logits, meta, drafts)
    r1, r2 = first_two_token_checks(out.token_ids, drafts, p)
    assert r1.passed(ALPHA) and r2.passed(ALPHA), (r1, r2)
    assert all(1 <= len(t) <= 3 for t in out.token_ids)


def sample_prob_drafts(seed=3):
    g = torch.Generator().manual_seed(seed)
    q_rows = torch.softmax(torch.randn(2, V, generator=g) * 2.0, dim=-1)   # draft model's q_1, q_2
    x = torch.multinomial(q_rows, NUM, replacement=True, generator=g).T    # [NUM, 2]
    drafts = x.tolist()
    draft_probs = q_rows.repeat(NUM, 1)                                    # [2 * NUM, V]
    return drafts, draft_probs


def test_probability_drafts_match_target_distribution():
    logits, meta = batch(None)
    p = target_probs(row_logits(), make_meta(3, SamplingParams(temperature=1.0)))
    drafts, draft_probs = sample_prob_drafts()
    out = RejectionSampler()(logits, meta, drafts, draft_probs)
    r1, r2 = first_two_token_checks(out.token_ids, drafts, p)
    assert r1.passed(ALPHA) and r2.passed(ALPHA), (r1, r2)
    assert 0 < sum(out.num_accepted) < 2 * NUM


def wrong_rule(p, drafts, draft_probs, gen):
    """The mistake: accept with min(1, p/q) but on rejection resample from p, not the residual."""
    tokens = []
    x = torch.tensor(drafts)
    q1 = draft_probs[0::2]
    p_x, q_x = p[0][x[:, 0]], q1.gather(1, x[:, :1]).squeeze(1)
    accept = torch.rand(len(drafts), generator=gen) * q_x <= p_x
    resample = torch.multinomial(p[0], len(drafts), replacement=True, generator=gen)
    first = torch.where(accept, x[:, 0], resample)
    return first


def test_wrong_rule_fails_the_same_test():
    p = target_probs(row_logits(), make_meta(3, SamplingParams(temperature=1.0)))
    drafts, draft_probs = sample_prob_drafts()
    first = wrong_rule(p, drafts, draft_probs, torch.Generator().manual_seed(5))
    result = chi_square_gof(torch.bincount(first, minlength=V), p[0])
    assert not result.passed(ALPHA), result


def test_filters_and_penalties_shape_p():
    params = SamplingParams(temperature=0.7, top_k=3, top_p=0.9, presence_penalty=0.5)
    logits = row_logits().repeat(NUM, 1)
    rows = [RowSamplingState(params, [1], [2] if i % 3 else [], None) for i in range(3 * NUM)]
    meta = build_sampling_metadata(rows, V, "cpu", torch.Generator().manual_seed(1))
    ref_rows = rows[:3]
    p = target_probs(row_logits(), build_sampling_metadata(ref_rows, V, "cpu"))
    drafts = [[2, 4]] * NUM
    out = RejectionSampler()(logits, meta, drafts)
    first = torch.tensor([t[0] for t in out.token_ids])
    assert set(first.tolist()) <= set(torch.nonzero(p[0]).flatten().tolist())   # filtered stay out
    assert chi_square_gof(torch.bincount(first, minlength=V), p[0]).passed(ALPHA)


def test_greedy_accepts_while_argmax_matches():
    logits = torch.tensor([[0, 5, 0, 0, 0, 0], [0, 0, 5, 0, 0, 0], [0, 0, 0, 5, 0, 0.]] * 3)
    meta = make_meta(9, SamplingParams(temperature=0.0))
    out = RejectionSampler()(logits, meta, [[1, 2], [1, 4], [0, 2]])
    assert out.token_ids == [[1, 2, 3], [1, 2], [1]]
    assert out.num_accepted == [2, 1, 0]


def test_mixed_k_including_zero():
    logits = torch.tensor([[0, 5, 0, 0, 0, 0.], [0, 0, 5, 0, 0, 0], [0, 0, 0, 5, 0, 0]])
    meta = make_meta(3, SamplingParams(temperature=0.0))
    out = RejectionSampler()(logits, meta, [[], [2]])   # rows: req 0 -> row 0; req 1 -> rows 1, 2
    assert out.token_ids == [[1], [2, 3]] and out.row_starts == [0, 1]


def test_seeded_point_drafts_emit_the_plain_sampler_tokens():
    params = SamplingParams(temperature=1.0, seed=11)
    logits = row_logits()
    seeds = [101, 102, 103]
    plain = [Sampler()(logits[i:i + 1], make_meta(1, params, [make_request_generator(s, "cpu")]))
             .sampled_token_ids.item() for i, s in enumerate(seeds)]
    for drafts in ([plain[0], plain[1]], [plain[0], (plain[1] + 1) % V], [(plain[0] + 1) % V, 0]):
        meta = make_meta(3, params, [make_request_generator(s, "cpu") for s in seeds])
        out = RejectionSampler()(logits, meta, [drafts])
        a = out.num_accepted[0]
        assert out.token_ids[0] == plain[:a + 1]


def test_logprobs_are_of_emitted_tokens():
    params = SamplingParams(temperature=0.0, logprobs=1)
    logits = torch.tensor([[0, 5, 0, 0, 0, 0], [0, 0, 5, 0, 0, 0], [0, 0, 0, 5, 0, 0.]])
    out = RejectionSampler()(logits, make_meta(3, params), [[1, 4]])
    ids, lps, _ = out.logprobs.tolists()
    assert out.token_ids == [[1, 2]]
    assert ids[0][0] == 1 and ids[1][0] == 2
    ref = torch.log_softmax(logits, -1)
    assert abs(lps[1][0] - ref[1, 2].item()) < 1e-6


def test_prefix_lengths_vectorised():
    rows, mask = _draft_rows([3, 0, 2], "cpu")
    accepted = torch.tensor([[1, 0, 1], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    assert accepted_prefix_lengths(accepted, mask).tolist() == [1, 0, 2]
