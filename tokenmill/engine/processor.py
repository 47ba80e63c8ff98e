"""Processor: user prompt + SamplingParams -> validated engine Requests (one per sample), or
prompt + PoolingParams -> one prompt-only pooling Request."""
from __future__ import annotations

import itertools
import threading
from typing import Optional, Union

from tokenmill.pooling_params import PoolingParams
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.grammar import CompiledGrammar, GrammarCompiler
from tokenmill.structured.params import StructuredOutputsParams

PromptType = Union[str, dict, list]
# What a pooling request carries as sampling_params: never used to sample (see Request).
_PROMPT_ONLY = SamplingParams(max_tokens=1)


class Processor:
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int,
                 hidden_size: Optional[int] = None) -> None:
        self.tokenizer = tokenizer          # None when skip_tokenizer_init
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size      # the length of a pooled vector
        self._ids = itertools.count()
        # Built on the first constrained request: wrapping the vocabulary takes ~0.3 s.
        self._grammars: Optional[GrammarCompiler] = None
        self._grammars_lock = threading.Lock()

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def compile_grammar(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of ``spec`` (cached); ValueError naming it when invalid.
        Thread-safe: the server compiles in a worker thread before the engine sees the request."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer (skip_tokenizer_init=True was set)")
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self._grammars.compile(spec)

    def grammar_counters(self) -> dict:
        """Compile counts and time (zeros before the first constrained request)."""
        with self._grammars_lock:
            grammars = self._grammars
        if grammars is None:
            return {"num_compiled": 0, "num_cache_hits": 0, "compile_seconds": 0.0}
        return grammars.counters()

    def tokenize_prompt(self, prompt: PromptType,
                        generates: bool = True) -> tuple[Optional[str], list[int]]:
        """Return (prompt text or None, prompt token ids), validated. A prompt that
        ``generates`` must leave room for one token within max_model_len; a pooling prompt
        may fill it."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"], generates)
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=True was set); "
                                 "pass {'prompt_token_ids': [...]}")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, prompt
        else:
            raise ValueError(f"prompt must be a string or {{'prompt_token_ids': [...]}}, "
                             f"got {type(prompt).__name__}")
        return text, self._check_ids(list(ids), generates)

    def _check_ids(self, ids: list, generates: bool) -> list[int]:
        if not ids:
            raise ValueError("the prompt is empty")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {self.vocab_size})")
        if not generates and len(ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens but max_model_len is "
                             f"{self.max_model_len}")
        if generates and len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}; "
                f"the prompt must leave room for at least one generated token")
        return ids

    def make_requests(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      priority: int = 0, cache_salt: Optional[str] = None,
                      arrival_time: Optional[float] = None) -> list[Request]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.check_token_ids(self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init=True was set)")
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        params = params.with_engine_stops(eos)
        room = self.max_model_len - len(prompt_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if params.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({params.min_tokens}) exceeds the room left after the "
                             f"prompt ({max_tokens} tokens within max_model_len {self.max_model_len})")
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.compile_grammar(params.structured_outputs)
        ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        return [Request(child_id, prompt_ids, params, max_tokens, arrival_time=arrival_time,
                        priority=priority, cache_salt=cache_salt, parent_id=request_id,
                        sample_index=i,
                        grammar=grammar.new_matcher() if grammar is not None else None)
                for i, child_id in enumerate(ids)]

    def make_pooling_request(self, request_id: str, prompt_ids: list[int], params: PoolingParams,
                             priority: int = 0, cache_salt: Optional[str] = None,
                             arrival_time: Optional[float] = None) -> Request:
        """One prompt-only request: max_tokens 0, finished once its prompt is computed."""
        params.check_hidden_size(self.hidden_size)
        return Request(request_id, prompt_ids, _PROMPT_ONLY, 0, arrival_time=arrival_time,
                       priority=priority, cache_salt=cache_salt, pooling_params=params)
