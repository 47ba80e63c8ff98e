"""Mixture-of-Experts GGUF files (llama.cpp conventions) load as the HF checkpoint they came
from: config keys transformers reads, one HF tensor per expert out of each stacked
``ffn_*_exps`` tensor (eager, lazy and packed), and clear errors for lying files."""
import json
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file, save_file  # noqa: E402

from tests.models.gguf_moe_writer import write_moe_gguf  # noqa: E402
from tokenmill.layers.lazy import LazyTensor, materialize  # noqa: E402
from tokenmill.layers.quant import gguf as gguf_quant  # noqa: E402
from tokenmill.models.loader import CheckpointError, open_checkpoint  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=128, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
# arch -> (HF config class, model class, extra config, MoE keys transformers reads)
MODELS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4),
                ("num_local_experts", "num_experts_per_tok", "intermediate_size", "sliding_window")),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                 dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=96),
                 ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "intermediate_size")),
    # head_dim 32 != hidden / heads: the file needs key_length
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                 dict(num_experts=4, moe_intermediate_size=32, head_dim=32, norm_topk_prob=True),
                 ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "decoder_sparse_step", "mlp_only_layers", "head_dim")),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, clip_qkv=2.5),
              ("num_experts", "num_experts_per_tok", "intermediate_size", "norm_topk_prob", "clip_qkv")),
}
HF_TYPES = {"mixtral": ("MixtralForCausalLM", "mixtral"), "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
            "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"), "olmoe": ("OlmoeForCausalLM", "olmoe")}


def build_hf(arch: str, directory) -> tuple[object, dict[str, np.ndarray]]:
    """A seeded tiny model with every parameter random (norms too), saved; its saved tensors."""
    config_cls, model_cls, extra, _ = MODELS[arch]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **extra)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    return model, load_file(os.path.join(directory, "model.safetensors"))


@pytest.fixture(scope="module", params=sorted(MODELS))
def moe(request, tmp_path_factory):
    arch, root = request.param, tmp_path_factory.mktemp(request.param)
    model, saved = build_hf(arch, root / "hf")
    path = str(root / "f32.gguf")
    write_moe_gguf(root / "hf", path, arch)
    return arch, model, saved, path, root


def _moe_only(name: str) -> bool:
    return ".experts." in name


def test_config_has_the_moe_keys_transformers_reads(moe):
    arch, model, _, path, _ = moe
    cfg = open_checkpoint(path).hf_config
    assert (cfg["architectures"], cfg["model_type"]) == ([HF_TYPES[arch][0]], HF_TYPES[arch][1])
    for key in MODELS[arch][3]:
        assert cfg[key] == getattr(model.config, key), key
    assert cfg["num_experts_per_tok"] == 2


def test_eager_tensors_equal_the_saved_checkpoint(moe):
    _, _, saved, path, _ = moe
    got = dict(open_checkpoint(path).iter_tensors())
    assert set(got) == set(saved)
    assert sum(map(_moe_only, got)) == 2 * 4 * 3   # layers x experts x (gate, up, down)
    for name, values in saved.items():
        assert got[name].dtype == torch.float32 and tuple(got[name].shape) == values.shape, name
        np.testing.assert_array_equal(got[name].numpy(), values, err_msg=name)


def test_lazy_experts_read_only_their_slice(moe):
    _, _, saved, path, _ = moe
    got = dict(open_checkpoint(path).iter_tensors(lazy=True))
    assert set(got) == set(saved)
    for name, values in saved.items():
        np.testing.assert_array_equal(materialize(got[name]).numpy(), values, err_msg=name)
    expert = next(n for n in got if n.endswith(("experts.2.gate_proj.weight", "experts.2.w1.weight")))
    assert isinstance(got[expert], LazyTensor) and tuple(got[expert].shape) == saved[expert].shape
    half = saved[expert].shape[0] // 2
    rows = got[expert].narrow(0, half, half)   # one TP rank's rows
    np.testing.assert_array_equal(rows.narrow(1, 32, 32).materialize().numpy(), saved[expert][half:, 32:])
    np.testing.assert_array_equal(rows.narrow(1, 8, 40).materialize().numpy(), saved[expert][half:, 8:48])


