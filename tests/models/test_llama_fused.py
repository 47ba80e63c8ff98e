"""The one-call decoder stack (runner/fused_stack.py + layers/cpu_decode.c) against the
module path: bit-identical hidden states, so identical tokens and logprobs; and it steps
aside whenever it does not apply."""
from types import SimpleNamespace

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers import cpu_ops, native
from tokenmill.runner import fused_stack as llama_fused

# Skipped only where the kernels cannot exist; where they should, a failed build fails here.
pytestmark = pytest.mark.skipif(not native.buildable(), reason="no C compiler, or a CPU without AVX2")

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [3, 3, 8], [12, 40, 11, 6, 6, 1, 30, 22, 19, 4, 5]]


@pytest.fixture(scope="module", params=[16, 64], ids=["head_dim16", "head_dim64"])
def model_dir(request, tmp_path_factory):
    from tests.conftest import save_tiny_llama
    path = tmp_path_factory.mktemp(f"tiny_llama_d{request.param}")
    save_tiny_llama(path, hidden_size=4 * request.param, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=96, num_hidden_layers=3)
    return str(path)


def _generate(model_dir, prompts, fused: bool, monkeypatch, calls: list, quantization=None,
              kv_cache_dtype="auto", activations="fp32", gemm_dtype="float32"):
    real = llama_fused.forward   # the runner's per-step choice of the C stack

    def counting(*args):
        out = real(*args) if fused else None
        calls.append(out is not None)
        return out
    monkeypatch.setattr(llama_fused, "forward", counting)
    llm = LLM(model=model_dir, skip_tokenizer_init=True, block_size=4, enable_prefix_caching=False,
              quantization=quantization, kv_cache_dtype=kv_cache_dtype, quant_activations=activations,
              cpu_gemm_dtype=gemm_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("batch,quantization,kv", [(1, None, "auto"), (3, None, "auto"),
                                                   (1, "int8", "auto"), (3, "int4-g32", "auto"),
                                                   (1, "fp8", "auto"), (3, None, "int8"),
                                                   (1, "gptq-act-order", "auto"),
                                                   (12, None, "auto"), (12, "int8", "int8"),
                                                   (1, "int4-g32:q8", "auto"), (3, "int8:q8", "int8"),
                                                   (6, "gptq-act-order:q8", "auto"),
                                                   (1, "gguf", "auto"), (3, "gguf:q8", "auto"),
                                                   (3, None, "bf16"), (1, "int8", "fp16"),
                                                   (24, None, "auto"), (24, "int8:q8", "int8"),
                                                   (1, "bf16", "auto"), (24, "fp16", "fp16")])
def test_fused_stack_is_bit_identical_to_the_modules(model_dir, monkeypatch, tmp_path, batch,
                                                      quantization, kv):
    """":q8": int8-rounded activations for the int8 / int4 linears (the C stack calls the
    same integer-dot kernel); "gguf": a GGUF with Q4_0 / Q4_1 / Q8_0 tensors kept packed
    (float16 block scales)."""
    prompts = (PROMPTS * 8)[:batch]   # 12: past the kernel's 4-row block; 24: the blocked
    #                                    float kernel's and the tiled q8 GEMM's rows
    quantization, _, activations = (quantization or "").partition(":")
    quantization = quantization or None
    if quantization == "gptq-act-order":   # a checkpoint whose parts permute their inputs
        model_dir, quantization = _gptq_checkpoint(model_dir, tmp_path), None
    if quantization == "gguf":
        model_dir = _tiny_gguf(tmp_path)
    used: list = []
    activations = activations or "fp32"
    fused = _generate(model_dir, prompts, True, monkeypatch, used, quantization, kv, activations)
    plain = _generate(model_dir, prompts, False, monkeypatch, [], quantization, kv, activations)
    assert any(used), "the fused path never ran on decode steps"
    if max(map(len, prompts)) > 8:   # runs longer than the short-run kernel's: SDPA modules
        assert not all(used), "long prefill steps must take the module path"
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: v.logprob for t, v in la.items()} == {t: v.logprob for t, v in lb.items()}


