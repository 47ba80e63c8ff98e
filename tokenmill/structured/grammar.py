"""Grammars on llguidance: compile a StructuredOutputsParams once per tokenizer, then follow each
request's output with a matcher that says which tokens may come next.

Why llguidance: measured on SmolLM2's 49k-token vocabulary (docs/structured_outputs.md) it
compiles a JSON schema in ~1 ms (outlines-core built its token index in 60-270 ms) and computes
a mask in ~10 us, lazily, so no per-schema table over the vocabulary is ever built.

Terms:
- *bitmask row*: ceil(V / 32) int32 words; bit ``t % 32`` of word ``t // 32`` set = token t is
  allowed at that position.
- *terminated*: the grammar is complete and allows nothing but an end-of-sequence token.
No torch here: the scheduler (torch-free) fills the masks, the sampler applies them.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np

from tokenmill.structured.params import StructuredOutputsParams

_CACHE_SIZE = 512


def _llguidance():
    try:
        import llguidance
    except ImportError as e:   # a dependency in pyproject; only a broken install gets here
        raise ValueError(f"structured outputs need the llguidance package: {e}") from None
    return llguidance


class GrammarMatcher:
    """One request's position in its grammar; advanced by the scheduler as tokens are emitted."""

    def __init__(self, matcher, words_per_row: int) -> None:
        self._matcher = matcher
        self.words_per_row = words_per_row

    def accept(self, token_id: int) -> bool:
        """Advance by one emitted token; False if the grammar did not allow it."""
        return bool(self._matcher.consume_token(token_id))

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading ``token_ids`` the grammar accepts from here (state unchanged)."""
        if not token_ids:
            return 0
        return int(self._matcher.validate_tokens(list(token_ids)))

    def forced_tokens(self, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens the grammar allows no alternative to from here (llguidance
        stops where another tokenization of the forced text would also fit)."""
        if max_tokens <= 0:
            return []
        return list(self._matcher.compute_ff_tokens()[:max_tokens])

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> Optional[str]:
        return self._matcher.get_error() if self._matcher.is_error() else None


class CompiledGrammar:
    """A checked grammar; ``new_matcher`` gives each request (each of n samples) its own state."""

    def __init__(self, template, words_per_row: int) -> None:
        self._template = template   # never advanced; copied per request
        self._lock = threading.Lock()
        self.words_per_row = words_per_row

    def new_matcher(self) -> GrammarMatcher:
        with self._lock:
            return GrammarMatcher(self._template.deep_copy(), self.words_per_row)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary; thread-safe, LRU-cached by
    ``StructuredOutputsParams.key`` so a repeated schema costs a dictionary lookup."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = _CACHE_SIZE) -> None:
        llg = _llguidance()
        eos = list(tokenizer.eos_token_ids) or None
        # n_vocab = the model's logit width: ids past the tokenizer's vocabulary stay banned.
        self._tokenizer = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                          eos_token=eos)
        self.vocab_size = vocab_size
        self.words_per_row = (vocab_size + 31) // 32
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.num_cache_hits = 0
        self.compile_seconds = 0.0   # spent compiling (cache misses), summed over threads

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of ``spec``; ValueError naming the constraint if it is invalid."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return hit
        t0 = time.perf_counter()
        compiled = self._build(spec)   # outside the lock: other schemas compile meanwhile
        seconds = time.perf_counter() - t0
        with self._lock:
            self._cache[key] = compiled
            self.num_compiled += 1
            self.compile_seconds += seconds
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def counters(self) -> dict:
        with self._lock:
            return {"num_compiled": self.num_compiled, "num_cache_hits": self.num_cache_hits,
                    "compile_seconds": round(self.compile_seconds, 6)}

    def _build(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        llg = _llguidance()
        kind = spec.kind
        try:
            grammar = _grammar_text(llg, spec)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{kind}: {e}") from None
        # The constructor never raises: a bad grammar leaves the matcher in an error state.
        matcher = llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{kind}: invalid {_NAMES[kind]}: "
                             f"{matcher.get_error()}")
        return CompiledGrammar(matcher, self.words_per_row)


_NAMES = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regular expression",
          "choice": "choice list", "grammar": "grammar"}


def _grammar_text(llg, spec: StructuredOutputsParams) -> str:
    kind = spec.kind
    if kind in ("json", "json_object"):
        options = {"whitespace_flexible": not spec.disable_any_whitespace}
        return llg.LLMatcher.grammar_from_json_schema(spec.text, defaults=options)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.text)
    if kind == "choice":
        return llg.grammar_from("choice", spec.text)
    return llg.grammar_from("grammar", spec.text)   # Lark, or GBNF converted to Lark


def fill_bitmasks(entries: Sequence[tuple[GrammarMatcher, Sequence[int]]],
                  words_per_row: int) -> np.ndarray:
    """Masks for a step: per entry (matcher, its k scheduled drafts) k + 1 rows, in entry
    order: the mask for the next token, then the mask after each draft. Matchers are left
    where they were. Returns [sum(k + 1), words_per_row] int32."""
    num_rows = sum(len(drafts) + 1 for _, drafts in entries)
    # Rows after a draft the grammar refuses stay all-allowed: that draft is rejected at its
    # own (masked) row, so what follows it is never emitted.
    masks = np.full((num_rows, words_per_row), -1, dtype=np.int32)
    row_bytes = words_per_row * 4
    row = 0
    for matcher, drafts in entries:
        m = matcher._matcher
        # consume_token on a refused token would leave the matcher broken for good
        num_valid = matcher.valid_prefix(drafts)
        for j in range(num_valid + 1):
            m.unsafe_compute_mask_ptr(masks.ctypes.data + (row + j) * row_bytes, row_bytes)
            if j < num_valid:
                m.consume_token(drafts[j])
        if num_valid:
            m.rollback(num_valid)
        row += len(drafts) + 1
    return masks
