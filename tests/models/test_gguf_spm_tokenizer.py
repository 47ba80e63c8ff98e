"""A GGUF SentencePiece ("llama") tokenizer for a non-Gemma model encodes and decodes like
sentencepiece itself.

The oracle is a small SentencePiece BPE model trained here with the settings Llama-2 and
Mistral use (identity normalization, spaces kept, dummy prefix, byte fallback, split digits,
whitespace-only pieces); its pieces, scores and types are written into a tiny llama GGUF the
way llama.cpp's converter writes them. Text containing a control token's spelling is compared
with sentencepiece per segment between those tokens, because engines (llama.cpp with
parse_special, transformers) read "<s>" in text as the token -- chat templates rely on it --
and start each segment after one with the dummy-prefix space, as llama.cpp does.

transformers 5's LlamaTokenizer is not used as a second oracle: its Metaspace pre-tokenizer
(prepend_scheme="first") skips the dummy prefix when a text already starts with a space and
after a special token, so it disagrees with sentencepiece and llama.cpp on those texts.
"""

import io
import random
import re

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
spm = pytest.importorskip("sentencepiece")
from sentencepiece import sentencepiece_model_pb2  # noqa: E402

from tokenmill.models.loader import CheckpointError, load_tokenizer, open_checkpoint  # noqa: E402
from tokenmill.models.loader.gguf_reader import GGUFFile  # noqa: E402
from tokenmill.models.loader.gguf_tokenizer import gguf_tokenizer  # noqa: E402

HIDDEN, HEADS, FFN = 32, 2, 48
TEMPLATE = "{% for m in messages %}{{ bos_token }}[INST] {{ m['content'] }} [/INST]{% endfor %}"
SYLLABLES = ["ka", "to", "ri", "mu", "ne", "sa", "lo", "pe", "qui", "str", "é", "ü", "ñ", "ça", "ß",
             "ло", "ве", "ми", "ра", "γε", "λα", "日", "本", "語", "東", "京", "中", "文"]


def _corpus(rng: random.Random) -> list[str]:
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(400)]
    ends = ["", ".", "!", "  ", "\t", " ?", "   x", " 1984", "\n"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + rng.choice(ends)
            for _ in range(4000)]


def _train(vocab_size: int, byte_fallback: bool) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus(random.Random(0))), model_writer=model, model_type="bpe",
        vocab_size=vocab_size, byte_fallback=byte_fallback, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True, add_dummy_prefix=True, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, minloglevel=2)
    return model.getvalue()


@pytest.fixture(scope="module")
def spm_proto() -> bytes:
    return _train(600, byte_fallback=True)


@pytest.fixture(scope="module")
def sp(spm_proto):
    return spm.SentencePieceProcessor(model_proto=spm_proto)


def _piece_type(sp, i: int) -> int:
    """llama.cpp's token type of a sentencepiece piece (convert_hf_to_gguf's mapping)."""
    if sp.is_unknown(i):
        return 2
    if sp.is_control(i):
        return 3
    if sp.is_unused(i):
        return 5
    return 6 if sp.is_byte(i) else 1


def write_spm_gguf(path, sp, extra_kv=None, model_name="llama", order=None) -> str:
    """A one-layer llama GGUF (float32, loadable by open_checkpoint) carrying ``sp``'s
    vocabulary; file id j holds sentencepiece's piece ``order[j]`` (default: the same ids)."""
    num_tokens = sp.get_piece_size()
    order = list(range(num_tokens)) if order is None else order
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1); w.add_embedding_length(HIDDEN); w.add_feed_forward_length(FFN)  # noqa: E702
    w.add_head_count(HEADS); w.add_head_count_kv(HEADS); w.add_rope_freq_base(10000.0)  # noqa: E702
    w.add_layer_norm_rms_eps(1e-5); w.add_context_length(128); w.add_rope_dimension_count(HIDDEN // HEADS)  # noqa: E702
    w.add_tokenizer_model(model_name)
    w.add_token_list([sp.id_to_piece(i) for i in order])
    w.add_token_scores([sp.get_score(i) for i in order])
    w.add_token_types([_piece_type(sp, i) for i in order])
    file_id = {sp_id: j for j, sp_id in enumerate(order)}.__getitem__
    w.add_bos_token_id(file_id(sp.bos_id())); w.add_eos_token_id(file_id(sp.eos_id()))  # noqa: E702
    w.add_unk_token_id(file_id(sp.unk_id())); w.add_pad_token_id(file_id(sp.eos_id()))  # noqa: E702
    w.add_chat_template(TEMPLATE)
    for key, value in (extra_kv or {}).items():
        w.add_bool(key, value)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (num_tokens, HIDDEN), "output_norm.weight": (HIDDEN,),
              "output.weight": (num_tokens, HIDDEN), "blk.0.attn_norm.weight": (HIDDEN,),
              "blk.0.ffn_norm.weight": (HIDDEN,), "blk.0.ffn_gate.weight": (FFN, HIDDEN),
              "blk.0.ffn_up.weight": (FFN, HIDDEN), "blk.0.ffn_down.weight": (HIDDEN, FFN),
              **{f"blk.0.attn_{x}.weight": (HIDDEN, HIDDEN) for x in ("q", "k", "v", "output")}}
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    return str(path)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory, sp):
    return write_spm_gguf(tmp_path_factory.mktemp("spm") / "tiny-llama-spm.gguf", sp)


