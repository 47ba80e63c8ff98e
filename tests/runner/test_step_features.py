"""The runner's StepFeatures (spec/draft_input.py): every verified position of every request
gets exactly one feature row (prefill chunks, decode steps, the accepted part of verify
runs), the rows are the decoder layers' outputs at those positions, and the one-call C stack
captures the same bits as the modules."""
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers import native
from tokenmill.runner import fused_stack

PROMPTS = [[(7 * i + 3 * j) % 380 + 3 for j in range(n)] for i, n in enumerate([5, 19, 2, 33])]
LAYERS = (0, 2)


class RecordingProposer:
    """Drafts the reference continuation for the first ``right`` positions, then a wrong
    token (so verify runs accept some drafts and reject others); records every feature."""

    needs_lookahead = False
    aux_layers = LAYERS

    def __init__(self, ref: dict, right: int = 2) -> None:
        self.ref, self.right, self.calls = ref, right, []

    def propose(self, inp):
        f = inp.features
        self.calls.append([(r, s, c, list(t), f.rows_of(i).clone())
                           for i, (r, s, c, t) in enumerate(zip(f.req_ids, f.starts, f.counts,
                                                                f.token_ids))])
        out = []
        for state, k in zip(inp.states, inp.num_drafts):
            cont = self.ref[tuple(state.prompt_token_ids)]
            n = len(state.output_token_ids)
            out.append([cont[min(n + j, len(cont) - 1)] if j < self.right else
                        (cont[min(n + j, len(cont) - 1)] + 1) % 384 for j in range(k)])
        return out

    def drop(self, req_ids):
        pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.conftest import save_tiny_llama
    path = tmp_path_factory.mktemp("tiny_llama_l3")
    save_tiny_llama(path, num_hidden_layers=3)
    return str(path)


def _greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _run_recording(model_dir, ref, fused: bool, monkeypatch, layers=LAYERS, **kw):
    if not fused:
        monkeypatch.setattr(fused_stack, "forward", lambda *a, **k: None)
    llm = LLM(model=model_dir, skip_tokenizer_init=True, num_kv_blocks=128, block_size=4,
              speculative_config=dict(method="ngram", num_speculative_tokens=3, adaptive=False), **kw)
    proposer = RecordingProposer(ref)
    proposer.aux_layers = layers
    llm.engine.runner.spec.proposer = proposer
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(12), use_tqdm=False)
    monkeypatch.undo()
    return [o.outputs[0].token_ids for o in outs], proposer.calls


def _by_request(calls) -> dict:
    """req_id -> {position: (token, feature row)}; fails if a position is delivered twice."""
    seen: dict = {}
    for call in calls:
        for req_id, start, count, tokens, rows in call:
            assert len(tokens) == count == rows.shape[0]
            for j in range(count):
                assert start + j not in seen.setdefault(req_id, {}), "a position delivered twice"
                seen[req_id][start + j] = (tokens[j], rows[j])
    return seen


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model=model_dir, skip_tokenizer_init=True, num_kv_blocks=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(12), use_tqdm=False)
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, outs)}


def test_every_verified_position_gets_its_layer_outputs_once(model_dir, reference, monkeypatch):
    outs, calls = _run_recording(model_dir, reference, False, monkeypatch,
                                 max_num_batched_tokens=16, enable_prefix_caching=False)
    assert outs == [reference[tuple(p)] for p in PROMPTS]   # drafting stays exact
    seen = _by_request(calls)
    assert len(seen) == len(PROMPTS)
    # each request's sequence, recomputed as one prompt: its layer outputs by position
    recorder = RecordingProposer(reference)
    llm = LLM(model=model_dir, skip_tokenizer_init=True, num_kv_blocks=128,
              speculative_config=dict(method="ngram", num_speculative_tokens=1, adaptive=False))
    llm.engine.runner.spec.proposer = recorder
    full = [p + reference[tuple(p)] for p in PROMPTS]
    llm.generate([{"prompt_token_ids": s} for s in full], _greedy(1), use_tqdm=False)
    truth = _by_request(recorder.calls)
    for positions in seen.values():
        # the newest token is verified in the step after; the last output is never computed
        seq = next(s for s in full if all(s[p] == t for p, (t, _) in positions.items()))
        assert sorted(positions) == list(range(len(seq) - 1))
        want = next(v for v in truth.values() if len(v) == len(seq) and
                    all(v[p][0] == seq[p] for p in v))
        for p, (token, row) in positions.items():
            assert row.shape == (2 * 64,)
            torch.testing.assert_close(row, want[p][1], atol=1e-3, rtol=1e-4)   # SDPA vs the decode kernel


@pytest.mark.skipif(not native.buildable(), reason="no C compiler, or a CPU without AVX2")
@pytest.mark.parametrize("layers", [LAYERS, (1, 0, 2), (1,)])
def test_the_c_stack_captures_the_modules_bits(model_dir, reference, monkeypatch, layers):
    used = []
    real = fused_stack.forward

    def counting(*args, **kw):
        out = real(*args, **kw)
        used.append(out is not None)
        return out
    monkeypatch.setattr(fused_stack, "forward", counting)
    fused_outs, fused_calls = _run_recording(model_dir, reference, True, monkeypatch, layers,
                                             enable_prefix_caching=False)
    plain_outs, plain_calls = _run_recording(model_dir, reference, False, monkeypatch, layers,
                                             enable_prefix_caching=False)
    assert any(used), "the C stack never ran"
    assert fused_outs == plain_outs
    a, b = _by_request(fused_calls), _by_request(plain_calls)
    assert a.keys() == b.keys()
    for req_id in a:
        assert a[req_id].keys() == b[req_id].keys()
        for p in a[req_id]:
            assert a[req_id][p][1].shape == (len(layers) * 64,)
            assert torch.equal(a[req_id][p][1], b[req_id][p][1])