@pytest.mark.parametrize("batch", [3, 24])
def test_fused_stack_in_bf16_mode_is_bit_identical_to_the_modules(model_dir, monkeypatch, batch,
                                                                  bf16_kernel):
    """cpu_gemm_dtype bfloat16: steps of 17-64 rows (24 here) take the tiled bf16 kernel in
    the C stack and in the modules alike; fewer stay float32."""
    from tokenmill.layers import prepacked
    prompts = (PROMPTS * 8)[:batch]
    used: list = []
    fused = _generate(model_dir, prompts, True, monkeypatch, used, gemm_dtype="bfloat16")
    plain = _generate(model_dir, prompts, False, monkeypatch, [], gemm_dtype="bfloat16")
    assert any(used), "the fused path never ran on decode steps"
    model = LLM(model=model_dir, skip_tokenizer_init=True, cpu_gemm_dtype="bfloat16").engine.model
    assert prepacked.bf16_tiles(model.model.layers[0].mlp.down_proj) is not None
    assert llama_fused.stack_plan(model).max_rows("fp32") == cpu_ops.LINEAR_MAX_ROWS
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: v.logprob for t, v in la.items()} == {t: v.logprob for t, v in lb.items()}


def _tiny_gguf(tmp_path) -> str:
    import numpy as np
    pytest.importorskip("gguf")
    from tests.models.test_gguf_reader import write_tiny_llama
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, np.random.default_rng(3))
    model = LLM(model=str(path), quantization="gguf").engine.model
    o_proj = model.model.layers[0].self_attn.o_proj   # Q4_1: fp16 block fields kept half
    assert o_proj.packed[0].scales.dtype is torch.float16 and o_proj.packed[0].mins.dtype is torch.float16
    assert llama_fused.stack_plan(model) is not None
    return str(path)


def _gptq_checkpoint(model_dir, tmp_path) -> str:
    from tokenmill.layers.linear import Linear
    from tokenmill.models.loader import open_checkpoint
    from tokenmill.quantization import writer
    from tokenmill.quantization.gptq import HessianAccumulator
    from tokenmill.quantization.quantize import QuantizeArgs, _quantize_tensors, linear_prefixes

    class Stats:   # random correlated calibration inputs: distinct act-orders per layer
        def __init__(self, model):
            g = torch.Generator().manual_seed(0)
            self.hessians = {}
            for name, m in model.named_modules():
                if isinstance(m, Linear) and not name.endswith("lm_head"):
                    x = torch.randn(256, m.in_features, generator=g) * torch.rand(m.in_features, generator=g)
                    self.hessians[name] = HessianAccumulator(m.in_features)
                    self.hessians[name].add(x)

    out = str(tmp_path / "gptq")
    source = open_checkpoint(model_dir)
    model = LLM(model=model_dir, skip_tokenizer_init=True).engine.model
    args = QuantizeArgs(model=model_dir, method="gptq", output=out, bits=4, group_size=32, act_order=True)
    written = _quantize_tensors(args, dict(source.iter_tensors()), linear_prefixes(model), Stats(model), model)
    writer.write_checkpoint(out, source.hf_config, written,
                            writer.quantization_config("gptq", 4, 32, desc_act=True))
    loaded = LLM(model=out, skip_tokenizer_init=True).engine.model
    assert any(p.perm is not None for p in loaded.model.layers[0].mlp.down_proj.packed)
    assert llama_fused.stack_plan(loaded) is not None
    return out


def test_fused_stack_steps_aside(model_dir):
    llm = LLM(model=model_dir, skip_tokenizer_init=True, enable_prefix_caching=False)
    model = llm.engine.model
    assert llama_fused.stack_plan(model) is not None
    plan = llama_fused.stack_plan(model)
    assert plan.usable()
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert not plan.usable()          # a hook must see its module run
    handle.remove()
    assert plan.usable()
    # a hook registered elsewhere changes nothing; one on a deep module after that is caught
    # (usable() skips its scan only while no hook was registered anywhere since the last one)
    elsewhere = torch.nn.Linear(2, 2).register_forward_hook(lambda *a: None)
    assert plan.usable() and plan.usable()
    elsewhere.remove()
    pre = model.model.layers[1].self_attn.o_proj.register_forward_pre_hook(lambda *a: None)
    assert not plan.usable() and not plan.usable()
    pre.remove()
    assert plan.usable()
    layer = model.model.layers[1].self_attn.o_proj
    old = layer.weight
    layer.weight = torch.nn.Parameter(old.clone(), requires_grad=False)
    assert not plan.usable()          # a swapped weight is never read through a stale address
    layer.weight = old
    x = torch.zeros(cpu_ops.LINEAR_MAX_ROWS + 1, model.args.hidden_size)
    assert llama_fused.run_layers(model, x, torch.zeros(x.shape[0], dtype=torch.int64), [], None,
                                  llm.engine.runner.backend) is None   # prefill-sized