@pytest.fixture(scope="module")
def tok(gguf_path):
    return load_tokenizer(gguf_path)


def reference_ids(sp, text: str) -> list[int]:
    """sentencepiece's ids with control / unknown spellings read as their tokens."""
    specials = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)]
    ids = []
    for part in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
        ids += [sp.piece_to_id(part)] if part in specials else sp.encode(part) if part else []
    return ids


TEXTS = [
    "", " ", "  ", "   ", "\n", "\t", "x", "kato rimune salo", "katorimune", " kato", "  kato", "kato ",
    "kato  ", "kato   rimune    salo", "  leading and trailing  ", "line one\nline two\n\nthree",
    "tab\tseparated\t\tvalues", "\t\tindented\n    code", "café naïve über straße façade",
    "ñandú pingüino", "日本語 東京 中文", "東京タワー", "中文字符测试", "привет мир", "γειά σου κόσμε",
    "emoji 😀🎉 ok", "🙂", "👩‍👩‍👧 family", "mixed 東京café😀ложка", "12345 2024 3.14159", "007",
    "Ω≈ç√∫ ±∞", "<s>", "</s>", "<unk>", "<s> hi </s>", "a<s>b", "x</s>", "<s><s>", "[INST] kato [/INST]",
    "Hello, World! How are you?", "\r\n windows \r\n", "\u00a0nbsp\u3000ideographic space",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_sentencepiece(tok, sp, text):
    ref = reference_ids(sp, text)
    assert tok.encode(text, add_special_tokens=False) == ref
    assert tok.encode(text) == [sp.bos_id()] + ref     # add_bos_token absent: BOS, as llama.cpp
    assert tok.convert_ids_to_tokens(ref) == [sp.id_to_piece(i) for i in ref]
    # skip_special_tokens drops <unk> too, as transformers does; sentencepiece writes " ⁇ "
    assert tok.decode([sp.bos_id()] + ref) == sp.decode([i for i in ref if i != sp.unk_id()])
    if not re.search("<s>|</s>|<unk>", text):  # identity normalization: text comes back exactly
        assert tok.decode(ref) == text


def test_random_texts_match_sentencepiece(tok, sp):
    rng = random.Random(1)
    pool = SYLLABLES + list("abcxyz019") + [" ", "  ", "\t", "\n", "😀", "Ж", "é", "✓", "\x00", "\x7f"]
    for _ in range(500):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(0, 40)))
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == sp.decode(ids) == text


