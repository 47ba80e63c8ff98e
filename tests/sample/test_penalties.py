"""Logits processors (bias, min_tokens, penalties) against a plain per-row reference."""
import random

import pytest
import torch

from tokenmill.sample.metadata import RowSamplingState, build_sampling_metadata
from tokenmill.sample.penalties import apply_logits_processors
from tokenmill.sample.sampler import Sampler
from tokenmill.sampling_params import SamplingParams

CPU = torch.device("cpu")
EOS = 3


def reference_process_row(logits: torch.Tensor, params: SamplingParams, prompt: list[int],
                          output: list[int]) -> torch.Tensor:
    """One row, token by token, straight from the definitions."""
    x = logits.clone()
    for token_id, bias in (params.logit_bias or {}).items():
        x[token_id] += bias
    if len(output) < params.min_tokens:
        for token_id in params.all_stop_token_ids:
            x[token_id] = float("-inf")
    if params.repetition_penalty != 1.0:
        for token_id in set(prompt) | set(output):
            value = x[token_id]
            x[token_id] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token_id in set(output):
        x[token_id] -= params.frequency_penalty * output.count(token_id) + params.presence_penalty
    return x


def random_row(rng: random.Random, vocab: int) -> RowSamplingState:
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
    output = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
    bias = {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(rng.choice([0, 0, 3]))}
    params = SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.0]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
        presence_penalty=rng.choice([0.0, 0.5, -0.7]),
        frequency_penalty=rng.choice([0.0, 0.3, -1.1]),
        logit_bias=bias or None,
        min_tokens=rng.choice([0, 4, 10]),
        max_tokens=20,
        stop_token_ids=[rng.randrange(vocab)],
    ).with_engine_stops(EOS)
    return RowSamplingState(params, prompt, output, None)


@pytest.mark.parametrize("batch,vocab,seed", [(6, 40, 0), (17, 1000, 1), (3, 7, 2)])
def test_processors_match_reference(batch, vocab, seed):
    rng = random.Random(seed)
    rows = [random_row(rng, vocab) for _ in range(batch)]
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    meta = build_sampling_metadata(rows, vocab, CPU)
    got = apply_logits_processors(logits, meta)
    want = torch.stack([reference_process_row(logits[i], r.params, r.prompt_token_ids, r.output_token_ids)
                        for i, r in enumerate(rows)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    assert got.data_ptr() != logits.data_ptr()  # raw logits untouched for logprobs


def test_no_processing_returns_same_tensor():
    rows = [RowSamplingState(SamplingParams(temperature=0.0), [1, 2], [3], None)]
    logits = torch.randn(1, 10)
    meta = build_sampling_metadata(rows, 10, CPU)
    assert apply_logits_processors(logits, meta) is logits


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_blocks_eos(temperature):
    vocab = 12
    params = SamplingParams(temperature=temperature, min_tokens=5, stop_token_ids=[7]).with_engine_stops(EOS)
    logits = torch.randn(64, vocab)
    logits[:, EOS] = 50.0  # EOS would win every time without min_tokens
    logits[:, 7] = 49.0
    below = [RowSamplingState(params, [1], [2, 2], None) for _ in range(64)]
    tokens = Sampler()(logits, build_sampling_metadata(below, vocab, CPU)).sampled_token_ids
    assert not ((tokens == EOS) | (tokens == 7)).any()
    reached = [RowSamplingState(params, [1], [2] * 5, None) for _ in range(64)]
    tokens = Sampler()(logits, build_sampling_metadata(reached, vocab, CPU)).sampled_token_ids
    assert ((tokens == EOS) | (tokens == 7)).all()


def test_ignore_eos_is_not_masked_by_min_tokens():
    # with ignore_eos EOS is not a stop id, so min_tokens leaves it alone (it is ordinary text).
    params = SamplingParams(temperature=0.0, min_tokens=5, ignore_eos=True).with_engine_stops(EOS)
    logits = torch.zeros(1, 8)
    logits[0, EOS] = 10.0
    meta = build_sampling_metadata([RowSamplingState(params, [1], [], None)], 8, CPU)
    assert Sampler()(logits, meta).sampled_token_ids.item() == EOS
