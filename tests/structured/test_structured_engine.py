"""Structured outputs through the whole engine: every output follows its grammar, and the
engine's promises (batching, chunked prefill, preemption, prefix caching, n > 1, speculative
decoding) change no token of a constrained request."""
import json
import re

import jsonschema
import pytest

from tokenmill import LLM, SamplingParams

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                  "maxItems": 4}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
# Greedy on a random model falls into loops over a list like this: n-gram drafts then hit.
LOOPY = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 30,
         "maxItems": 30}
PROMPTS = ["Describe a person as JSON.", "Hello there", "a b c a b c a b c", "{\"name\":"]


def texts(outputs):
    return [c.text for o in outputs for c in o.outputs]


def token_ids(outputs):
    return [c.token_ids for o in outputs for c in o.outputs]


def constrained(**fields):
    return SamplingParams(max_tokens=400, structured_outputs=fields)


def test_json_schema_outputs_are_valid_at_temperature_one_with_n(tiny_llm):
    params = constrained(json=PERSON).clone(temperature=1.0, n=3, seed=7)
    outputs = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    for o in outputs:
        assert len(o.outputs) == 3
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), PERSON)


def test_json_object_regex_and_choice(tiny_llm):
    # Any object is unbounded: a bias towards closing tokens lets a random model finish
    # (the grammar alone decides validity; the bias only shortens the strings).
    tok = tiny_llm.get_tokenizer()
    closers = {t: 8.0 for s in ('"', '}', '"}', '":', ',"') for t in tok.encode(s, add_special_tokens=False)}
    params = constrained(json_object=True).clone(temperature=1.0, seed=1, logit_bias=closers)
    for c in (c for o in tiny_llm.generate(PROMPTS, params, use_tqdm=False) for c in o.outputs):
        assert c.finish_reason == "stop" and isinstance(json.loads(c.text), dict)
    pattern = r"(ab|cd)[0-9]{2,4}-[A-Z]"
    for text in texts(tiny_llm.generate(PROMPTS, constrained(regex=pattern).clone(temperature=1.0),
                                        use_tqdm=False)):
        assert re.fullmatch(pattern, text), text
    choices = ["red", "green", "dark blue"]
    for text in texts(tiny_llm.generate(PROMPTS * 3, constrained(choice=choices).clone(temperature=1.0),
                                        use_tqdm=False)):
        assert text in choices


def test_constrained_and_free_requests_share_a_batch_without_changing_each_other(tiny_llm):
    free = SamplingParams(temperature=0.0, max_tokens=24)
    json_params = constrained(json=PERSON).clone(temperature=0.0)
    alone_free = token_ids(tiny_llm.generate(PROMPTS, free, use_tqdm=False))
    alone_json = token_ids(tiny_llm.generate(PROMPTS, json_params, use_tqdm=False))
    mixed = tiny_llm.generate(PROMPTS + PROMPTS, [free] * 4 + [json_params] * 4, use_tqdm=False)
    assert token_ids(mixed) == alone_free + alone_json


