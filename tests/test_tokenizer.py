"""Tokenizer: BOS/EOS rules, decoding, chat templates in the sandbox; HF dirs vs transformers."""

import json
import threading
import time

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from tokenmill.models.loader import load_tokenizer
from tokenmill.models.loader.gguf_tokenizer import byte_alphabet
from tokenmill.chat_template import ChatTemplateError, TemplateLimits
from tokenmill.tokenizer import Tokenizer

SPECIALS = ["<s>", "</s>", "<|eot|>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '[' + m['role'] + '] ' + m['content'] + eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


def _backend(bos_post_processor: bool) -> Backend:
    vocab = {t: i for i, t in enumerate(SPECIALS + [byte_alphabet()[b] for b in range(256)] + ["he", "ll", "Ġw"])}
    backend = Backend(models.BPE(vocab=vocab, merges=[("h", "e"), ("l", "l"), ("Ġ", "w")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    if bos_post_processor:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    return backend


def _hf_dir(tmp_path, bos_post_processor: bool, add_bos_token=None):
    _backend(bos_post_processor).save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": [{"name": "default", "template": TEMPLATE},
                                                                          {"name": "tool_use", "template": "x"}]}
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    return str(tmp_path)


TEXTS = ["hello world", "<s>hello</s> <|eot|>", "  spaces  ", "ünï 🙂", ""]


@pytest.mark.parametrize("post,add_bos", [(True, None), (False, True), (False, None)])
def test_hf_dir_matches_transformers(tmp_path, post, add_bos):
    transformers = pytest.importorskip("transformers")
    path = _hf_dir(tmp_path, post, add_bos)
    ours, ref = load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        ids = ours.encode(text)
        if add_bos and not post:
            # transformers 5's generic backend ignores add_bos_token without a post-processor;
            # we follow the model's stated wish (as transformers 4's Llama tokenizers did).
            assert ids == [0] + ref.encode(text), text
            continue
        assert ids == ref.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids)
    messages = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_special_ids_and_eos_list(tmp_path):
    tok = load_tokenizer(_hf_dir(tmp_path, True))
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (0, 1, [1, 2])
    assert tok.all_special_ids == {0, 1, 2} and tok.vocab_size == 3 + 256 + 3
    assert tok.convert_ids_to_tokens([0, 259]) == ["<s>", "he"]
    assert tok.chat_template == TEMPLATE  # the "default" of several named templates


def test_chat_template_file_wins(tmp_path):
    path = _hf_dir(tmp_path, False)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_tokenizer(path).apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


def _tok(template=TEMPLATE, add_bos=True) -> Tokenizer:
    return Tokenizer(_backend(False), bos_token_id=0, eos_token_ids=[1], add_bos_token=add_bos, chat_template=template)


def test_bos_rules():
    tok = _tok()
    assert tok.encode("hello")[0] == 0 and tok.encode("hello", add_special_tokens=False)[0] != 0
    assert _tok(add_bos=False).encode("hello")[0] != 0
    # BOS written by the template is not doubled when tokenizing the rendered chat
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True)
    assert ids[0] == 0 and ids[1] != 0 and ids.count(0) == 1


def test_chat_template_features():
    tok = _tok("{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|{{ extra }}")
    out = tok.apply_chat_template([{"role": "user", "content": "<b>é</b>"}], extra="kw")
    assert out == '[{"role": "user", "content": "<b>é</b>"}]|4|kw'  # no HTML escaping, no ASCII escaping


def test_chat_template_errors_are_value_errors():
    with pytest.raises(ValueError, match="no chat template"):
        _tok(template=None).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="roles must alternate"):
        _tok("{{ raise_exception('roles must alternate') }}").apply_chat_template([])
    with pytest.raises(ValueError, match="does not compile"):
        _tok("{% for %}").apply_chat_template([])
    # the sandbox refuses attribute access to Python internals
    with pytest.raises(ValueError):
        _tok("{{ messages.__class__.__mro__[1].__subclasses__() }}").apply_chat_template([])
    with pytest.raises(ValueError):  # immutable: templates cannot mutate the caller's messages
        _tok("{{ messages.append(1) }}").apply_chat_template([])


def test_decode_odd_ids():
    tok = _tok()
    assert tok.decode([259, 10**6, 260]) == tok.decode([259, 260])  # padded-vocab ids vanish
    with pytest.raises(ValueError, match="negative"):
        tok.decode([-1])


def test_template_errors_are_chat_template_errors_under_the_tokenizers_limits():
    tok = Tokenizer(_backend(False), chat_template="{% for i in range(50) %}{% endfor %}",
                    template_limits=TemplateLimits(max_loop_iterations=10))
    with pytest.raises(ChatTemplateError, match="more than 10 loop iterations") as e:
        tok.apply_chat_template([], tokenize=True)
    assert isinstance(e.value, ValueError)   # the server's 400 path
    with pytest.raises(ChatTemplateError, match="attribute '__class__'"):
        _tok("{% if messages.__class__ %}{% endif %}").apply_chat_template([])


def test_lone_surrogates_and_non_strings_are_clear_errors():
    tok = _tok()
    for text, code, at in (("a\ud800b", "D800", 1), ("x" * 10_000 + "\udfff", "DFFF", 10_000),
                           ("\ud83c\udf89", "D83C", 0)):   # a pair, but in a str: not text
        with pytest.raises(ValueError, match=f"surrogate code point U\\+{code} at character {at};"):
            tok.encode(text)   # short and long (encode_batch) paths
    with pytest.raises(TypeError, match="must be a string, got int"):
        tok.encode(5)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_long_texts_encode_the_same(add_special_tokens):
    tok = _tok()
    text = "hello world \x00\r\n\u2028 🎉 " * 2000   # past the encode_batch threshold
    assert tok.encode(text, add_special_tokens) == (
        [0] * add_special_tokens + tok.backend.encode(text, add_special_tokens=False).ids)


def test_encoding_a_long_text_lets_other_threads_run():
    # The backend's encode holds the GIL; a 1 MB prompt encoded in a worker thread would stop
    # the engine's thread for about a second. Progress is counted while the encode runs, so a
    # slow machine only gives the other thread more time.
    tok = _tok()
    text = "hello world " * 30_000
    ticks, done = [], threading.Event()

    def other():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)
    thread = threading.Thread(target=other)
    thread.start()
    time.sleep(0.01)
    start = time.perf_counter()
    tok.encode(text)
    end = time.perf_counter()
    done.set()
    thread.join()
    during = [t for t in ticks if start < t < end]
    assert len(during) >= 5, (len(during), end - start)
