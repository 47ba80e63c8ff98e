"""Tokenizer: a `tokenizers.Tokenizer` plus the model's special-token rules and chat template.

Loaders (tokenmill.models.loader) build it from an HF directory or GGUF metadata; the rest
of the engine only sees this class. Chat templates come from the model files, never from a
request, and render in a sandboxed Jinja environment with budgets (tokenmill.chat_template).
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import tokenizers

from tokenmill.chat_template import ChatTemplateRenderer, TemplateLimits

# Spaces before punctuation that HF's `clean_up_tokenization_spaces` removes on decode.
_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
            (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
# Texts longer than this go through encode_batch, which releases the GIL while it works; encode
# holds it, so a 1 MB prompt (about a second) would stop every other thread, the engine's too.
_LONG_TEXT = 8192
_SURROGATE = re.compile("[\ud800-\udfff]")


class Tokenizer:
    """Text <-> token ids for one model.

    ``add_bos_token`` / ``add_eos_token`` say whether the *model* wants BOS / EOS around an
    encoded text; they are only applied when the backend's own post-processor does not
    already add them (HF ``tokenizer.json`` files often carry one, GGUF-built ones never).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: Optional[int] = None,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: Optional[int] = None,
        unk_token_id: Optional[int] = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: Optional[str] = None,
        clean_up_tokenization_spaces: bool = False,
        template_limits: TemplateLimits = TemplateLimits(),
    ):
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = [int(i) for i in eos_token_ids]
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.chat_template = chat_template
        self._clean_up = clean_up_tokenization_spaces
        added = backend.get_added_tokens_decoder()
        self.vocab_size = max([backend.get_vocab_size(with_added_tokens=True)] + [i + 1 for i in added])
        self.all_special_ids = {i for i, tok in added.items() if tok.special}
        self.all_special_ids |= {i for i in (bos_token_id, pad_token_id, unk_token_id, *self.eos_token_ids) if i is not None}
        # Does the backend's post-processor add BOS/EOS by itself? Probe with an empty text.
        probe = backend.encode("", add_special_tokens=True).ids
        self._prepend_bos = add_bos_token and bos_token_id is not None and probe[:1] != [bos_token_id]
        self._append_eos = add_eos_token and self.eos_token_id is not None and probe[-1:] != [self.eos_token_id]
        self._templates = ChatTemplateRenderer(template_limits)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def bos_token(self) -> Optional[str]:
        return self._token(self.bos_token_id)

    @property
    def eos_token(self) -> Optional[str]:
        return self._token(self.eos_token_id)

    def _token(self, token_id: Optional[int]) -> Optional[str]:
        return None if token_id is None else self._backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            if len(text) > _LONG_TEXT:
                batch = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
                ids = batch[0].ids
            else:
                ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            _check_text(text)
            raise
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_token_id] + ids
        if add_special_tokens and self._append_eos:
            ids = ids + [self.eos_token_id]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if ids and min(ids) < 0:
            raise ValueError(f"negative token id {min(ids)}")
        # ids past the vocabulary (padded embedding rows) decode to nothing, as in HF
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for old, new in _CLEANUP:
                text = text.replace(old, new)
        return text

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self._backend.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> Optional[int]:
        return self._backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` with the model's chat template (and token ids if ``tokenize``).

        Template errors (the template's own ``raise_exception``, sandbox refusals, budgets
        running out) raise ChatTemplateError, a ValueError, so a server can answer 400.
        Tokenizing adds no special tokens: the template already wrote any BOS it wants, and
        adding one more would double it.
        """
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                     "pad_token": self._token(self.pad_token_id), "unk_token": self._token(self.unk_token_id)}
        variables.update(template_kwargs)
        variables.update(messages=messages, add_generation_prompt=add_generation_prompt)
        text = self._templates.render(self.chat_template, variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _check_text(text: Any) -> None:
    """Why the backend refused ``text``, as a clear error. A str can hold surrogate code points
    (JSON's ``"\\ud800"``, bytes decoded with surrogateescape), which no UTF-8 text holds; the
    message names one by number (it cannot be written out as UTF-8 either)."""
    if not isinstance(text, str):
        raise TypeError(f"text to tokenize must be a string, got {type(text).__name__}")
    found = _SURROGATE.search(text)
    if found:
        raise ValueError(f"text to tokenize holds the surrogate code point "
                         f"U+{ord(found.group()):04X} at character {found.start()}; it must be "
                         f"valid Unicode")
