"""Fixtures for the speculative decoding tests that need a tokenizer: a tiny random Llama that
speaks SmolLM2's tokenizer and chat template (milliseconds per step), with room for the bench's
prompts. Skipped where the SmolLM2 files are not cached and cannot be fetched."""

import pytest


@pytest.fixture(scope="session")
def tiny_spec_chat_dir(tiny_smollm2_chat_dir):
    return tiny_smollm2_chat_dir
