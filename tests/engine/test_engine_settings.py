"""Kernel settings are each engine's own (ModelConfig fields, not process switches): two
engines in one process with different settings each keep theirs."""
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig
from tokenmill.layers import native

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [3, 3, 8]]
KERNELS = ("tm_rms_norm", "tm_rope", "tm_silu_mul", "tm_linear_small_m", "tm_paged_attention",
           "tm_llama_decode")


def _greedy(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.mark.skipif(not native.buildable(), reason="no C compiler, or a CPU without AVX2")
def test_cpu_kernels_setting_is_per_engine(tiny_llama_dir, monkeypatch):
    lib, calls = native.require(), []
    for name in KERNELS:
        real = getattr(lib, name)
        monkeypatch.setattr(lib, name, lambda *a, real=real, name=name: (calls.append(name), real(*a))[1])
    off = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, enable_prefix_caching=False,
              cpu_kernels=False)
    assert calls == []                       # not even in its start-up warmup
    on = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, enable_prefix_caching=False)
    assert calls                             # the other engine's warmup used them
    calls.clear()
    got_off = _greedy(off)
    assert calls == []                       # the plain engine called no fused kernel
    got_on = _greedy(on)
    assert "tm_llama_decode" in calls        # the other one did, in the same process
    calls.clear()
    assert [o.token_ids for o in _greedy(off)] == [o.token_ids for o in got_off] and calls == []
    for a, b in zip(got_on, got_off):        # same function, other summation order
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la if t in lb)


def test_settings_are_validated_config_fields():
    assert ModelConfig(model="m").cpu_kernels is True
    assert ModelConfig(model="m").quant_activations == "fp32"
    with pytest.raises(ValueError, match="cpu_kernels"):
        ModelConfig(model="m", cpu_kernels="no")
    with pytest.raises(ValueError, match="quant_activations"):
        ModelConfig(model="m", quant_activations=None)
