# usage: ONEDNN_MAX_CPU_ISA=AVX2 python throughput_avx2_build.py PRECISION x TREE: throughput_ab.py with the kernels built without AVX-512 and oneDNN held to AVX2
# the AVX2 build of the kernels and oneDNN held to AVX2 (run with ONEDNN_MAX_CPU_ISA=AVX2): an AVX2-only CPU's code paths on this one
import sys, runpy
sys.path.insert(0, sys.argv[3])
from tokenmill.layers import native
native.has_vnni = lambda: False
sys.argv = ["tput.py"] + sys.argv[1:]
runpy.run_path(__import__("os").path.join(__import__("os").path.dirname(__file__), "throughput_ab.py"), run_name="__main__")
