"""The kernel library: built from the installed package's sources wherever a compiler and an
AVX2 CPU exist (a failed build fails here, never skips), and a failure is reported."""
import logging
import os
import time

import pytest

import tokenmill
from tokenmill.layers import cpu_ops, native

needs_toolchain = pytest.mark.skipif(not native.buildable(), reason="no C compiler, or a CPU without AVX2")


@needs_toolchain
def test_kernels_build_and_are_active_where_they_should():
    native.require()   # raises KernelBuildError with the compiler's message
    assert cpu_ops.available()
    status = native.status()
    assert status["built"] and status["error"] is None and os.path.isfile(status["path"])


def test_every_included_source_ships_with_the_package():
    """source_bytes follows the local #includes and raises on a missing file: run from an
    installed wheel (as .ci/run does), this fails when package data lacks a .c or .h."""
    data = native.source_bytes(native.SOURCE)
    for name in ("tm_rms_norm", "tm_paged_attention", "tm_llama_decode", "tm_qmm", "tm_qgemm_q8"):
        assert name.encode() in data
    if os.environ.get("TOKENMILL_TEST_INSTALLED") == "1":   # set by .ci/run: the wheel, not the checkout
        assert "site-packages" in tokenmill.__file__, tokenmill.__file__


@needs_toolchain
def test_a_compile_error_is_logged_with_the_compilers_message(tmp_path, caplog):
    src = tmp_path / "broken.c"
    src.write_text("int tm_broken(void) { return undeclared_name; }\n")
    with caplog.at_level(logging.WARNING, logger="tokenmill.layers.native"):
        status = native.build_library(str(src), str(tmp_path / "build"))
    assert status.lib is None and "undeclared_name" in status.error
    assert "undeclared_name" in caplog.text and "PyTorch" in caplog.text
    assert not list((tmp_path / "build").glob("*.so"))   # no half-built library left behind


@needs_toolchain
def test_a_build_past_its_timeout_fails_cleanly(tmp_path):
    src = tmp_path / "slow.c"
    # a recursive macro expansion the compiler spends far longer on than the timeout
    src.write_text("#define A(x) x x x x x x x x\n#define B(x) A(A(A(A(A(A(x))))))\n"
                   "int tm_slow(void) { return 0; }\n" + "static const char *s = \"\" B(B(\"a\"));\n")
    with pytest.raises(native.KernelBuildError, match="did not finish"):
        native.build_shared_library(str(src), str(tmp_path / "build"), ["-O0", "-shared", "-fPIC"],
                                    timeout_s=0.2)
    assert not list((tmp_path / "build").glob("*"))
    time.sleep(0.2)
    assert not _compilers_running(src), "the compiler proper outlived the timeout"


def _compilers_running(src) -> bool:
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(src).encode() in f.read():
                    return True
        except OSError:
            continue
    return False
