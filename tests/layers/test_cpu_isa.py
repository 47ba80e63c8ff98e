"""cpu_isa "avx2" / "avx512": one machine runs the code an AVX2-only CPU (a Zen 4) runs. The kernel library is
built without AVX-512, paths that need it (bf16 compute) are refused as there, and the cap is
one per process. End to end, the AVX2 build gives the native build's bits (the kernels' twins
are bit-identical: tests/layers/*both_builds*)."""
import json
import subprocess
import sys

import pytest
import torch

from tokenmill.config import ModelConfig
from tokenmill.layers import native

needs_toolchain = pytest.mark.skipif(not native.buildable(), reason="no C compiler, or a CPU without AVX2")


def test_avx2_cap_hides_what_an_avx2_only_cpu_lacks(monkeypatch):
    host = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                      "avx512_vnni", "avx512_bf16", "amx_tile", "avx_vnni"})
    monkeypatch.setattr(native, "_host_flags", lambda: host)
    monkeypatch.setattr(native, "_isa", "native")
    assert native.has_vnni() and native.has_avx512_bf16()
    assert "-mavx512vnni" in native.build_flags()
    monkeypatch.setattr(native, "_isa", "avx2")
    assert native.cpu_flags() == {"sse4_2", "avx", "avx2", "fma", "f16c"}
    assert native.cpu_supported() and not native.has_vnni() and not native.has_avx512_bf16()
    assert not any(f.startswith("-mavx512") for f in native.build_flags())


def test_avx512_cap_hides_amx_only(monkeypatch):
    """cpu_isa "avx512": a Sapphire Rapids runs what a Zen 4 runs (bf16 mode on vdpbf16ps)."""
    host = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                      "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"})
    monkeypatch.setattr(native, "_host_flags", lambda: host)
    monkeypatch.setattr(native, "_isa", "native")
    assert native.has_amx_bf16()
    monkeypatch.setattr(native, "_isa", "avx512")
    assert native.cpu_flags() == host - {"amx_tile", "amx_bf16", "amx_int8"}
    assert native.has_vnni() and native.has_avx512_bf16() and not native.has_amx_bf16()
    assert "-mavx512vnni" in native.build_flags()


@pytest.mark.parametrize("vendor", ["AuthenticAMD", "GenuineIntel"])
def test_tiled_gemm_prefetch_is_built_into_avx2_builds_and_intels_vnni_build(vendor, monkeypatch):
    """The AVX2 build prefetches on every vendor (Zen 3 measured ahead at 1-2 rows); the VNNI
    build only on Intel (Zen 4's hardware prefetchers keep up, and the extra loads cost)."""
    monkeypatch.setattr(native, "cpu_vendor", lambda: vendor)
    assert native._QG_PREFETCH_FLAG in native.build_flags(vnni=False)
    assert (native._QG_PREFETCH_FLAG in native.build_flags(vnni=True)) == (vendor == "GenuineIntel")
    assert native._QG_PREFETCH_FLAG not in native.build_flags(vnni=False, qg_prefetch=False)


def test_bf16_compute_is_refused_under_the_avx2_cap(monkeypatch):
    from tokenmill.layers.prepacked import check_gemm_dtype
    monkeypatch.setattr(native, "_isa", "avx2")
    with pytest.raises(ValueError, match="AVX-512 BF16"):
        check_gemm_dtype(torch.bfloat16)
    check_gemm_dtype(torch.float32)


def test_one_isa_per_process(monkeypatch):
    monkeypatch.setattr(native, "_isa", "native")
    monkeypatch.setattr(native, "_status", native.BuildStatus())
    with pytest.raises(ValueError, match="cpu_isa must be one of"):
        native.use_isa("sse")
    native.use_isa("avx2")                      # nothing built yet: the cap moves
    assert native.isa() == "avx2"
    monkeypatch.setattr(native, "_status", native.BuildStatus(tried=True))
    native.use_isa("avx2")                      # the same one again: fine
    with pytest.raises(RuntimeError, match="already built for cpu_isa='avx2'"):
        native.use_isa("native")
    with pytest.raises(ValueError, match="cpu_isa"):
        ModelConfig(model="m", cpu_isa="sse")


# a fresh process (the library is one per process): greedy tokens and their logprobs
_GENERATE = """
import json, sys
from tokenmill import LLM, SamplingParams
from tokenmill.layers import native
llm = LLM(model=sys.argv[1], cpu_isa=sys.argv[2], num_threads=2, skip_tokenizer_init=True,
          max_model_len=256, seed=0)
outs = llm.generate([{"prompt_token_ids": [3, 17, 9, 44, 2, 8]}, {"prompt_token_ids": [5] * 21}],
                    SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True),
                    use_tqdm=False)
print(json.dumps({"flags": native.build_flags(), "path": native.status()["path"],
                  "tokens": [o.outputs[0].token_ids for o in outs],
                  "logprobs": [[{str(k): v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs]
                               for o in outs]}))
"""


def _generate(model_dir: str, isa: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _GENERATE, model_dir, isa], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_toolchain
def test_the_avx2_build_runs_the_engine_with_the_native_builds_bits(tiny_llama_dir):
    avx2 = _generate(tiny_llama_dir, "avx2")
    assert not any(f.startswith("-mavx512") for f in avx2["flags"])
    native_run = _generate(tiny_llama_dir, "native")
    if native.has_vnni():   # two builds here: the one an AVX2-only CPU runs is the other one
        assert avx2["path"] != native_run["path"]
    assert avx2["tokens"] == native_run["tokens"]
    assert avx2["logprobs"] == native_run["logprobs"]
