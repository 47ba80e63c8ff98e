"""IncrementalDetokenizer on a real byte-level BPE tokenizer trained here on a few sentences.

The tiny vocabulary splits accented letters, CJK and emoji across several tokens, which is what
the incremental decoder has to get right.
"""
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.sampling_params import SamplingParams

CORPUS = [
    "Hello world, the end is near. The weather is nice today!",
    "Café crème brûlée à la française, naïve façade",
    "日本語のテキストと中文文本",
    "emoji 🎉🚀 party 👩‍💻 time",
    "Stop here STOP! or maybe not; ending soon.",
]
WORDS = ["hello", "world", " ", "the", "end", "STOP", "!", "é", "crème", "日本語", "中文", "🎉", "🚀",
         "👩‍💻", "ñ", "\n", "is", "near", "ß", "Ω", "x"]


class ByteLevelTokenizer:
    """Adapter exposing the engine's tokenizer interface over a `tokenizers` BPE model.

    Counts decoded ids so tests can check that decoding cost per step stays bounded.
    """

    def __init__(self):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(CORPUS * 5, trainer)
        self._tok = tok
        self.all_special_ids = {tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_start|>")}
        self.eos_token_id = tok.token_to_id("<|endoftext|>")
        self.im_start_id = tok.token_to_id("<|im_start|>")
        self.vocab_size = tok.get_vocab_size()
        self.max_decode_len = 0

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.max_decode_len = max(self.max_decode_len, len(ids))
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [self._tok.id_to_token(i) for i in ids]


@pytest.fixture(scope="module")
def tok():
    return ByteLevelTokenizer()


def stream(detok, ids, rng=None, chunk=1, stop_token_hit=False):
    """Feed ids in chunks; return (deltas, stop string). Deltas end with the finish delta."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3) if rng else chunk
        part = ids[i:i + n]
        i += n
        stop = detok.update(part, stop_token_hit and i >= len(ids))
        if stop is not None:
            break
        deltas.append(detok.get_delta(finished=False))
    deltas.append(detok.get_delta(finished=True))
    return deltas, detok.stop_string


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))


def test_equals_full_decode_on_random_text(tok):
    rng = random.Random(0)
    prompt = tok.encode("Hello world: ")
    longest = 0
    for _ in range(150):
        ids = tok.encode(random_text(rng))
        detok = IncrementalDetokenizer(tok, SamplingParams(), prompt)
        tok.max_decode_len = 0
        deltas, _ = stream(detok, ids, rng=rng)
        # sliding window: previous + current segment, each <= 16 pending tokens + a chunk of 3;
        # never the whole output (which reaches well past 40 tokens here).
        assert tok.max_decode_len <= 2 * (16 + 3)
        longest = max(longest, len(ids))
        assert detok.output_text == tok.decode(ids)
        assert "".join(deltas) == detok.output_text
        # valid text: no streamed delta may carry half a character
        assert all("\ufffd" not in d for d in deltas)
    assert longest > 80


def test_equals_full_decode_on_random_token_ids(tok):
    # Arbitrary ids produce invalid UTF-8 too (lone continuation bytes, cut sequences).
    rng = random.Random(1)
    normal_ids = [i for i in range(tok.vocab_size) if i not in tok.all_special_ids]
    for _ in range(300):
        ids = [rng.choice(normal_ids) for _ in range(rng.randint(1, 40))]
        prompt = [rng.choice(normal_ids) for _ in range(rng.randint(0, 8))]
        detok = IncrementalDetokenizer(tok, SamplingParams(), prompt)
        deltas, _ = stream(detok, ids, rng=rng)
        assert detok.output_text == tok.decode(ids)
        assert "".join(deltas) == detok.output_text


def test_prompt_ending_mid_character_decodes_output_alone(tok):
    ids = tok.encode("🎉 done")
    assert tok.decode(ids[:1]).endswith("\ufffd")  # the emoji is split across tokens
    prompt = tok.encode("party ") + ids[:1]
    detok = IncrementalDetokenizer(tok, SamplingParams(), prompt)
    stream(detok, ids[1:])
    assert detok.output_text == tok.decode(ids[1:])


def test_unicode_split_across_tokens_is_held_until_complete(tok):
    ids = tok.encode("a🚀b")
    assert len(ids) > 3
    detok = IncrementalDetokenizer(tok, SamplingParams(), [])
    deltas, _ = stream(detok, ids)
    assert "".join(deltas) == "a🚀b"
    assert all("\ufffd" not in d for d in deltas)


def test_trailing_incomplete_character_released_at_finish(tok):
    ids = tok.encode("ok 🎉")[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tok, SamplingParams(), [])
    deltas, _ = stream(detok, ids)
    assert detok.output_text == tok.decode(ids) and detok.output_text.endswith("\ufffd")
    assert "\ufffd" not in "".join(deltas[:-1]) and deltas[-1].endswith("\ufffd")


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunk", [1, 2, 50])
def test_stop_string_across_token_boundaries(tok, include, chunk):
    text = "Hello world, the end is near. The weather"
    ids = tok.encode(text)
    pieces = [tok.decode([i]) for i in ids]
    assert "end is" not in pieces  # the stop string spans several tokens
    params = SamplingParams(stop=["xyz", "end is"], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tok, params, tok.encode("Q: "))
    deltas, stop = stream(detok, ids, chunk=chunk)
    assert stop == "end is"
    want = "Hello world, the end is" if include else "Hello world, the "
    assert detok.output_text == want
    assert "".join(deltas) == want


def test_no_partial_stop_string_leaks_while_streaming(tok):
    text = "the STO end STOP! never shown"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["STOP!"]), [])
    streamed = ""
    for i, token in enumerate(ids):
        stop = detok.update([token], False)
        streamed += detok.get_delta(finished=stop is not None)
        assert "the STO end ".startswith(streamed), streamed  # only text that survives the stop
        if stop:
            break
    assert stop == "STOP!" and streamed == detok.output_text == "the STO end "


def test_earliest_stop_wins_when_many_tokens_arrive_at_once(tok):
    ids = tok.encode("one two three four")
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["four", "two"]), [])
    assert detok.update(ids, False) == "two"
    assert detok.output_text == "one "
    assert detok.update(tok.encode(" more"), False) is None  # finished: ignored
    assert detok.get_delta(finished=True) == "one "


def test_stop_token_text_is_not_emitted(tok):
    ids = tok.encode("the end") + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, SamplingParams(skip_special_tokens=False), [])
    deltas, stop = stream(detok, ids, chunk=2, stop_token_hit=True)
    assert stop is None
    assert detok.output_text == "the end" == "".join(deltas)


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("hi") + [tok.im_start_id] + tok.encode(" there")
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, SamplingParams(skip_special_tokens=skip), [])
        deltas, _ = stream(detok, ids)
        assert detok.output_text == tok.decode(ids, skip_special_tokens=skip) == "".join(deltas)


def test_long_undecodable_run_keeps_window_bounded(tok):
    # A lone UTF-8 continuation byte never completes a character; 40 of them in a row must not
    # make every step re-decode the whole run.
    lone = next(i for i in range(tok.vocab_size)
                if tok.decode([i]) == "\ufffd" and tok.decode([i, i, i, i, i]) == "\ufffd" * 5)
    ids = [lone] * 40 + tok.encode(" ok")
    detok = IncrementalDetokenizer(tok, SamplingParams(), [])
    tok.max_decode_len = 0
    deltas, _ = stream(detok, ids)
    assert tok.max_decode_len <= 2 * (16 + 1)
    assert detok.output_text == "".join(deltas) == tok.decode(ids)
