"""Real SmolLM2-135M (float32): for every method, greedy output with speculation is identical
to without, on 8 prompts run as one mixed batch (random heads for Medusa / EAGLE; draft_model
is a 6-layer copy of the target)."""
import pytest

from tokenmill import LLM, SamplingParams

PROMPTS = [
    "The capital of France is", "Write a short poem about the sea.",
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox",
    "def fibonacci(n):", "List three prime numbers:", "1, 2, 3, 4, 5,",
    "Explain photosynthesis in one sentence.",
    "Copy this sentence twice: Tokens are cheap when they are guessed well.",
]
METHODS = ["ngram", "layer_skip", "draft_model", "medusa", "eagle"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tokenmill.models.hub import resolve_model
    try:
        path = resolve_model("smollm2-135m")
    except Exception as e:   # no network and no cache
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")
    plain = LLM(model=path, num_kv_blocks=128, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    from tokenmill.spec.shallow import save_shallow_copy
    draft = save_shallow_copy(plain.engine.model, 6, str(tmp_path_factory.mktemp("smol_draft")))
    return path, draft, params, ref


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_smollm2_greedy_identical(setup, method):
    path, draft, params, ref = setup
    cfg = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    if method == "layer_skip":
        cfg["num_layers"] = 8
    if method == "draft_model":
        cfg["model"] = draft
    llm = LLM(model=path, num_kv_blocks=128, max_model_len=512, speculative_config=cfg)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == ref
    assert llm.get_stats()["spec_num_drafts"] > 0
