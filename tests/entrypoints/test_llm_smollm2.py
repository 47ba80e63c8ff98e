"""The real default model: tokenmill's greedy continuations equal HF transformers (float32,
same GGUF) token for token, with logprobs within 1e-3. The HF outputs are stored in
tests/data/smollm2_reference.json (see tests/models/smollm2_reference.py)."""
import json

import pytest

from tokenmill import LLM, SamplingParams
from tests.models.smollm2_reference import REFERENCE_PATH


@pytest.fixture(scope="module")
def smollm2():
    from tokenmill.models.hub import resolve_model
    try:
        path = resolve_model("smollm2-135m")
    except Exception as e:  # no network and no cache
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")
    return LLM(model=path, num_kv_blocks=256, max_model_len=1024)


@pytest.fixture(scope="module")
def reference():
    with open(REFERENCE_PATH) as f:
        return json.load(f)["entries"]


@pytest.mark.slow
def test_greedy_64_tokens_equal_hf(smollm2, reference):
    tok = smollm2.get_tokenizer()
    for e in reference:
        assert tok.encode(e["prompt"]) == e["prompt_token_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=0)
    outs = smollm2.generate([{"prompt_token_ids": e["prompt_token_ids"]} for e in reference],
                            params, use_tqdm=False)
    for e, out in zip(reference, outs):
        c = out.outputs[0]
        assert c.token_ids == e["token_ids"], e["prompt"]
        got = [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)]
        assert max(abs(a - b) for a, b in zip(got, e["logprobs"])) < 1e-3
    mem = smollm2.get_memory_stats()
    assert mem["num_free_blocks"] == mem["num_total_blocks"]


def test_chat_and_stop_string(smollm2):
    out = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text and out.finish_reason == "stop"
    stopped = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0.0, max_tokens=32, stop=["Paris"]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "Paris"
    assert stopped.text == out.text[:out.text.index("Paris")]


@pytest.mark.slow
def test_live_hf_still_matches_stored_reference(reference):
    """The stored reference is not trusted blindly: recompute the first 16 tokens live."""
    from tokenmill.models.hub import resolve_model
    from tests.models.smollm2_reference import hf_continuation, load_hf
    model, _ = load_hf(resolve_model("smollm2-135m"))
    e = reference[0]
    tokens, logprobs = hf_continuation(model, e["prompt_token_ids"], 16)
    assert tokens == e["token_ids"][:16]
