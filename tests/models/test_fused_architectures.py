"""The one-call C decode stack (runner/fused_stack.py, fused_plan.py, layers/cpu_decode.c)
on every dense architecture besides plain Llama: Gemma 3 (sandwich norms, Gemma norms,
per-head q/k norms, gelu-tanh, local and global layers with their own RoPE tables), Qwen2
(q/k/v biases, sliding windows on some layers), Qwen3 (per-head q/k norms, biases on
q/k/v/o) and Mistral (sliding window, head_dim 16).

Each decode step the fused stack takes is run again through the modules (cpu kernels on)
on the same inputs: the hidden states must be torch.equal, and the modules must rewrite
the KV cache with exactly the bits the C stack wrote."""
import re

import pytest
import torch

from tests.models.test_tiny_architectures import ARCHS, COMMON, _randomize_norms_and_biases, assert_matches_hf
from tokenmill import LLM, SamplingParams
from tokenmill.layers import native
from tokenmill.runner import fused_plan, fused_stack

pytestmark = pytest.mark.skipif(not native.buildable(), reason="no C compiler, or a CPU without AVX2")

NAMES = ["gemma3", "gemma3-kv1", "qwen2", "qwen3", "mistral"]
# one KV head, as Gemma3-270m has: its [T, 1, D] k views are strided rows
VARIANTS = {"gemma3-kv1": ("gemma3", dict(num_key_value_heads=1))}
# mixed lengths: short prompts (<= 8) take the fused stack from their prefill on, longer
# ones run prefill through the modules and join the decode batch; prompts pass the
# sliding window (8) so local layers drop keys
PROMPTS = [[(11 * i + 5 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([3, 13, 6, 21, 9, 2])]


def _save_tiny(name: str, path) -> tuple:
    """(the HF model, its directory): test_tiny_architectures' tiny random model of ``name``."""
    import transformers
    base, overrides = VARIANTS.get(name, (name, {}))
    config_cls, model_cls, extra = ARCHS[base]
    cfg = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(cfg).float().eval()
    _randomize_norms_and_biases(hf)   # Gemma's norms start at 0, biases at 0: catch misrouting
    hf.save_pretrained(path, safe_serialization=True)
    return hf, str(path)


@pytest.fixture(scope="module", params=NAMES)
def arch(request, tmp_path_factory):
    return request.param, _save_tiny(request.param, tmp_path_factory.mktemp(request.param))[1]


def _cache_tensors(cache) -> list:
    """A float cache tensor, or an int8 cache's values and per-slot scales."""
    return [cache] if isinstance(cache, torch.Tensor) else [cache.values, cache.scale]


def _checked_forward(real, seen: list):
    """fused_stack.forward that, whenever the C stack ran, runs the modules on the same
    step and records whether hidden states and the rewritten KV cache are the same bits."""
    def forward(model, input_ids, positions, kv_caches, meta, backend, aux=None):
        fused = real(model, input_ids, positions, kv_caches, meta, backend, aux)
        if fused is None:
            return None
        written = [t.clone() for pair in kv_caches for c in pair for t in _cache_tensors(c)]
        modules = model(input_ids, positions, kv_caches, meta, backend)
        rewritten = [t for pair in kv_caches for c in pair for t in _cache_tensors(c)]
        seen.append((input_ids.shape[0], len(meta.query_lens), torch.equal(fused, modules),
                     all(torch.equal(a, b) for a, b in zip(written, rewritten))))
        return fused
    return forward


@pytest.mark.parametrize("quantization,kv", [(None, "auto"), (None, "int8"), ("int8:q8", "auto"),
                                             ("int8:q8", "int8")])
def test_fused_stack_is_bit_identical_to_the_modules(arch, monkeypatch, quantization, kv):
    """float weights or packed int8 with int8-rounded (q8) activations; fp32 or int8 KV."""
    name, path = arch
    quantization, _, activations = (quantization or "").partition(":")
    seen: list = []
    monkeypatch.setattr(fused_stack, "forward", _checked_forward(fused_stack.forward, seen))
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=96,
              enable_prefix_caching=False, quantization=quantization or None, kv_cache_dtype=kv,
              quant_activations=activations or "fp32")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    decode_batches = {batch for tokens, batch, _, _ in seen if tokens == batch}
    assert len(seen) >= 7 and max(decode_batches) == len(PROMPTS), seen   # every request decoding
    assert all(same_hidden for _, _, same_hidden, _ in seen), f"{name}: hidden states differ: {seen}"
    assert all(same_cache for _, _, _, same_cache in seen), f"{name}: KV cache bits differ: {seen}"


def _row(plan, layer: int) -> dict:
    return dict(zip(fused_plan.LAYER_FIELDS, plan.layers[layer].tolist()))


def test_every_architecture_is_planned_with_what_its_layers_have(arch):
    name, path = arch
    model = LLM(model=path, skip_tokenizer_init=True).engine.model
    assert fused_stack.stack_kind(model) == "dense"
    plan = fused_stack.stack_plan(model)
    assert plan is not None and plan.usable() and plan.layers.shape == (3, len(fused_plan.LAYER_FIELDS))
    rows = [_row(plan, i) for i in range(3)]
    windows = [r["window"] for r in rows]
    name = VARIANTS.get(name, (name,))[0]
    if name == "gemma3":
        assert all(r["gemma"] == 1 and r["act"] == 1 and r["norm_pre_ffn"] and r["norm_post_ffn"]
                   and r["q_norm"] and r["k_norm"] for r in rows)
        assert windows == [8, 0, 8]
        assert rows[0]["cos"] == rows[2]["cos"] != rows[1]["cos"]   # local and global RoPE tables
    else:
        assert all(r["gemma"] == 0 and r["act"] == 0 and not r["norm_pre_ffn"] for r in rows)
    assert all(bool(r["q_norm"]) == (name in ("gemma3", "qwen3")) for r in rows)
    assert all(bool(r["bias_qkv"]) == (name in ("qwen2", "qwen3")) for r in rows)
    assert all(bool(r["bias_o"]) == (name == "qwen3") for r in rows)
    assert windows == {"gemma3": [8, 0, 8], "qwen2": [0, 8, 8], "qwen3": [0, 0, 0], "mistral": [8, 8, 8]}[name]


def test_gemma3_greedy_still_equals_hf_through_the_fused_stack(tmp_path, monkeypatch):
    hf, path = _save_tiny("gemma3-kv1", tmp_path)   # test_tiny_architectures has the other
    used: list = []
    real = fused_stack.forward
    monkeypatch.setattr(fused_stack, "forward", lambda *a: used.append(real(*a)) or used[-1])
    llm = LLM(model=path, skip_tokenizer_init=True, num_kv_blocks=64, block_size=4)
    assert_matches_hf(hf, llm)
    assert any(out is not None for out in used), "decode steps did not take the fused stack"


def test_layer_fields_match_the_c_enum():
    """fused_plan.LAYER_FIELDS lists cpu_decode.c's LD_* fields in the same order."""
    import os
    with open(os.path.join(os.path.dirname(native.SOURCE), "cpu_decode.c")) as f:
        body = re.search(r"enum \{(.*?)\};", f.read(), re.S).group(1)
    names = re.findall(r"\bLD_([A-Z_]+)\b", re.sub(r"/\*.*?\*/", "", body, flags=re.S))
    assert names[-1] == "FIELDS"
    assert tuple(n.lower() for n in names[:-1]) == fused_plan.LAYER_FIELDS
