"""Fixtures shared by the kernel tests of tests/layers/ and tests/layers/quant/."""
import pytest

from tokenmill.layers import native


@pytest.fixture(scope="session")
def both_builds(tmp_path_factory):
    """The kernel library built without and with AVX-512 VNNI, each with and without the
    tiled GEMM's software prefetch (which only moves loads earlier). Each build's kernels
    must give the same bits."""
    import ctypes
    out = tmp_path_factory.mktemp("kernel_builds")
    return [native.declare(ctypes.CDLL(native.build_shared_library(
        native.SOURCE, str(out), native.build_flags(vnni, prefetch))))
        for vnni, prefetch in ((False, False), (False, True), (True, False), (True, True))]
