"""Build a Tokenizer from GGUF ``tokenizer.*`` metadata.

Two families: byte-level BPE ("gpt2" model) and SentencePiece BPE ("llama" model: Llama-2,
Mistral, Mixtral, TinyLlama, Gemma). The result must encode and decode like the model's own
tokenizer: for "gpt2" a BPE over the GPT-2 byte alphabet with the split regex llama.cpp
names in ``tokenizer.ggml.pre``; for "llama" a BPE over "▁"-for-space text with byte
fallback, whose merges are implied by the vocabulary (llama.cpp's SPM tokenizer and
sentencepiece merge the adjacent pair whose union is the best-ranked piece, which is what a
BPE with one merge per split of each piece, in piece rank order, does). Either way the tokens
typed CONTROL / USER_DEFINED are added whole so they are never cut into pieces.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Optional

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from ...tokenizer import Tokenizer
from .errors import CheckpointError
from .gguf_reader import GGUFFile

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Split regexes of the BPE families whose llama.cpp `pre` name is not plain GPT-2.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2),
}


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 bytes stand for
    themselves, the other 68 are shifted to code points 256 and up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _spell(token: str, alphabet: set[str]) -> str:
    """A vocabulary entry in byte-level spelling (entries already spelled are kept)."""
    if set(token) <= alphabet:
        return token
    table = byte_alphabet()
    return "".join(table[b] for b in token.encode("utf-8"))


def _backend(tokens: list[str], merges: list[str], pre: Optional[str], path: str) -> BackendTokenizer:
    alphabet = set(byte_alphabet().values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab[_spell(token, alphabet)] = index  # on a clash the later id wins, as in HF
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise CheckpointError(f"{path}: bad BPE merge {merge!r}")
        pairs.append((parts[0], parts[1]))
    try:
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False)
    except Exception as e:  # tokenizers raises a bare Exception for merges outside the vocab
        raise CheckpointError(f"{path}: invalid BPE vocabulary/merges: {e}") from None
    backend = BackendTokenizer(bpe)
    split = _SPLITS.get(pre or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    return backend


SPIECE_SPACE = "\u2581"  # SentencePiece's visible space


def _spm_vocab(tokens: list[str]) -> list[str]:
    """Gemma files store tokens made only of spaces as real spaces; the model spells them
    with "▁" (its normalizer turns spaces into "▁" before lookup)."""
    return [SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


# Characters of implied merges per character of vocabulary: ~2 in real ones (Gemma 3: 2.1).
# A hostile vocabulary ("a", "aa", "aaa", ...) implies merges quadratic in its size.
MAX_MERGE_CHARS_PER_CHAR = 16


def _implied_merges(ranked: list[str], path: str) -> list[tuple[str, str]]:
    """Merges a SentencePiece-BPE vocabulary implies: every split of a piece into two pieces
    of ``ranked``, in the order of ``ranked`` (best piece first), and within one piece the
    longer left part first -- transformers' order."""
    merges, known = [], set(ranked).__contains__   # hot loop over ~1M splits: keep it lean
    # A part whose length no piece has is no piece: skipped without slicing it, so one huge
    # piece costs a pass over its cut points, not a copy of the piece per cut point.
    lengths = {len(t) for t in ranked}
    budget = MAX_MERGE_CHARS_PER_CHAR * sum(map(len, ranked)) + 4096
    for token in ranked:
        n = len(token)
        found = [(token[:cut], token[cut:]) for cut in range(n - 1, 0, -1)
                 if cut in lengths and n - cut in lengths and known(token[:cut]) and known(token[cut:])]
        merges.extend(found)
        budget -= n * len(found)
        if budget < 0:
            raise CheckpointError(f"{path}: the SentencePiece vocabulary implies more merges than "
                                  f"{MAX_MERGE_CHARS_PER_CHAR}x its own size")
    return merges


_MERGEABLE = (TOKEN_NORMAL, TOKEN_USER_DEFINED, TOKEN_UNUSED)


def _spm_ranked(tokens: list[str], types: list[int], scores: list[float], gemma: bool) -> list[str]:
    """The pieces merges may build, best first.

    Gemma's file order is its merge order (its scores are not) and every entry takes part.
    Llama-style files rank by score, as sentencepiece and llama.cpp do (ties: lower id).
    Control, unknown and byte pieces are never built out of text; UNUSED ones are, as in
    llama.cpp (sentencepiece builds them too but splits a survivor back into its parts,
    which a BPE cannot express).
    """
    if gemma:
        vocab = {t: i for i, t in enumerate(tokens)}  # on a clash the later id wins, as in HF
        return sorted(vocab, key=vocab.__getitem__)
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))
    return list(dict.fromkeys(tokens[i] for i in order if types[i] in _MERGEABLE))