def test_merges_and_byte_fallback_are_exercised(tok, sp):
    # guards the comparisons above against a vocabulary too small to test anything
    ids = tok.encode("kato rimune 日本語 😀", add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert any(len(p) > 2 for p in pieces)                     # multi-character merges
    assert [p for p in pieces if p.startswith("<0x")] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert ids == sp.encode("kato rimune 日本語 😀")


def test_merges_follow_scores_not_ids(tmp_path, sp):
    # sentencepiece numbers merged pieces by score, so in file order ids and scores agree;
    # shuffled ids show the merge order comes from the scores
    rng = random.Random(2)
    normal = [i for i in range(sp.get_piece_size()) if _piece_type(sp, i) == 1]
    shuffled = rng.sample(normal, len(normal))
    order = list(range(sp.get_piece_size()))
    for sp_id, new in zip(normal, shuffled):
        order[sp_id] = new
    tok = load_tokenizer(write_spm_gguf(tmp_path / "shuffled.gguf", sp, order=order))
    file_id = {sp_id: j for j, sp_id in enumerate(order)}
    for text in TEXTS + _corpus(random.Random(3))[:300]:
        ref = [file_id[i] for i in reference_ids(sp, text)]
        assert tok.encode(text, add_special_tokens=False) == ref, text
        assert tok.decode(ref) == sp.decode([i for i in reference_ids(sp, text) if i != sp.unk_id()])


def test_unused_pieces_are_merged_through(tmp_path, spm_proto):
    """UNUSED pieces are built like normal ones (llama.cpp); sentencepiece builds them too and
    only splits one that survives to the output, so texts without a survivor agree exactly."""
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(spm_proto)
    for piece in proto.pieces:
        if piece.piece in ("str", "st", "▁to", "▁γε"):
            piece.type = sentencepiece_model_pb2.ModelProto.SentencePiece.UNUSED
    sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    unused = {i for i in range(sp.get_piece_size()) if sp.is_unused(i)}
    assert len(unused) == 4
    tok = load_tokenizer(write_spm_gguf(tmp_path / "unused.gguf", sp))
    texts = [t for t in _corpus(random.Random(4))[:400] if "str" in t]
    clean = 0
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        if not unused & set(ids):
            assert ids == sp.encode(text), text
            clean += 1
    assert clean > 50   # enough texts where "▁str..." is built through the unused "str"


def test_without_byte_pieces_unknown_characters_become_unk(tmp_path):
    sp = spm.SentencePieceProcessor(model_proto=_train(300, byte_fallback=False))
    tok = load_tokenizer(write_spm_gguf(tmp_path / "no-bytes.gguf", sp))
    for text in ("kato 😀😀 x", "😀", "ab 😀q😀", "Zz", "kato"):
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text), text  # runs fused, as sentencepiece
    assert sp.unk_id() in sp.encode("😀")


def test_special_tokens_and_template(tok, sp):
    assert tok.vocab_size == sp.get_piece_size()
    assert (tok.bos_token_id, tok.eos_token_ids, tok.unk_token_id, tok.pad_token_id) == (1, [2], 0, 2)
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    assert {0, 1, 2} <= tok.all_special_ids
    assert tok.decode([1, 2, 0], skip_special_tokens=False) == "<s></s><unk>"
    assert tok.chat_template == TEMPLATE
    ids = tok.apply_chat_template([{"role": "user", "content": "kato"}], tokenize=True)
    assert ids == reference_ids(sp, "<s>[INST] kato [/INST]") and ids[0] == sp.bos_id()


def test_flags_from_metadata(tmp_path, sp, spm_proto):
    tok = gguf_tokenizer(GGUFFile(write_spm_gguf(tmp_path / "flags.gguf", sp, {
        "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True})))
    assert tok.encode("kato ri") == sp.encode("kato ri") + [sp.eos_id()]
    assert tok.encode("") == [sp.eos_id()]

    # add_space_prefix = false: compare with the same model whose dummy prefix is switched off
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(spm_proto)
    proto.normalizer_spec.add_dummy_prefix = False
    bare = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    tok = gguf_tokenizer(GGUFFile(write_spm_gguf(tmp_path / "bare.gguf", sp, {
        "tokenizer.ggml.add_space_prefix": False})))
    for text in ("kato rimune", " kato", "  x  ", "日本語😀", "a\nb"):
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == bare.encode(text) != sp.encode(text), text
        assert tok.decode(ids) == bare.decode(ids) == text


def test_gguf_opens_as_a_checkpoint(gguf_path, sp):
    cfg = open_checkpoint(gguf_path).hf_config
    assert cfg["model_type"] == "llama" and cfg["vocab_size"] == sp.get_piece_size()


@pytest.mark.parametrize("model_name", ["t5", "bert", "rwkv"])
def test_unsupported_tokenizer_model_is_a_clear_error(tmp_path, sp, model_name):
    path = write_spm_gguf(tmp_path / f"{model_name}.gguf", sp, model_name=model_name)
    with pytest.raises(CheckpointError, match=f"tokenizer model '{model_name}'.*not supported"):
        gguf_tokenizer(GGUFFile(path))


def test_scores_of_the_wrong_length_are_rejected(tmp_path, sp):
    path = tmp_path / "short-scores.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
    w.add_token_scores([0.0, 1.0])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    with pytest.raises(CheckpointError, match="tokenizer.ggml.scores"):
        gguf_tokenizer(GGUFFile(str(path)))
