"""End to end on a tiny random Llama saved by transformers: greedy tokens equal HF generate,
logprobs within 1e-4; batch, chunking and preemption invariance; seeds; n; stops."""
import random

import pytest
import torch

from tokenmill import LLM, SamplingParams

PROMPTS = [[(17 * i + 5 * j) % 380 + 3 for j in range(n)] for i, n in
           enumerate([5, 9, 1, 23, 40, 3, 17, 64, 2, 31, 12, 7, 50, 19, 8, 33, 4, 27])]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=256, block_size=16)


def hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def hf_logprobs(hf, tokens):
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, -1)


def greedy(n=16, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def run(llm, prompts, params):
    return [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def test_greedy_matches_hf_generate_and_logprobs(llm, tiny_llama_hf):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:5]], greedy(16, logprobs=2),
                        use_tqdm=False)
    for prompt, out in zip(PROMPTS[:5], outs):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(tiny_llama_hf, prompt, 16)
        ref = hf_logprobs(tiny_llama_hf, prompt + tokens)
        for k, (tok, entry) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            want = ref[len(prompt) - 1 + k]
            assert abs(entry[tok].logprob - want[tok].item()) < 1e-4
            assert entry[tok].rank == 1
            assert len(entry) <= 3


def test_prompt_logprobs_match_hf(llm, tiny_llama_hf):
    prompt = PROMPTS[4]
    out = llm.generate([{"prompt_token_ids": prompt}], greedy(2, prompt_logprobs=1), use_tqdm=False)[0]
    ref = hf_logprobs(tiny_llama_hf, prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        tok = prompt[pos]
        assert abs(out.prompt_logprobs[pos][tok].logprob - ref[pos - 1][tok].item()) < 1e-4


def test_batch_and_chunked_prefill_invariance(tiny_llama_dir, llm):
    alone = [run(llm, [p], greedy())[0] for p in PROMPTS]
    chunked = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=256,
                  max_num_batched_tokens=24, max_num_seqs=8)
    assert run(chunked, PROMPTS, greedy()) == alone
    assert run(llm, PROMPTS, greedy()) == alone


def test_preemption_invariance_and_all_blocks_return(tiny_llama_dir, llm):
    prompts = PROMPTS[:16]
    alone = [run(llm, [p], greedy())[0] for p in prompts]
    small = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=12, block_size=16)
    assert run(small, prompts, greedy()) == alone
    assert small.get_stats()["num_preemptions"] > 0
    mem = small.get_memory_stats()
    assert mem["num_free_blocks"] == mem["num_total_blocks"] == 12
    assert not small.engine.scheduler.requests and not small.engine.runner.states


def test_seeded_sampling_reproducible_across_batch_positions(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    target = PROMPTS[3]
    alone = run(llm, [target], params)[0]
    others = [p for p in PROMPTS[:6] if p is not target]
    mixed_params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * len(others)
    outs = llm.generate([{"prompt_token_ids": p} for p in others + [target]],
                        mixed_params + [params], use_tqdm=False)
    assert outs[-1].outputs[0].token_ids == alone
    assert run(llm, [target], SamplingParams(temperature=1.0, seed=99, max_tokens=12,
                                            ignore_eos=True))[0] != alone


def test_n_samples_share_prompt_blocks(llm):
    prompt = PROMPTS[7]   # 64 tokens = 4 full blocks
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.get_stats()["prefix_cache_hit_rate"] > 0


def test_stop_token_ids_and_max_tokens(llm):
    ref = run(llm, [PROMPTS[1]], greedy(8))[0]
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], greedy(8, stop_token_ids=[ref[2]]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[:ref.index(ref[2]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == ref[2]
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], greedy(5), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


@pytest.mark.parametrize("prompt,match", [
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [1, 384]}, "outside the vocabulary"),
    ({"prompt_token_ids": [1] * 600}, "max_model_len"),
    ("text", "tokenizer"),
])
def test_bad_prompts_raise_and_engine_keeps_working(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], greedy(), use_tqdm=False)
    assert not llm.engine.scheduler.requests
    assert run(llm, [PROMPTS[0]], greedy(4))[0] == run(llm, [PROMPTS[0]], greedy(4))[0]


def test_bad_sampling_token_ids_raise(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([{"prompt_token_ids": [5]}], greedy(stop_token_ids=[10_000]), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([{"prompt_token_ids": [5]}], greedy(logit_bias={10_000: 1.0}), use_tqdm=False)


def test_idle_engine_holds_nothing(llm):
    run(llm, PROMPTS[:4], greedy(4))
    mem = llm.get_memory_stats()
    assert mem["num_free_blocks"] == mem["num_total_blocks"]
    assert not llm.engine.scheduler.requests and not llm.engine.runner.states
    assert llm.engine.output_processor.num_unfinished == 0
