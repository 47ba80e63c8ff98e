"""Files a process writes under a temporary name (``<prefix><pid>-...``) and renames into
place once whole: what a killed writer leaves behind is found by the next writer and removed
once its owner is gone, never mistaken for the finished file."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from typing import Optional

logger = logging.getLogger("tokenmill.temp_files")


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def remove_stale_temps(folder: str, prefix: str, grace_s: float) -> list[str]:
    """Remove ``<prefix><pid>-*`` files and folders in ``folder`` whose process is gone and
    that nothing wrote to for ``grace_s`` (a live writer in another pid namespace looks
    gone, but keeps its file fresh); returns their paths."""
    removed = []
    for name in os.listdir(folder):
        pid = _owner_pid(name, prefix)
        full = os.path.join(folder, name)
        try:
            if pid is None or _pid_alive(pid) or time.time() - _newest_mtime(full) < grace_s:
                continue
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full)
            else:
                os.unlink(full)
            removed.append(full)
        except OSError as e:   # another process cleaning up at the same time
            logger.debug("could not remove %s: %s", full, e)
    return removed


def _owner_pid(name: str, prefix: str) -> Optional[int]:
    if not name.startswith(prefix):
        return None
    pid = name[len(prefix):].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's live process
        return True
    return True


def _newest_mtime(path: str) -> float:
    """The latest mtime of ``path`` and, for a folder, of anything inside it."""
    newest = os.lstat(path).st_mtime
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
            except OSError:
                pass
    return newest
