"""The scheduler's side of grammars: masks only for requests that sample this step (k + 1
rows with k drafts), drafts trimmed to what the grammar accepts, the grammar stepped over every
emitted token, and a token outside the grammar failing its request alone."""
import numpy as np

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.distributed import serial
from tokenmill.outputs import ModelRunnerOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams
from tokenmill.kv.layout import KVLayout
from tokenmill.sched.scheduler import Scheduler
from tokenmill.structured.grammar import fill_bitmasks
from tokenmill.structured.params import StructuredOutputsParams as S


def make_sched(budget=8):
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
                     CacheConfig(block_size=4, enable_prefix_caching=True), KVLayout.single(64),
                     max_model_len=256)


def request(rid, prompt_len, compiler, spec, tok):
    params = SamplingParams(max_tokens=20, structured_outputs=spec).with_engine_stops(tok.eos_token_id)
    grammar = compiler.compile(params.structured_outputs).new_matcher() if spec else None
    return Request(rid, list(range(10, 10 + prompt_len)), params, 20, grammar=grammar)


def step(sched, sampled: dict[str, list[int]], drafts: dict[str, list[int]] = None):
    so = sched.schedule()
    out = ModelRunnerOutput(list(so.num_scheduled_tokens),
                            [sampled.get(r, []) for r in so.num_scheduled_tokens],
                            draft_token_ids=drafts or {})
    sched.update_from_output(so, out)
    return so


def test_masks_only_for_rows_that_sample(compiler, smollm2_tokenizer):
    tok = smollm2_tokenizer
    sched = make_sched(budget=8)
    sched.add_request(request("json", 12, compiler, S(json={"type": "boolean"}), tok))
    sched.add_request(request("free", 3, compiler, None, tok))
    first = step(sched, {"free": [5]})         # json's prompt is mid-chunk: no mask for it
    assert first.grammar_bitmask is None
    second = step(sched, {})                   # json's last chunk: it samples, one mask row
    mask = second.grammar_bitmask
    assert mask.req_ids == ["json"] and mask.row_starts == [0]
    row = np.frombuffer(mask.data, dtype=np.int32).reshape(-1, mask.words_per_row)
    allowed = np.nonzero(np.unpackbits(row[0].view(np.uint8), bitorder="little"))[0]
    assert {tok.decode([int(t)]) for t in allowed} <= {"t", "tr", "tru", "true", "f", "fa",
                                                      "fal", "fals", "false"}
    again = serial.decode(serial.encode(second))   # how tensor-parallel ranks receive it
    assert again.grammar_bitmask == mask


def test_drafts_are_trimmed_and_get_one_mask_row_each(compiler, smollm2_tokenizer):
    tok = smollm2_tokenizer
    sched = make_sched(budget=64)
    req = request("r", 4, compiler, S(regex=r"[0-9]{6}"), tok)
    sched.add_request(req)
    one, two, letter = (tok.encode(s, add_special_tokens=False)[0] for s in ("1", "2", "x"))
    step(sched, {"r": [one]}, drafts={"r": [two, one, letter, two]})
    assert req.spec_token_ids == [two, one]          # the grammar refuses "x" and what follows
    so = sched.schedule()
    mask = so.grammar_bitmask
    assert so.scheduled_spec_token_ids["r"] == [two, one]
    rows = np.frombuffer(mask.data, dtype=np.int32).reshape(-1, mask.words_per_row)
    assert rows.shape[0] == 3
    fresh = compiler.compile(req.sampling_params.structured_outputs).new_matcher()
    assert fresh.accept(one)
    assert np.array_equal(rows, fill_bitmasks([(fresh, [two, one])], mask.words_per_row))


def test_a_token_outside_the_grammar_fails_only_its_request(compiler, smollm2_tokenizer):
    tok = smollm2_tokenizer
    sched = make_sched(budget=64)
    bad = request("bad", 4, compiler, S(choice=["yes"]), tok)
    good = request("good", 4, compiler, S(choice=["no"]), tok)
    sched.add_request(bad), sched.add_request(good)
    no = tok.encode("no", add_special_tokens=False)
    step(sched, {"bad": no[:1], "good": no[:1]})
    assert bad.status == RequestStatus.FINISHED_ERROR and "outside the request's grammar" in bad.error
    assert good.status == RequestStatus.RUNNING and good.grammar.is_terminated
    step(sched, {"good": [tok.eos_token_id]})
    assert good.status == RequestStatus.FINISHED_STOPPED


def test_forced_tokens_become_drafts_unless_the_proposer_agrees_and_goes_further(compiler, smollm2_tokenizer):
    tok = smollm2_tokenizer
    sched = make_sched(budget=64)
    schema = {"type": "object", "properties": {"population": {"type": "integer"}},
              "required": ["population"], "additionalProperties": False}
    req = request("r", 4, compiler, S(json=schema), tok)
    sched.add_request(req)
    first = tok.encode('{"', add_special_tokens=False)
    forced = compiler.compile(req.sampling_params.structured_outputs).new_matcher()
    assert forced.accept(first[0])
    expected = forced.forced_tokens(8)
    assert tok.decode(expected).startswith("population")
    step(sched, {"r": first[:1]})                              # no proposer: forced drafts
    assert req.spec_token_ids == expected
    assert sched.schedule().scheduled_spec_token_ids["r"] == expected


def test_no_drafts_for_a_request_that_did_not_sample(compiler, smollm2_tokenizer):
    tok = smollm2_tokenizer
    sched = make_sched(budget=4)
    req = request("r", 12, compiler, S(json={"type": "object"}), tok)
    sched.add_request(req)
    step(sched, {})                                            # a mid-prompt chunk
    assert req.spec_token_ids == []
