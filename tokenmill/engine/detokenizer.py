"""Incremental detokenization and stop-string matching for one request.

Decoding the whole output every step costs O(n) per token, so only a sliding window is decoded
(the usual prefix_offset / read_offset technique):

- ``tokens[prefix_offset:read_offset]`` were already turned into text; they are decoded again only
  as context, because some tokenizers render a token differently at the start of a string
  (SentencePiece drops the leading space).
- ``tokens[read_offset:]`` are new; their text is ``decode(window)`` minus ``decode(prefix)``.

The window advances when its text does not end in U+FFFD, i.e. at a character boundary. Text that
ends in U+FFFD is an incomplete UTF-8 character that later tokens may complete: the characters
before it are committed (they can no longer change), the trailing U+FFFD run is kept *pending*
and shows up in ``output_text`` but is streamed only at finish.

Stop strings are searched only in newly committed text plus ``max_stop_len - 1`` characters
back, and streaming holds back that many characters so a partial stop string never leaks.
"""
from __future__ import annotations

from typing import Optional, Sequence

from tokenmill.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as context before the first output token (as in vLLM).
_PROMPT_CONTEXT_TOKENS = 5
# An undecodable run this long is garbage, not a character in progress (UTF-8 needs <= 4 bytes,
# each token carries >= 1); committing it keeps the window, and so the cost per step, bounded.
_MAX_PENDING_TOKENS = 16


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params: SamplingParams, prompt_token_ids: Sequence[int]):
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        max_stop_len = max((len(s) for s in self._stops), default=0)
        self._search_back = max(max_stop_len - 1, 0)
        # With include_stop_str_in_output a partial stop string is shown in the end anyway.
        self._hold = 0 if self._include_stop else self._search_back
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_REPLACEMENT):
            # Prompt ends mid-character: gluing output bytes onto it would change the output's
            # text versus decoding the output alone, so start without context.
            context = []
        self._tokens: list[int] = context  # window only; older tokens are dropped
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._window_committed = 0  # chars of the window's new text already in _text
        self._text = ""  # committed text: append-only until a stop string truncates it
        self._pending = ""  # trailing U+FFFD run that later tokens may still complete
        self._num_sent = 0  # chars of output_text returned by get_delta
        self.stop_string: Optional[str] = None  # the stop string that ended the request

    @property
    def output_text(self) -> str:
        """Full text so far (what the user sees)."""
        return self._text + self._pending

    def update(self, new_token_ids: Sequence[int], stop_token_hit: bool) -> Optional[str]:
        """Append tokens' text; return the matched stop string, if one was found, else None.

        With ``stop_token_hit`` the last token ended the request by id, so its text is not
        emitted. After a stop string matched, further updates are ignored.
        """
        if self.stop_string is not None:
            return None
        ids = list(new_token_ids[:-1] if stop_token_hit else new_token_ids)
        if not ids:
            return None
        old_len = len(self._text)
        self._tokens.extend(ids)
        self._decode_window(num_new=len(ids))
        return self._find_stop(old_len)

    def get_delta(self, finished: bool) -> str:
        """Text not yet returned to a streaming client; holds back what may still change."""
        if finished or self.stop_string is not None:
            end = len(self.output_text)
        else:
            end = len(self._text) - self._hold
        if end <= self._num_sent:
            return ""
        delta = self.output_text[self._num_sent:end]
        self._num_sent = end
        return delta

    # -- internals -------------------------------------------------------------------------
    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_window(self, num_new: int) -> None:
        prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset:])[len(prefix_text):]
        # Too many tokens carried over undecodable from earlier steps: give up waiting (see
        # _MAX_PENDING_TOKENS) and commit. Tokens added now never count, so a big speculative
        # batch ending mid-character still waits for its completion.
        forced = len(self._tokens) - self._read_offset - num_new >= _MAX_PENDING_TOKENS
        complete = forced or not new_text.endswith(_REPLACEMENT)
        stable = new_text if complete else new_text.rstrip(_REPLACEMENT)
        if len(stable) > self._window_committed:
            self._text += stable[self._window_committed:]
            self._window_committed = len(stable)
        self._pending = new_text[max(len(stable), self._window_committed):]
        # Advance only when text appeared: a skipped special token adds none, and keeping it in
        # the window keeps the next token's context right.
        if (complete and new_text) or forced:
            self._advance()

    def _advance(self) -> None:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        self._window_committed = 0
        self._pending = ""
        # Tokens before the prefix are never decoded again.
        del self._tokens[:self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0

    def _find_stop(self, old_len: int) -> Optional[str]:
        """Earliest-ending stop string in the new text (as if text arrived char by char)."""
        if not self._stops or len(self._text) == old_len:
            return None
        start = max(old_len - self._search_back, 0)
        best: Optional[tuple[int, int, str]] = None
        for stop in self._stops:
            index = self._text.find(stop, start)
            if index != -1:
                candidate = (index + len(stop), index, stop)
                best = candidate if best is None or candidate < best else best
        if best is None:
            return None
        end, index, stop = best
        self._text = self._text[:end if self._include_stop else index]
        self._pending = ""
        self.stop_string = stop
        return stop
