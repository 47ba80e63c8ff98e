"""Fixtures for structured outputs: SmolLM2's real tokenizer (the grammar works on its 49k
tokens) and a tiny random Llama that speaks it (milliseconds per step). Skipped where the
SmolLM2 files are not cached and cannot be fetched."""

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from tokenmill.models.hub import resolve_model
    from tokenmill.models.loader import load_tokenizer
    try:
        return load_tokenizer(resolve_model("smollm2-135m"))
    except Exception as e:  # no network and no cache
        pytest.skip(f"SmolLM2 tokenizer unavailable: {e}")


@pytest.fixture(scope="session")
def compiler(smollm2_tokenizer):
    from tokenmill.structured.grammar import GrammarCompiler
    return GrammarCompiler(smollm2_tokenizer, smollm2_tokenizer.vocab_size)


@pytest.fixture(scope="session")
def tiny_structured_dir(tmp_path_factory, smollm2_tokenizer):
    from tests.conftest import save_tiny_chat_llama
    path = tmp_path_factory.mktemp("tiny_structured")
    return save_tiny_chat_llama(path, smollm2_tokenizer, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def tiny_llm(tiny_structured_dir):
    from tokenmill import LLM
    return LLM(model=tiny_structured_dir, max_model_len=2048, num_kv_blocks=1024)
