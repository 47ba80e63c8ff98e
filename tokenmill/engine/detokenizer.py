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
and shows up in ``output_text`` but is streamed only at finish. When several tokens arrive at
once (speculative decoding) and end mid-character, the text of those before the character is
committed and the window moves up to it. A long run of undecodable tokens (garbage bytes) is
committed up to its last three tokens, which may still start a character.

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
        window_text = self._decode(self._tokens[self._prefix_offset:])
        new_text = window_text[len(prefix_text):]
        if new_text.endswith(_REPLACEMENT) and self._split_incomplete(prefix_text):
            return
        # Too many tokens carried over from earlier steps without the text ending at a
        # character boundary (garbage bytes, or characters split in every step): cut the
        # window short of its last tokens (_cut), or, with no clean cut, give up waiting and
        # commit all (see _MAX_PENDING_TOKENS). Tokens added now never count, so a big
        # speculative batch ending mid-character still waits for its completion.
        forced = len(self._tokens) - self._read_offset - num_new >= _MAX_PENDING_TOKENS
        if forced and new_text.endswith(_REPLACEMENT) and self._cut(prefix_text, window_text):
            self._decode_window(num_new=len(self._tokens) - self._read_offset)
            return
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

    def _split_incomplete(self, prefix_text: str) -> bool:
        """Several new tokens (speculative decoding) whose text ends mid-character: commit the
        text of those before the character, and keep only the character's tokens (at most
        three: UTF-8 needs <= 4 bytes) as new. Stripping the trailing U+FFFD would not do: a
        byte-fallback decoder (SentencePiece) writes a whole run of byte tokens as U+FFFD
        while its last character is incomplete, complete characters before it included."""
        tokens, start = self._tokens, self._prefix_offset
        for split in range(len(tokens) - 1, max(self._read_offset, len(tokens) - 4), -1):
            head = self._decode(tokens[start:split])
            head_new = head[len(prefix_text):]
            if (head.endswith(_REPLACEMENT) or not head.startswith(prefix_text)
                    or len(head_new) < self._window_committed):
                continue
            self._text += head_new[self._window_committed:]
            del tokens[:self._read_offset]   # the committed new tokens become the context
            self._prefix_offset, self._read_offset = 0, split - self._read_offset
            self._window_committed = 0
            context = self._decode(tokens[:self._read_offset])
            self._pending = self._decode(tokens)[len(context):]
            return True
        return False

    def _cut(self, prefix_text: str, window_text: str) -> bool:
        """Move the window start past the carried tokens without waiting for the text to
        end at a character boundary. The cut goes at a token boundary where decoding the two
        sides apart gives the text of decoding them together (so no later token changes the
        head) and before the last three tokens (they may start a character a later token
        completes: UTF-8 needs <= 4 bytes, a token carries >= 1). The head's text is
        committed; the token before the cut stays as context. False: no clean boundary."""
        tokens, committed = self._tokens, self._window_committed
        # Boundaries inside a character fail the test; clean ones are a few tokens apart, so
        # the search (only when the window has grown long) stops after a few decodes.
        for cut in range(len(tokens) - 3, self._read_offset, -1):
            head = self._decode(tokens[self._prefix_offset:cut])
            context = self._decode(tokens[cut - 1:cut])
            tail = self._decode(tokens[cut - 1:])[len(context):]
            if head + tail != window_text or not head.startswith(prefix_text):
                continue
            head_new = head[len(prefix_text):]
            self._text += head_new[committed:]
            del tokens[:cut - 1]
            self._prefix_offset, self._read_offset = 0, 1
            # text of the tail already committed in earlier steps stays committed
            self._window_committed, self._pending = max(committed - len(head_new), 0), ""
            return True
        return False

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
