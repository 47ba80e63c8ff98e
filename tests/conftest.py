"""Shared fixtures: tiny random-weight models saved with transformers (the numerical oracle)."""
import os

import pytest
import torch

# Two threads on CI; tests don't need more and must not oversubscribe.
torch.set_num_threads(min(2, os.cpu_count() or 1))

# Triton kernels run in Triton's interpreter on CPU tensors where no GPU is present (CI): the
# switch is read when a kernel is decorated, so it must be set before any kernel module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _small_pages_unless_marked(request, monkeypatch):
    """Engines built in the test process keep 4 KB pages unless the test is marked
    ``huge_pages`` (tests/utils/test_hugepages.py): collapsing a model's weights costs ~0.3-3 s
    a GB at load (docs/bench/2026-12-07i), and the suite builds hundreds of engines."""
    if request.node.get_closest_marker("huge_pages") is None:
        from tokenmill.utils import hugepages
        monkeypatch.setattr(hugepages, "supported", lambda: False)


@pytest.fixture(scope="session")
def triton_device() -> torch.device:
    """Where the Triton kernel tests put their tensors: the GPU when there is one (compiled
    kernels), else the CPU (the interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def save_tiny_llama(path, seed=0, **overrides):
    import transformers
    cfg = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
               initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def save_tiny_chat_llama(path, tok, max_position_embeddings):
    """A tiny random Llama that speaks ``tok``'s vocabulary and chat template (tokenizer
    files saved beside it), so chat and text paths run without real weights."""
    import json
    save_tiny_llama(path, vocab_size=tok.vocab_size, max_position_embeddings=max_position_embeddings,
                    bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=None)
    tok.backend.save(str(path / "tokenizer.json"))
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": tok.chat_template, "eos_token": tok.eos_token,
                   "bos_token": tok.bos_token}, f)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_llama(path)
    return str(path)


@pytest.fixture(scope="session")
def looping_llama_dir(tmp_path_factory):
    """Tiny Llama with larger weights: its greedy continuations have structure (runs, cycles)
    that a drafter can learn and prompt lookup can match."""
    path = tmp_path_factory.mktemp("looping_llama")
    save_tiny_llama(path, num_hidden_layers=4, seed=3, initializer_range=0.12)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_hf(tiny_llama_dir):
    import transformers
    return transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(params=["avx512", "amx"])
def bf16_kernel(request):
    """Each bf16 matmul kernel this CPU has, switched on for the test (bf16 mode's tests):
    vdpbf16ps everywhere bf16 mode runs, AMX tiles where the CPU has them (the process's
    default there)."""
    from tokenmill.layers import native
    if not native.has_avx512_bf16():
        pytest.skip("CPU without AVX-512 BF16")
    if request.param == "amx" and not native.has_amx_bf16():
        pytest.skip("CPU without AMX-BF16")
    lib = native.require()
    was = lib.tm_amx_active()
    if lib.tm_amx_enable(int(request.param == "amx")):
        pytest.skip("the kernel refused AMX tile state")
    yield request.param
    lib.tm_amx_enable(was)


@pytest.fixture(scope="session")
def tiny_smollm2_chat_dir(tmp_path_factory):
    """A tiny random Llama that speaks SmolLM2's tokenizer and chat template (1024 positions).
    Skipped where the SmolLM2 files are not cached and cannot be fetched."""
    from tokenmill.models.hub import resolve_model
    from tokenmill.models.loader import load_tokenizer
    try:
        tok = load_tokenizer(resolve_model("smollm2-135m"))
    except Exception as e:  # no network and no cache
        pytest.skip(f"SmolLM2 tokenizer unavailable: {e}")
    return save_tiny_chat_llama(tmp_path_factory.mktemp("tiny_smollm2_chat"), tok,
                                max_position_embeddings=1024)
