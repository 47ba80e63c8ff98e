"""The kernel library: built from the installed package's sources wherever a compiler and an
AVX2 CPU exist (a failed build fails here, never skips), and a failure is reported. A build
SIGKILLed mid-compile leaves no library under the final name, and a damaged library is rebuilt
rather than opened (dlopen of a truncated one dies of SIGBUS)."""
import logging
import os
import signal
import subprocess
import sys
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


def _compilers_running(src, exclude=frozenset()) -> bool:
    """Whether a process other than this one and ``exclude`` names ``src`` on its command line."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) in exclude or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(src).encode() in f.read():
                    return True
        except OSError:
            continue
    return False


FAST_FLAGS = ["-O0", "-shared", "-fPIC"]
# A fresh process builds (or finds) the library and calls into it, as the next start would.
BUILD_AND_CALL = ("import ctypes, sys; from tokenmill.layers import native; "
                  "path = native.build_shared_library(sys.argv[1], sys.argv[2], sys.argv[3:]); "
                  "print(ctypes.CDLL(path).tm_answer())")


def _build_in_child(src, build_dir) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BUILD_AND_CALL, str(src), str(build_dir),
                           *FAST_FLAGS], capture_output=True, text=True, timeout=120)


def _slow_source(tmp_path):
    """A library the compiler spends about a second on (a 2 MB string built by macros)."""
    src = tmp_path / "slow.c"
    src.write_text("#define A(x) x x x x x x x x\n#define B(x) A(A(A(A(A(A(A(x)))))))\n"
                   "int tm_answer(void) { return 42; }\nconst char *tm_text = \"\" B(\"a\");\n")
    return src


def _wait(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@needs_toolchain
def test_a_build_killed_mid_compile_leaves_no_library_and_the_next_one_succeeds(tmp_path):
    src, build = _slow_source(tmp_path), tmp_path / "build"
    child = subprocess.Popen([sys.executable, "-c", BUILD_AND_CALL, str(src), str(build),
                              *FAST_FLAGS], stdout=subprocess.DEVNULL)
    _wait(lambda: _compilers_running(src, exclude={child.pid}))
    child.send_signal(signal.SIGKILL)
    child.wait()
    names = os.listdir(build)
    assert names and all(n.startswith(native.TEMP_PREFIX) and n.endswith(".tmp") for n in names)

    # The next start builds its own library while the killed one's compiler (in a session
    # of its own) may still be writing to its temp file: the two never meet.
    run = _build_in_child(src, build)
    assert run.returncode == 0 and run.stdout.strip() == "42", run.stderr
    _wait(lambda: not _compilers_running(src))
    library = [n for n in os.listdir(build) if n.endswith(".so")]
    assert len(library) == 1 and native.check_library(str(build / library[0])) is None
    leftovers = [n for n in os.listdir(build) if n.startswith(native.TEMP_PREFIX)]
    old = time.time() - 3600   # past any live build's timeout: its owner is gone for good
    for name in leftovers:
        os.utime(build / name, (old, old))
    native.build_shared_library(str(src), str(build), FAST_FLAGS, timeout_s=60)
    assert sorted(os.listdir(build)) == [library[0], library[0] + native.DIGEST_SUFFIX]


@needs_toolchain
def test_a_damaged_library_is_rebuilt_not_opened(tmp_path):
    src, build = tmp_path / "answer.c", tmp_path / "build"
    src.write_text("int tm_answer(void) { return 42; }\n" +
                   "".join(f"int tm_f{i}(int x) {{ return x * {i} + 1; }}\n" for i in range(300)))
    path = native.build_shared_library(str(src), str(build), FAST_FLAGS)
    assert native.check_library(path) is None
    with open(path, "r+b") as f:   # a disk problem, or a copy cut short
        f.truncate(os.path.getsize(path) // 2)
    assert native.check_library(path).startswith("sha256")
    run = _build_in_child(src, build)
    assert run.returncode == 0 and run.stdout.strip() == "42", run.stderr
    assert "failed its check" in run.stderr   # the warning, through logging's last resort
    os.unlink(path + native.DIGEST_SUFFIX)   # killed between the rename and the digest
    assert native.check_library(path).startswith("no digest")
    run = _build_in_child(src, build)
    assert run.returncode == 0 and run.stdout.strip() == "42" and native.check_library(path) is None
