"""Shared fixtures: tiny random-weight models saved with transformers (the numerical oracle)."""
import os

import pytest
import torch

# Two threads on CI; tests don't need more and must not oversubscribe.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def save_tiny_llama(path, seed=0, **overrides):
    import transformers
    cfg = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
               initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_llama(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_hf(tiny_llama_dir):
    import transformers
    return transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