def test_config_and_tensors_rebuild_the_hf_model(moe):
    """Our config dict + tensors, handed back to transformers, compute the original logits:
    every key means what transformers means by it (routing, norms, head_dim, clip)."""
    arch, model, _, path, root = moe
    ckpt = open_checkpoint(path)
    out = root / "rebuilt"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(ckpt.hf_config))
    save_file({n: t.numpy() for n, t in ckpt.iter_tensors()}, str(out / "model.safetensors"))
    rebuilt = getattr(transformers, MODELS[arch][1]).from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 77, 3, 100, 42, 8]])
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def q8(moe):
    arch, _, saved, _, root = moe
    path = str(root / "q8.gguf")
    expected = write_moe_gguf(root / "hf", path, arch, quant="Q8_0")
    return arch, saved, path, expected


def test_q8_experts_equal_gguf_dequantization(q8):
    _, saved, path, expected = q8
    assert set(expected) == set(saved)
    for lazy in (False, True):
        got = dict(open_checkpoint(path).iter_tensors(lazy=lazy))
        assert set(got) == set(saved)
        for name, values in expected.items():
            np.testing.assert_array_equal(materialize(got[name]).numpy(), values, err_msg=name)
            if _moe_only(name):   # really quantized: close to, not equal to, the float weight
                assert not np.array_equal(values, saved[name])
                np.testing.assert_allclose(values, saved[name], atol=0.02)
            else:
                np.testing.assert_array_equal(values, saved[name])