def _spm_backend(tokens: list[str], merges: list[tuple[str, str]], unk: Optional[str],
                 add_space_prefix: bool) -> BackendTokenizer:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab[token] = index  # on a clash the later id wins, as in HF
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token=unk, byte_fallback=True)
    backend = BackendTokenizer(bpe)
    # No pre-tokenizer: sentencepiece merges across the whole text (whitespace-only pieces
    # such as "▁▁▁" exist). Each text segment between special tokens gets the dummy-prefix
    # space, as llama.cpp does after every special token.
    prefix = [normalizers.Prepend(SPIECE_SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", SPIECE_SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []  # drop the dummy prefix again
    backend.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(),
                                         decoders.Fuse(), *strip])
    return backend


def _llama_backend(md: dict[str, Any], tokens: list[str], types: list[int], unk_id: Optional[int],
                   gemma: bool, path: str) -> BackendTokenizer:
    scores = md.get("tokenizer.ggml.scores")
    if scores is None:
        scores = [0.0] * len(tokens)  # llama.cpp's default: merge order falls back to ids
    if (not isinstance(scores, list) or len(scores) != len(tokens)
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in scores)):
        raise CheckpointError(f"{path}: tokenizer.ggml.scores must be {len(tokens)} numbers")
    if unk_id is None:  # no named unk: the first UNKNOWN-typed token, else none at all
        unk_id = next((i for i, k in enumerate(types) if k == TOKEN_UNKNOWN), None)
    unk = tokens[unk_id] if unk_id is not None else None
    vocab = _spm_vocab(tokens) if gemma else tokens
    merges = _implied_merges(_spm_ranked(vocab, types, scores, gemma), path)
    # llama.cpp: the dummy prefix is on unless the file says otherwise; Gemma never had it
    add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", not gemma))
    return _spm_backend(vocab, merges, unk, add_space_prefix)


def _add_special_tokens(backend: BackendTokenizer, tokens: list[str], types: list[int], named_ids: list[int],
                        byte_level: bool = True) -> None:
    """CONTROL tokens (and the named bos/eos/unk/pad ones) become special added tokens,
    USER_DEFINED ones plain added tokens, so text containing them keeps them whole.

    A CONTROL token spelled outside the byte alphabet is a llama.cpp mislabel; adding it
    would grow the vocabulary past the embedding, so it is left as a plain entry.
    """
    alphabet = set(byte_alphabet().values())
    control = [t for t, k in zip(tokens, types) if k == TOKEN_CONTROL and (not byte_level or set(t) <= alphabet)]
    control += [tokens[i] for i in named_ids if tokens[i] not in control]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    vocab = backend.get_vocab(with_added_tokens=False)
    user = [t for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED and t in vocab]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _token_id(md: dict[str, Any], key: str, num_tokens: int, path: str) -> Optional[int]:
    value = md.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < num_tokens:
        raise CheckpointError(f"{path}: {key} = {value!r} is not a token id below {num_tokens}")
    return value


def _string_list(md: dict[str, Any], key: str, path: str, required: bool) -> list[str]:
    value = md.get(key)
    if value is None and not required:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or (required and not value):
        raise CheckpointError(f"{path}: metadata {key!r} must be a non-empty list of strings")
    return value


def gguf_tokenizer(gguf: GGUFFile) -> Tokenizer:
    md, path = gguf.metadata, gguf.path
    kind = md.get("tokenizer.ggml.model")
    arch = md.get("general.architecture")
    if kind not in ("gpt2", "llama"):
        raise CheckpointError(
            f"{path}: GGUF tokenizer model {kind!r} (architecture {arch!r}) is not supported yet "
            "(supported: byte-level BPE 'gpt2' and SentencePiece BPE 'llama')"
        )
    gemma = kind == "llama" and isinstance(arch, str) and arch.startswith("gemma")
    tokens = _string_list(md, "tokenizer.ggml.tokens", path, required=True)
    types = md.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    if not isinstance(types, list) or len(types) != len(tokens):
        raise CheckpointError(f"{path}: tokenizer.ggml.token_type does not match the {len(tokens)} tokens")
    ids = {name: _token_id(md, f"tokenizer.ggml.{key}", len(tokens), path)
           for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                             ("unk", "unknown_token_id"), ("pad", "padding_token_id"))}
    named = [i for i in ids.values() if i is not None]
    if kind == "llama":
        backend = _llama_backend(md, tokens, types, ids["unk"], gemma, path)
        _add_special_tokens(backend, tokens, types, named, byte_level=False)
    else:
        merges = _string_list(md, "tokenizer.ggml.merges", path, required=True)
        pre = md.get("tokenizer.ggml.pre")
        if pre is not None and not isinstance(pre, str):
            raise CheckpointError(f"{path}: metadata 'tokenizer.ggml.pre' = {pre!r:.80} is not a string")
        backend = _backend(tokens, merges, pre, path)
        _add_special_tokens(backend, tokens, types, named)
    template = md.get("tokenizer.chat_template")
    return Tokenizer(
        backend,
        bos_token_id=ids["bos"],
        eos_token_ids=[ids["eos"]] if ids["eos"] is not None else [],
        pad_token_id=ids["pad"],
        unk_token_id=ids["unk"],
        # SentencePiece vocabularies want BOS unless the file says otherwise (llama.cpp, HF)
        add_bos_token=bool(md.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        add_eos_token=bool(md.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=template if isinstance(template, str) else None,
    )
