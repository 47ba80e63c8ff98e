"""Logprobs: chosen token first, correct ranks, log_softmax of the RAW logits."""
import pytest
import torch

from tokenmill.sample.logprobs import compute_logprobs
from tokenmill.sample.metadata import RowSamplingState, build_sampling_metadata
from tokenmill.sample.sampler import Sampler
from tokenmill.sampling_params import SamplingParams

CPU = torch.device("cpu")


def reference_row(logits: torch.Tensor, chosen: int, k: int):
    """(ids, logprobs, rank) for one row from explicit math."""
    logprobs = logits.double() - torch.logsumexp(logits.double(), dim=0)
    order = sorted(range(logits.numel()), key=lambda i: -logprobs[i].item())
    rank = 1 + sum(1 for i in range(logits.numel()) if logprobs[i] > logprobs[chosen])
    ids = [chosen] + order[:k]
    return ids, [logprobs[i].item() for i in ids], rank


@pytest.mark.parametrize("batch,vocab,k", [(5, 20, 3), (7, 400, 0), (2, 50, 20)])
def test_compute_logprobs_matches_reference(batch, vocab, k):
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    chosen = torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(1))
    out = compute_logprobs(logits, chosen, k)
    assert out.token_ids.shape == (batch, k + 1) and out.logprobs.dtype == torch.float32
    ids, values, ranks = out.tolists()
    for i in range(batch):
        want_ids, want_values, want_rank = reference_row(logits[i], chosen[i].item(), k)
        assert ids[i] == want_ids
        assert values[i] == pytest.approx(want_values, abs=1e-5)
        assert ranks[i] == want_rank


def test_sampler_logprobs_use_raw_logits():
    # Temperature, penalties, bias and top-k change what is sampled, not the reported logprobs.
    vocab = 30
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(4))
    params = [
        SamplingParams(temperature=0.0, logprobs=2, logit_bias={5: 8.0}),
        SamplingParams(temperature=0.5, top_k=3, logprobs=4, repetition_penalty=1.5),
        SamplingParams(temperature=1.2, presence_penalty=1.0),  # asks for none; still gets K columns
    ]
    rows = [RowSamplingState(p, [1, 2, 3], [4, 4], None) for p in params]
    out = Sampler()(logits, build_sampling_metadata(rows, vocab, CPU))
    lp = out.logprobs
    assert lp.token_ids.shape == (3, 5)  # K = max over rows = 4
    assert torch.equal(lp.token_ids[:, 0], out.sampled_token_ids)
    raw = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(lp.logprobs, raw.gather(1, lp.token_ids))
    assert out.sampled_token_ids[0].item() == 5  # the bias decided the greedy pick
    assert lp.ranks.tolist() == [1 + int((raw[i] > raw[i, t]).sum()) for i, t in
                                 enumerate(out.sampled_token_ids.tolist())]


def test_logprobs_zero_returns_only_the_chosen_token():
    rows = [RowSamplingState(SamplingParams(temperature=0.0, logprobs=0), [1], [], None)]
    logits = torch.randn(1, 10)
    out = Sampler()(logits, build_sampling_metadata(rows, 10, CPU))
    assert out.logprobs.token_ids.tolist() == [[logits.argmax().item()]]
    assert out.logprobs.ranks.tolist() == [1]


def test_prompt_logprobs_shape():
    # prompt_logprobs: logits at position t score prompt token t + 1.
    prompt = torch.tensor([4, 9, 2, 7])
    logits = torch.randn(3, 12)
    out = compute_logprobs(logits, prompt[1:], 2)
    assert out.token_ids[:, 0].tolist() == [9, 2, 7]
    assert out.logprobs.shape == (3, 3)
