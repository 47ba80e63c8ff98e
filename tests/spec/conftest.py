"""Fixtures for the speculative decoding tests that need a tokenizer: a tiny random Llama that
speaks SmolLM2's tokenizer and chat template (milliseconds per step), with room for the bench's
prompts. Skipped where the SmolLM2 files are not cached and cannot be fetched."""

import pytest


@pytest.fixture(scope="session")
def tiny_spec_chat_dir(tmp_path_factory):
    from tests.conftest import save_tiny_chat_llama
    from tokenmill.models.hub import resolve_model
    from tokenmill.models.loader import load_tokenizer
    try:
        tok = load_tokenizer(resolve_model("smollm2-135m"))
    except Exception as e:  # no network and no cache
        pytest.skip(f"SmolLM2 tokenizer unavailable: {e}")
    path = tmp_path_factory.mktemp("tiny_spec_chat")
    return save_tiny_chat_llama(path, tok, max_position_embeddings=1024)
