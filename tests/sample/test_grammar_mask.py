"""Grammar bitmasks in the sampler, against a plain boolean-mask reference."""
import torch

from tokenmill.sample.grammar_mask import apply_token_bitmask, bitmask_rows
from tokenmill.sample.metadata import RowSamplingState, build_sampling_metadata
from tokenmill.sample.sampler import Sampler
from tokenmill.sampling_params import SamplingParams
from tokenmill.sched.output import GrammarBitmask


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """[N, V] bool -> [N, ceil(V / 32)] int32 words, bit t % 32 of word t // 32."""
    n, vocab = allowed.shape
    words = (vocab + 31) // 32
    bits = torch.zeros(n, words * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    packed = (bits.view(n, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def test_apply_matches_a_boolean_reference():
    torch.manual_seed(0)
    for vocab in (31, 32, 33, 1000):
        allowed = torch.rand(5, vocab) < 0.2
        allowed[:, vocab - 1] = True          # the top bit of a word (sign bit) too
        logits = torch.randn(5, vocab)
        expected = logits.masked_fill(~allowed, float("-inf"))
        apply_token_bitmask(logits, pack(allowed))
        assert torch.equal(logits, expected)


def test_whole_word_masks_and_a_few_mixed_words_match_the_reference():
    """The fast path: words all-banned / all-allowed plus a few mixed ones, and a partial
    last word (vocabularies that are not a multiple of 32)."""
    torch.manual_seed(1)
    for vocab in (64, 1000, 49152 + 7):
        words = (vocab + 31) // 32
        kind = torch.randint(0, 10, (4, words))                 # mostly whole words
        allowed = torch.zeros(4, words * 32, dtype=torch.bool)
        allowed.view(4, words, 32)[kind < 5] = True             # all-allowed words
        mixed = kind == 9
        allowed.view(4, words, 32)[mixed] = torch.rand(int(mixed.sum()), 32) < 0.5
        allowed = allowed[:, :vocab]
        logits = torch.randn(4, vocab)
        expected = logits.masked_fill(~allowed, float("-inf"))
        apply_token_bitmask(logits, pack(allowed))
        assert torch.equal(logits, expected)


def test_rows_follow_the_sampler_order_with_free_rows_for_unconstrained_requests():
    allowed = torch.rand(3, 70) < 0.5
    packed = pack(allowed)
    # request "b" owns rows 0-1 (one draft), "d" row 2
    bitmask = GrammarBitmask(["b", "d"], [0, 2], packed.shape[1], packed.numpy().tobytes())
    rows = bitmask_rows(bitmask, ["a", "b", "b", "c", "d"], "cpu")
    assert torch.equal(rows[1:3], packed[:2]) and torch.equal(rows[4], packed[2])
    assert (rows[0] == -1).all() and (rows[3] == -1).all()
    assert bitmask_rows(None, ["a"], "cpu") is None


def test_sampling_never_picks_a_banned_token_even_with_a_bias_towards_it():
    vocab = 50
    allowed = torch.zeros(4, vocab, dtype=torch.bool)
    allowed[:, 10:13] = True
    favourite = {0: 100.0}   # a huge bias on a banned token
    params = [SamplingParams(temperature=0.0, logit_bias=favourite),
              SamplingParams(temperature=1.0, seed=3, logit_bias=favourite),
              SamplingParams(temperature=1.0, top_k=2),
              SamplingParams(temperature=0.7, top_p=0.5, repetition_penalty=1.3)]
    rows = [RowSamplingState(p, [1, 2], [0], None) for p in params]
    for trial in range(20):
        meta = build_sampling_metadata(rows, vocab, "cpu", torch.Generator().manual_seed(trial),
                                       token_bitmask=pack(allowed))
        sampled = Sampler()(torch.randn(4, vocab), meta).sampled_token_ids
        assert ((sampled >= 10) & (sampled < 13)).all()


def test_a_complete_grammar_wins_over_min_tokens():
    """The grammar allows only EOS (it is complete); min_tokens bans EOS: the row keeps EOS."""
    vocab, eos = 40, 2
    only_eos = torch.zeros(2, vocab, dtype=torch.bool)
    only_eos[:, eos] = True
    params = [SamplingParams(temperature=0.0, min_tokens=5).with_engine_stops(eos),
              SamplingParams(temperature=1.0, min_tokens=5).with_engine_stops(eos)]
    rows = [RowSamplingState(p, [1], [7], None) for p in params]
    meta = build_sampling_metadata(rows, vocab, "cpu", torch.Generator().manual_seed(0),
                                   token_bitmask=pack(only_eos))
    assert Sampler()(torch.randn(2, vocab), meta).sampled_token_ids.tolist() == [eos, eos]