@pytest.mark.parametrize("quantization,activations,rows", [
    (None, "fp32", cpu_ops.LINEAR_MAX_ROWS), ("int8", "q8", cpu_ops.LINEAR_MAX_ROWS),
    ("int8", "fp32", 16), ("fp8", "q8", 16)])
def test_stack_rows_stop_where_a_streaming_kernel_stops(model_dir, quantization, activations, rows):
    """Float and tiled q8 linears take the stack up to the float kernel's rows; a part that
    streams (float activations, or fp8 without tiles) only up to its method's kernel_max_rows
    (16): the modules would multiply a dequantized copy past it, with other bits."""
    llm = LLM(model=model_dir, skip_tokenizer_init=True, enable_prefix_caching=False,
              quantization=quantization, quant_activations=activations)
    model = llm.engine.model
    plan = llama_fused.stack_plan(model)
    assert plan.max_rows(plan.activations()) == rows
    meta = SimpleNamespace(max_query_len=1, prompt_runs=())   # a decode step of rows + 1 requests
    x = torch.zeros(rows + 1, model.args.hidden_size)
    kv = llm.engine.runner.kv_caches
    assert llama_fused.run_layers(model, x, torch.zeros(rows + 1, dtype=torch.int64), kv, meta,
                                  llm.engine.runner.backend) is None


def test_plan_rescans_its_pins_only_after_an_assignment(tiny_llama_dir, monkeypatch):
    """usable() skips the pin scan while no parameter, buffer or packed entry was assigned
    anywhere since a scan found every pin held; each kind of assignment is still caught."""
    model = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, quantization="int8").engine.model
    plan = llama_fused.stack_plan(model)
    assert plan.usable()
    scans = []

    class Counted(tuple):   # the pin columns, noting each time a scan unpacks them
        def __iter__(self):
            scans.append(1)
            return super().__iter__()
    monkeypatch.setattr(plan, "_pin_columns", Counted(plan._pin_columns))
    assert plan.usable() and plan.usable() and scans == []   # nothing assigned: no scan
    lin = model.model.layers[0].mlp.down_proj
    old_packed = lin.packed
    lin.packed = list(old_packed)          # a plain attribute: counted by Linear itself
    assert not plan.usable() and not plan.usable() and len(scans) == 2
    lin.packed = old_packed
    assert plan.usable() and plan.usable() and len(scans) == 3
    norm = model.model.layers[1].input_layernorm
    old_weight = norm.weight
    norm.weight = torch.nn.Parameter(old_weight.clone(), requires_grad=False)   # not a Linear
    assert not plan.usable()
    norm.weight = old_weight
    rotary = model.model.layers[0].self_attn.rotary
    old_cos = rotary.cos
    rotary.cos = old_cos.clone()           # a buffer
    assert not plan.usable()
    rotary.cos = old_cos
    assert plan.usable()


def test_stacks_the_c_path_cannot_reproduce_are_not_planned(tmp_path, tiny_llama_dir):
    from tests.conftest import save_tiny_llama
    from tokenmill.layers.quant.methods import set_quant_activations
    save_tiny_llama(tmp_path, hidden_act="gelu")   # exact GELU: no C kernel computes it
    assert llama_fused.stack_plan(LLM(model=str(tmp_path), skip_tokenizer_init=True).engine.model) is None
    model = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, quantization="int8").engine.model
    planned = llama_fused.stack_plan(model)
    assert planned is not None and planned.usable() and planned.activations() == "fp32"
    set_quant_activations(model, "q8")   # integer-dot activations: the C path runs them too
    assert planned.usable() and planned.activations() == "q8"


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    import transformers
    path = tmp_path_factory.mktemp("tiny_mixtral")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, initializer_range=0.3, max_position_embeddings=256)
    transformers.MixtralForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("batch,quantization", [(1, None), (3, None), (3, "int8:q8"), (12, "int4-g32")])
def test_moe_stack_runs_attention_in_c_bit_identical(mixtral_dir, monkeypatch, batch, quantization):
    """An MoE model takes the C stack for each layer's attention half, its experts as
    modules in between: the same bits as the module path."""
    quantization, _, activations = (quantization or "").partition(":")
    prompts = (PROMPTS * 4)[:batch]
    used: list = []
    fused = _generate(mixtral_dir, prompts, True, monkeypatch, used, quantization or None,
                      activations=activations or "fp32")
    plain = _generate(mixtral_dir, prompts, False, monkeypatch, [], quantization or None,
                      activations=activations or "fp32")
    assert any(used), "the fused path never ran on decode steps"
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: v.logprob for t, v in la.items()} == {t: v.logprob for t, v in lb.items()}
