"""The kernel library built from a copy of the working tree's sources with some files
replaced, loaded beside the others in one process (the A/B scripts here)."""
import ctypes, os, shutil, tempfile

from tokenmill.layers import native


def library(replaced: dict = None) -> ctypes.CDLL:
    """``replaced``: path under tokenmill/layers -> the text it takes instead."""
    tmp = tempfile.mkdtemp()
    shutil.copytree(os.path.dirname(native.SOURCE), f"{tmp}/layers")
    for path, text in (replaced or {}).items():
        with open(f"{tmp}/layers/{path}", "w") as f:
            f.write(text)
    return native.declare(ctypes.CDLL(native.build_shared_library(
        f"{tmp}/layers/{os.path.basename(native.SOURCE)}", tmp + "/so", flags=native.build_flags())))
