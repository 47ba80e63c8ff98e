"""Each supported architecture, as a tiny random model saved by transformers: greedy
continuations equal HF ``generate`` and per-token logprobs are within 1e-4 of HF float32.

Sliding windows are tiny (8) and prompts longer, so local layers really drop old keys in
prefill and decode; RoPE scaling variants ride on some of the models."""
import pytest
import torch

from tokenmill import LLM, SamplingParams

NUM_TOKENS = 16
PROMPTS = [[(13 * i + 7 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([5, 12, 27])]
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0)

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama-yarn": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32})),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8, head_dim=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=8,
                                                      max_window_layers=1, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, attention_bias=True)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, sliding_window=8, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}


def _randomize_norms_and_biases(model):
    """HF initialises norms to 1 (Gemma: 0, it stores w - 1) and biases to 0; random ones
    catch a misrouted norm or a dropped bias. Values stay around the initial ones."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request, tmp_path_factory):
    import transformers
    config_cls, model_cls, extra = ARCHS[request.param]
    cfg = getattr(transformers, config_cls)(**{**COMMON, **extra})
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(cfg).float().eval()
    _randomize_norms_and_biases(hf)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    hf = getattr(transformers, model_cls).from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=str(path), skip_tokenizer_init=True, num_kv_blocks=64, block_size=4)
    return hf, llm


def _hf_greedy(hf, prompt):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def test_greedy_and_logprobs_match_hf(tiny):
    hf, llm = tiny
    assert_matches_hf(hf, llm)


def assert_matches_hf(hf, llm):
    """Greedy continuations of PROMPTS equal HF generate; logprobs within 1e-4 of HF's."""
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        tokens = out.outputs[0].token_ids
        assert tokens == _hf_greedy(hf, prompt)
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0].float(), -1)
        for k, (tok, entry) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            assert abs(entry[tok].logprob - ref[len(prompt) - 1 + k, tok].item()) < 1e-4
