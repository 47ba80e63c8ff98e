"""Peak resident memory of a process and the processes it started, from /proc (Linux; only
the standard library: bench peers and the serve client import it without torch).

An engine may compute in child processes (vLLM's engine core, data-parallel replicas), so
its memory is the tree's: the sum of each live process's VmHWM, an upper bound of their
simultaneous peak (file pages shared between them, such as libraries, count once per
process). VmHWM counts only that program's memory (getrusage's ru_maxrss would also count a
parent's pages as they were at fork, since Linux carries the pre-exec high-water mark over
exec)."""
from __future__ import annotations

import os


def vm_hwm(pid) -> int:
    """A process's peak resident bytes (VmHWM; ``pid`` may be "self"); 0 if it is gone or
    unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def descendants(pid: int) -> list[int]:
    """The live processes below ``pid`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])   # field 4, after the name
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def tree_peak_rss(pid: int) -> tuple[int, int]:
    """(peak RSS bytes of ``pid`` plus its live descendants, how many descendants counted);
    (0, 0) when ``pid`` cannot be read."""
    own = vm_hwm(pid)
    if not own:
        return 0, 0
    children = [peak for peak in map(vm_hwm, descendants(pid)) if peak]   # each read once
    return own + sum(children), len(children)
