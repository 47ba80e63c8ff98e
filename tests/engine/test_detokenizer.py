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


# -- SmolLM2's byte-level BPE (every byte has a token): characters split into byte tokens ---------
@pytest.fixture(scope="module")
def smollm2():
    from tokenmill.models.hub import resolve_model
    from tokenmill.models.loader import load_tokenizer
    try:
        return load_tokenizer(resolve_model("smollm2-135m"))
    except Exception as e:  # no network and no cache
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")


def byte_tokens(tok, data: bytes) -> list[int]:
    from tokenmill.models.loader.gguf_tokenizer import byte_alphabet
    return [tok.token_to_id(byte_alphabet()[b]) for b in data]


def check_stream(tok, ids, rng=None, chunk=1, prompt=(), params=None):
    """Stream ids; the text must equal decode(ids), and the deltas must join to it without a
    U+FFFD that decode(ids) does not have at that place (a half character shown too early)."""
    detok = IncrementalDetokenizer(tok, params or SamplingParams(), list(prompt))
    deltas, stop = stream(detok, ids, rng=rng, chunk=chunk)
    assert "".join(deltas) == detok.output_text
    if stop is None:
        assert detok.output_text == tok.decode(ids)
    return deltas


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_byte_split_characters_stream_whole(smollm2, chunk):
    # CJK and emoji written byte by byte, as a byte-level model may sample them, arriving in
    # speculative-decoding-sized chunks: the window often never ends at a character boundary.
    text = "日本語のテキスト🎉🚀é中文👩‍💻Ω" * 3
    ids = byte_tokens(smollm2, text.encode())
    deltas = check_stream(smollm2, ids, chunk=chunk)
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)


def test_split_character_after_a_long_undecodable_run(smollm2):
    # 15-16 garbage bytes used to be committed together with the first byte of the emoji
    # after them, which then came out as U+FFFD instead of 🎉.
    for run in range(12, 20):
        ids = byte_tokens(smollm2, b"\x80" * run + "🎉".encode()) + smollm2.encode(" ok", False)
        deltas = check_stream(smollm2, ids)
        assert "".join(deltas) == "\ufffd" * run + "🎉 ok"


def test_garbage_and_split_characters_mixed(smollm2):
    rng = random.Random(7)
    pieces = [lambda: byte_tokens(smollm2, bytes([rng.choice([0x80, 0xbf, 0xf0, 0xe2, 0xc3])])
                                  * rng.randint(1, 30)),
              lambda: byte_tokens(smollm2, rng.choice(["🎉", "日本", "é", "👩‍💻"]).encode())
              * rng.randint(1, 6),
              lambda: smollm2.encode(rng.choice([" hi", "abc", "\n", " 🎉x"]), False)]
    for _ in range(300):
        ids = [i for _ in range(rng.randint(1, 10)) for i in rng.choice(pieces)()]
        check_stream(smollm2, ids, rng=rng)


def test_invalid_utf8_is_replacement_characters(smollm2):
    cases = {b"ok\x80done": "ok\ufffddone",          # a lone continuation byte
             b"\xf0abc": "\ufffdabc",                 # a lead byte cut short by ASCII
             b"\xe6\x97": "\ufffd",                   # a character cut by the end of the output
             b"\xed\xa0\x80": "\ufffd" * 3}           # UTF-8 for a surrogate: invalid
    for data, want in cases.items():
        ids = byte_tokens(smollm2, data)
        for chunk in (1, 2, len(ids)):
            assert "".join(check_stream(smollm2, ids, chunk=chunk)) == want


def test_prompt_ending_in_half_a_character(smollm2):
    prompt = smollm2.encode("party ", False) + byte_tokens(smollm2, "🎉".encode()[:2])
    ids = byte_tokens(smollm2, "🎉".encode()[2:]) + smollm2.encode(" done", False)
    detok = IncrementalDetokenizer(smollm2, SamplingParams(), prompt)
    stream(detok, ids)
    assert detok.output_text == smollm2.decode(ids) == "\ufffd\ufffd done"


@pytest.mark.parametrize("stop", ["🎉", "\x00", "\r\n", "\u2028", "日本"])
def test_stop_strings_of_split_and_control_characters(smollm2, stop):
    text = f"before{stop}after"
    ids = byte_tokens(smollm2, text.encode())
    for include in (False, True):
        params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(smollm2, params, [])
        deltas, found = stream(detok, ids)
        assert found == stop and "".join(deltas) == detok.output_text
        assert detok.output_text == ("before" + stop if include else "before")


class ByteFallbackTokenizer:
    """SentencePiece-style decoding: byte tokens <0xNN> whose runs are decoded as a whole, so
    a run ending mid-character is all U+FFFD, complete characters before the cut included."""

    def __init__(self):
        vocab = {"<unk>": 0}
        vocab.update({f"<0x{b:02X}>": 1 + b for b in range(256)})
        vocab.update({w: 257 + i for i, w in enumerate(["▁hi", "▁there", "abc", "\n"])})
        self._tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        self._tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                               decoders.Fuse()])
        self.vocab = vocab

    def ids(self, *parts) -> list[int]:
        """Words by name, other text as byte tokens."""
        return [i for p in parts for i in ([self.vocab[p]] if p in self.vocab else
                                           [1 + b for b in p.encode()])]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_byte_fallback_characters_in_multi_token_steps(chunk):
    # A step of several tokens (speculative decoding) ending inside a character used to lose
    # the complete characters of the same byte run to U+FFFD.
    tok = ByteFallbackTokenizer()
    rng = random.Random(chunk)
    parts = ["日本語", "🎉", "é", "👩‍💻", "▁hi", "▁there", "abc", "\n"]
    for _ in range(100):
        ids = tok.ids(*(rng.choice(parts) for _ in range(rng.randint(1, 12))))
        deltas = check_stream(tok, ids, chunk=chunk, prompt=tok.ids("▁hi"))
        assert not any("\ufffd" in d for d in deltas)
