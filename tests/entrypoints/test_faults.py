"""Faults stay with their own request: NaN activations fail only that request, never reach
the prefix cache, and the engine keeps serving the rest."""
import torch

from tokenmill import LLM, SamplingParams

POISON = 300
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_nan_fails_only_its_request_and_is_never_cached(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=16)
    clean = [[(7 * i + j) % 250 + 3 for j in range(10 + i)] for i in range(4)]
    reference = [o.outputs[0].token_ids for o in
                 llm.generate([{"prompt_token_ids": p} for p in clean], GREEDY, use_tqdm=False)]
    with torch.no_grad():
        llm.engine.model.model.embed_tokens.weight[POISON] = float("nan")
    poisoned = clean[0][:9] + [POISON] + list(range(20, 40))
    outs = llm.generate([{"prompt_token_ids": p} for p in [poisoned] + clean], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert "non-finite" in outs[0].outputs[0].error
    assert [o.outputs[0].token_ids for o in outs[1:]] == reference
    pool = llm.engine.scheduler.kv.pool
    assert all(POISON not in b.block_hash.token_ids for b in pool.blocks if b.block_hash is not None)
    mem = llm.get_memory_stats()
    assert mem["num_free_blocks"] == mem["num_total_blocks"]
