"""The kernel-library builder: one build per source version, local headers included."""
import shutil

import pytest

from tokenmill.layers import native


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_a_header_edit_rebuilds_the_library(tmp_path):
    src, header = tmp_path / "k.c", tmp_path / "k.h"
    header.write_text("static inline int value(void) { return 1; }\n")
    src.write_text('#include "k.h"\nint tm_value(void) { return value(); }\n')
    flags = ["-O1", "-shared", "-fPIC"]
    first = native.build_shared_library(str(src), str(tmp_path / "build"), flags)
    assert native.build_shared_library(str(src), str(tmp_path / "build"), flags) == first   # cached
    header.write_text("static inline int value(void) { return 2; }\n")
    second = native.build_shared_library(str(src), str(tmp_path / "build"), flags)
    assert second != first
    import ctypes
    assert ctypes.CDLL(first).tm_value() == 1 and ctypes.CDLL(second).tm_value() == 2