def test_packed_path_yields_each_expert_packed(q8):
    _, saved, path, expected = q8
    ckpt = open_checkpoint(path)
    types = gguf_quant.tensor_types(ckpt)
    experts = sorted(n for n in saved if _moe_only(n))
    assert set(types) == set(saved) and {types[n] for n in experts} == {"Q8_0"}
    plan = {n: ([n[:-len(".weight")]], False) for n in experts}
    got = {name: materialize(t) for name, t in gguf_quant.iter_tensors(ckpt, plan)}
    assert set(got) == {f"{n[:-7]}.{k}" for n in experts for k in ("qweight", "scales")} | (set(saved) - set(experts))
    lazy = dict(gguf_quant.iter_tensors(ckpt, plan, lazy=True))
    assert set(lazy) == set(got)
    for name, t in lazy.items():
        torch.testing.assert_close(materialize(t), got[name], rtol=0, atol=0, msg=name)
    for name in experts:
        q, d = got[f"{name[:-7]}.qweight"], got[f"{name[:-7]}.scales"]
        assert q.dtype == torch.int8 and tuple(q.shape) == expected[name].shape
        assert tuple(d.shape) == (q.shape[0], q.shape[1] // 32)
        values = (q.float().reshape(q.shape[0], -1, 32) * d[..., None]).reshape(q.shape)
        np.testing.assert_array_equal(values.numpy(), expected[name], err_msg=name)


@pytest.mark.parametrize("quant", [None, "Q8_0"])
def test_old_mixtral_files_with_split_experts(tmp_path, quant):
    _, saved = build_hf("mixtral", tmp_path / "hf")
    path = str(tmp_path / "split.gguf")
    expected = write_moe_gguf(tmp_path / "hf", path, "mixtral", quant=quant, split_experts=True)
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert "blk.1.ffn_down.3.weight" in names and not any("_exps" in n for n in names)
    ckpt = open_checkpoint(path)
    assert ckpt.hf_config["num_local_experts"] == 4
    for lazy in (False, True):
        got = dict(ckpt.iter_tensors(lazy=lazy))
        assert set(got) == set(saved)
        for name, values in expected.items():
            np.testing.assert_array_equal(materialize(got[name]).numpy(), values, err_msg=name)


# ---- malformed files ----------------------------------------------------------------

def _rewrite(src: str, dst: str, drop=(), replace=None, add=(), kv=None) -> str:
    """Copy a GGUF, dropping / replacing / adding tensors and overriding metadata values
    (a new key is written as u32)."""
    kv = dict(kv or {})
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        value = kv.pop(key, field.contents())
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    for key, value in kv.items():
        w.add_key_value(key, value, gguf.GGUFValueType.UINT32)
    for t in r.tensors:
        if t.name in drop:
            continue
        if replace and t.name in replace:
            w.add_tensor(t.name, replace[t.name])
        else:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    for name, values in add:
        w.add_tensor(name, values)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    return dst


def _tensor(path: str, name: str) -> np.ndarray:
    return next(np.array(t.data) for t in gguf.GGUFReader(path).tensors if t.name == name)


def _prefix(arch: str) -> str:
    return "llama" if arch == "mixtral" else arch


def test_expert_count_lies_are_rejected_before_sizing_anything(moe, tmp_path):
    arch, _, _, path, _ = moe
    p = _prefix(arch)
    for count, message in ((10**9, r"expected \(1000000000,"), (3, r"expected \(3,"), (8, r"expected \(8,")):
        bad = _rewrite(path, str(tmp_path / f"lie{count}.gguf"), kv={f"{p}.expert_count": count})
        with pytest.raises(CheckpointError, match=message):
            open_checkpoint(bad)
    bad = _rewrite(path, str(tmp_path / "topk.gguf"), kv={f"{p}.expert_used_count": 5})
    with pytest.raises(CheckpointError, match="5 experts per token but only 4"):
        open_checkpoint(bad)
    bad = _rewrite(path, str(tmp_path / "sigmoid.gguf"), kv={f"{p}.expert_gating_func": 2})
    with pytest.raises(CheckpointError, match="gating"):
        open_checkpoint(bad)


def test_wrong_or_missing_expert_tensors_are_named(moe, tmp_path):
    arch, _, _, path, _ = moe
    up = _tensor(path, "blk.1.ffn_up_exps.weight")
    bad = _rewrite(path, str(tmp_path / "short.gguf"), replace={"blk.1.ffn_up_exps.weight": up[:3]})
    with pytest.raises(CheckpointError, match=r"blk.1.ffn_up_exps.weight' has shape \(3,"):
        open_checkpoint(bad)
    bad = _rewrite(path, str(tmp_path / "narrow.gguf"), replace={"blk.1.ffn_up_exps.weight": up[:, :16]})
    with pytest.raises(CheckpointError, match="blk.1.ffn_up_exps.weight' has shape"):
        open_checkpoint(bad)
    bad = _rewrite(path, str(tmp_path / "router.gguf"), replace={"blk.0.ffn_gate_inp.weight": up[0]})
    with pytest.raises(CheckpointError, match="blk.0.ffn_gate_inp.weight' has shape"):
        open_checkpoint(bad)
    up_name = "w3" if arch == "mixtral" else "up_proj"
    bad = _rewrite(path, str(tmp_path / "missing.gguf"), drop=("blk.1.ffn_up_exps.weight",))
    with pytest.raises(CheckpointError, match=rf"missing tensors: model\.layers\.1\.\S+\.experts\.0\.{up_name}"):
        open_checkpoint(bad)


@pytest.mark.parametrize("moe", ["mixtral"], indirect=True)   # split experts: old llama-arch files
def test_stacked_and_split_copies_of_one_expert_are_rejected(moe, tmp_path):
    _, _, _, path, _ = moe
    one = _tensor(path, "blk.0.ffn_gate_exps.weight")[1]
    bad = _rewrite(path, str(tmp_path / "twice.gguf"), add=[("blk.0.ffn_gate.1.weight", one)])
    with pytest.raises(CheckpointError, match="experts.1.w1.weight is stored twice"):
        open_checkpoint(bad)
    bad = _rewrite(path, str(tmp_path / "extra.gguf"), add=[("blk.0.ffn_gate.4.weight", one)])
    with pytest.raises(CheckpointError, match="ffn_gate.4.weight' does not fit"):
        open_checkpoint(bad)


@pytest.mark.parametrize("moe", ["qwen2moe"], indirect=True)   # the one with a shared expert
def test_qwen2moe_shared_expert_gate_as_a_vector(moe, tmp_path):
    """llama.cpp reads ffn_gate_inp_shexp as [hidden]; a file storing it so loads as HF's [1, hidden]."""
    _, _, saved, path, _ = moe
    gate = _tensor(path, "blk.0.ffn_gate_inp_shexp.weight").reshape(-1)
    vec = _rewrite(path, str(tmp_path / "vec.gguf"), replace={"blk.0.ffn_gate_inp_shexp.weight": gate})
    assert _tensor(vec, "blk.0.ffn_gate_inp_shexp.weight").ndim == 1
    name = "model.layers.0.mlp.shared_expert_gate.weight"
    for lazy in (False, True):
        got = dict(open_checkpoint(vec).iter_tensors(lazy=lazy))
        assert tuple(got[name].shape) == (1, 64)
        np.testing.assert_array_equal(materialize(got[name]).numpy(), saved[name])
    bad = _rewrite(path, str(tmp_path / "bad.gguf"), replace={"blk.0.ffn_gate_inp_shexp.weight": gate[:32]})
    with pytest.raises(CheckpointError, match="ffn_gate_inp_shexp.weight' has shape"):
        open_checkpoint(bad)