def test_speculation_changes_no_token_under_a_grammar(tiny_structured_dir, tiny_llm):
    """Greedy and seeded outputs identical with and without n-gram drafts, and drafts were
    accepted (rejected ones rolled back the grammar through the mask rows)."""
    spec = LLM(model=tiny_structured_dir, max_model_len=2048, num_kv_blocks=1024,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_min": 1})
    for params in (constrained(json=LOOPY).clone(temperature=0.0),
                   constrained(json=PERSON).clone(temperature=0.0),
                   constrained(json=LOOPY).clone(temperature=1.0, seed=11),
                   constrained(regex=r"(ab|ba){8,20}").clone(temperature=0.8, seed=3)):
        plain = token_ids(tiny_llm.generate(PROMPTS, params, use_tqdm=False))
        assert token_ids(spec.generate(PROMPTS, params, use_tqdm=False)) == plain
    stats = spec.llm_engine.get_stats()["spec_decode"]
    assert stats["num_accepted_tokens"] > 0


def test_a_lookahead_drafter_under_a_grammar_changes_no_token(tiny_structured_dir, tiny_llm):
    """layer_skip writes draft KV ahead of the sequence; drafts the grammar refuses are
    replaced by forced tokens or dropped, and its cache bookkeeping must survive that."""
    spec = LLM(model=tiny_structured_dir, max_model_len=2048, num_kv_blocks=1024,
               speculative_config={"method": "layer_skip", "num_speculative_tokens": 3,
                                   "num_layers": 1})
    for params in (constrained(json=PERSON).clone(temperature=0.0),
                   constrained(json=LOOPY).clone(temperature=1.0, seed=3)):
        plain = token_ids(tiny_llm.generate(PROMPTS, params, use_tqdm=False))
        assert token_ids(spec.generate(PROMPTS, params, use_tqdm=False)) == plain


def test_chunked_prefill_preemption_and_prefix_hits_change_no_token(tiny_structured_dir, tiny_llm):
    params = constrained(json=PERSON).clone(temperature=0.0, n=2, max_tokens=120)
    seeded = constrained(json=LOOPY).clone(temperature=1.0, seed=5, max_tokens=120)
    long_prompts = [p * 6 for p in PROMPTS]
    reference = token_ids(tiny_llm.generate(long_prompts, params, use_tqdm=False)) + \
        token_ids(tiny_llm.generate(long_prompts, seeded, use_tqdm=False))
    # 16-token chunks, and a pool too small for every sequence at once: preemption
    squeezed = LLM(model=tiny_structured_dir, max_model_len=2048, num_kv_blocks=16,
                   max_num_batched_tokens=16, max_num_seqs=8)
    outputs = squeezed.generate(long_prompts * 2, [params] * 4 + [seeded] * 4, use_tqdm=False)
    assert token_ids(outputs) == reference
    assert squeezed.llm_engine.scheduler.num_preemptions > 0
    again = tiny_llm.generate(long_prompts[:1], params, use_tqdm=False)   # prefix-cache hit
    assert again[0].num_cached_tokens > 0
    assert token_ids(again) == reference[:2]


def test_invalid_constraint_is_refused_and_the_engine_goes_on(tiny_llm):
    with pytest.raises(ValueError, match="structured_outputs.json: invalid JSON schema"):
        tiny_llm.generate(["x"], constrained(json={"type": "object", "properties": {"a": {"type": 3}}}),
                          use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        tiny_llm.generate(["x"], constrained(regex="[a-"), use_tqdm=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()
    assert texts(tiny_llm.generate(["x"], constrained(choice=["ok"]), use_tqdm=False)) == ["ok"]


@pytest.mark.distributed
def test_tensor_parallel_ranks_apply_the_same_masks(tiny_structured_dir, tiny_llm):
    """The step's masks cross the wire to every rank (SchedulerOutput.grammar_bitmask), so a
    TP=2 engine emits exactly the one-process tokens, greedy and seeded."""
    params = [constrained(json=PERSON).clone(temperature=0.0),
              constrained(json=LOOPY).clone(temperature=1.0, seed=2)]
    expected = token_ids(tiny_llm.generate(PROMPTS[:2], params, use_tqdm=False))
    split = LLM(model=tiny_structured_dir, max_model_len=2048, num_kv_blocks=256,
                tensor_parallel_size=2)
    try:
        assert token_ids(split.generate(PROMPTS[:2], params, use_tqdm=False)) == expected
    finally:
        split.llm_engine.shutdown()


def test_forced_tokens_verified_as_drafts_change_no_token_and_save_steps(tiny_structured_dir, tiny_llm):
    """Keys of a schema are forced by the grammar: scheduled as drafts, verified in one forward
    (max_forced_drafts, on by default). Same tokens as one token per step, greedy and seeded,
    in fewer steps."""
    one_by_one = LLM(model=tiny_structured_dir, max_model_len=2048, num_kv_blocks=1024,
                     max_forced_drafts=0)
    verbose = {"type": "object", "additionalProperties": False,
               "required": ["a_rather_long_property_name", "another_long_property_name"],
               "properties": {"a_rather_long_property_name": {"type": "boolean"},
                              "another_long_property_name": {"enum": ["first value", "second"]}}}
    for params in (constrained(json=verbose).clone(temperature=0.0),
                   constrained(json=PERSON).clone(temperature=1.0, seed=4, n=2)):
        before = (tiny_llm.llm_engine.stats.num_steps, one_by_one.llm_engine.stats.num_steps)
        forced = token_ids(tiny_llm.generate(PROMPTS, params, use_tqdm=False))
        assert token_ids(one_by_one.generate(PROMPTS, params, use_tqdm=False)) == forced
        steps = (tiny_llm.llm_engine.stats.num_steps - before[0],
                 one_by_one.llm_engine.stats.num_steps - before[1])
        assert steps[0] < steps[1]
    counts = tiny_llm.llm_engine.get_stats()["structured_outputs"]
    assert 0 < counts["num_forced_accepted_tokens"] <= counts["num_forced_draft_tokens"]
    assert counts["num_requests"]["json"] >= 12 and counts["num_compiled"] >= 2
    assert one_by_one.llm_engine.get_stats()["structured_outputs"]["num_forced_draft_tokens"] == 0


@pytest.mark.distributed
def test_data_parallel_replicas_follow_the_grammar(tiny_structured_dir, tiny_llm):
    """The constraint crosses to replica processes inside SamplingParams (msgpack); the front
    refuses a bad one before any replica sees it."""
    params = constrained(json=PERSON).clone(temperature=0.0)
    expected = token_ids(tiny_llm.generate(PROMPTS, params, use_tqdm=False))
    replicas = LLM(model=tiny_structured_dir, max_model_len=2048, num_kv_blocks=256,
                   data_parallel_size=2)
    try:
        assert token_ids(replicas.generate(PROMPTS, params, use_tqdm=False)) == expected
        with pytest.raises(ValueError, match="structured_outputs.regex"):
            replicas.generate(["x"], constrained(regex="(("), use_tqdm=False)
    finally:
        replicas.llm_engine.shutdown()
