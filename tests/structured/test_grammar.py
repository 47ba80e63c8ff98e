"""Grammar compiler and matchers on SmolLM2's real tokenizer (llguidance underneath)."""
import json
import re

import numpy as np
import pytest

from tokenmill.structured.grammar import fill_bitmasks
from tokenmill.structured.params import StructuredOutputsParams as S


def allowed_ids(row: np.ndarray) -> set[int]:
    return set(np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0].tolist())


def greedy_walk(compiler, tok, spec, text):
    """Feed ``text``'s tokens through a fresh matcher; each must be allowed by the mask."""
    matcher = compiler.compile(spec).new_matcher()
    for token in tok.encode(text, add_special_tokens=False):
        assert token in allowed_ids(fill_bitmasks([(matcher, [])], compiler.words_per_row)[0])
        assert matcher.accept(token)
    return matcher


def test_choice_masks_and_termination(compiler, smollm2_tokenizer):
    tok = smollm2_tokenizer
    matcher = greedy_walk(compiler, tok, S(choice=["yes", "no"]), "yes")
    assert matcher.is_terminated
    last = fill_bitmasks([(matcher, [])], compiler.words_per_row)[0]
    assert allowed_ids(last) == {tok.eos_token_id}    # only the end may follow


def test_json_schema_accepts_a_valid_document_and_refuses_others(compiler, smollm2_tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    matcher = greedy_walk(compiler, smollm2_tokenizer, S(json=schema), '{"n":42}')
    assert matcher.is_terminated
    fresh = compiler.compile(S(json=schema)).new_matcher()
    bad = smollm2_tokenizer.encode('{"m":1}', add_special_tokens=False)
    assert fresh.valid_prefix(bad) < len(bad)


def test_bitmask_rows_follow_the_drafts_and_leave_the_matcher_in_place(compiler, smollm2_tokenizer):
    tok = smollm2_tokenizer
    compiled = compiler.compile(S(regex=r"ab[0-9]{2}"))
    drafts = tok.encode("ab12", add_special_tokens=False)
    matcher = compiled.new_matcher()
    rows = fill_bitmasks([(matcher, drafts)], compiler.words_per_row)
    assert rows.shape == (len(drafts) + 1, compiler.words_per_row)
    reference = compiled.new_matcher()
    for j, token in enumerate(drafts):   # row j = the mask after drafts[:j]
        expected = fill_bitmasks([(reference, [])], compiler.words_per_row)[0]
        assert np.array_equal(rows[j], expected)
        assert reference.accept(token)
    assert allowed_ids(rows[-1]) == {tok.eos_token_id}
    # the matcher did not move: its next mask is still the first row
    assert np.array_equal(fill_bitmasks([(matcher, [])], compiler.words_per_row)[0], rows[0])


def test_refused_draft_leaves_the_rest_all_allowed(compiler, smollm2_tokenizer):
    tok = smollm2_tokenizer
    matcher = compiler.compile(S(regex=r"[0-9]+")).new_matcher()
    drafts = tok.encode("1x2", add_special_tokens=False)
    assert matcher.valid_prefix(drafts) < len(drafts)
    rows = fill_bitmasks([(matcher, drafts)], compiler.words_per_row)
    assert (rows[matcher.valid_prefix(drafts) + 1:] == -1).all()
    assert matcher.error is None     # a refused draft never breaks the matcher


@pytest.mark.parametrize("spec, message", [
    (S(regex="a(b"), "structured_outputs.regex: invalid regular expression"),
    (S(json={"type": "foo"}), "structured_outputs.json: invalid JSON schema"),
    (S(json={"$ref": "#/definitions/missing"}), "structured_outputs.json: invalid JSON schema"),
    (S(grammar="start: undefined_rule"), "structured_outputs.grammar: invalid grammar"),
])
def test_invalid_constraints_are_value_errors_naming_them(compiler, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compiler.compile(spec)


def test_gbnf_and_lark_grammars(compiler, smollm2_tokenizer):
    gbnf = 'root ::= "(" [0-9]+ ")"'
    assert greedy_walk(compiler, smollm2_tokenizer, S(grammar=gbnf), "(12)").is_terminated
    lark = 'start: "x" NUM\nNUM: /[0-9]/'
    assert greedy_walk(compiler, smollm2_tokenizer, S(grammar=lark), "x7").is_terminated


def test_compile_cache_hits_and_every_matcher_is_independent(smollm2_tokenizer):
    from tokenmill.structured.grammar import GrammarCompiler
    compiler = GrammarCompiler(smollm2_tokenizer, smollm2_tokenizer.vocab_size, cache_size=2)
    spec = S(json=json.dumps({"type": "boolean"}))
    first = compiler.compile(spec)
    assert compiler.compile(S(json={"type": "boolean"})) is first
    assert (compiler.num_compiled, compiler.num_cache_hits) == (1, 1)
    a, b = first.new_matcher(), first.new_matcher()
    assert a.accept(smollm2_tokenizer.encode("true", add_special_tokens=False)[0])
    assert not np.array_equal(fill_bitmasks([(a, [])], compiler.words_per_row),
                              fill_bitmasks([(b, [])], compiler.words_per_row))
    compiler.compile(S(regex="a")), compiler.compile(S(regex="b"))   # evicts the oldest
    assert compiler.compile(spec) is not first
