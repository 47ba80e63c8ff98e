"""`tokenmill eval ppl` (quantization/ppl.evaluate): perplexity over token windows, KL to a
base model, and the settings it scored with (bf16 mode: which matmul kernel ran)."""
import math

import pytest
import torch

from tokenmill.layers import native
from tokenmill.quantization import calibration, ppl


@pytest.fixture
def random_windows(monkeypatch):
    """Windows of random token ids instead of ShareGPT text (no dataset needed)."""
    def windows(tokenizer, split, num_windows, seq_len, cache_dir=None):
        g = torch.Generator().manual_seed(num_windows * 7 + seq_len)
        return [torch.randint(3, 200, (seq_len,), generator=g).tolist() for _ in range(num_windows)]
    monkeypatch.setattr(calibration, "text_token_windows", windows)


def test_perplexity_and_kl_to_itself(tiny_smollm2_chat_dir, random_windows):
    out = ppl.evaluate(tiny_smollm2_chat_dir, max_tokens=96, context_len=33, kl_base="same", num_threads=2)
    assert out["num_tokens"] == 96 and out["context_len"] == 33
    assert 1.0 < out["perplexity"] and math.isfinite(out["perplexity"])
    assert out["kl_divergence"] == 0.0   # the same model, the same bits
    assert out["cpu_gemm_dtype"] == "float32" and out["cpu_isa"] == "native"
    assert out["bf16_matmul"] is None


@pytest.mark.skipif(not native.has_avx512_bf16(), reason="CPU without AVX-512 BF16")
def test_bf16_mode_is_scored_against_float32_and_names_its_kernel(tiny_smollm2_chat_dir, random_windows):
    out = ppl.evaluate(tiny_smollm2_chat_dir, max_tokens=64, context_len=33, kl_base="same",
                       num_threads=2, cpu_gemm_dtype="bfloat16")
    assert out["bf16_matmul"] == native.bf16_kernel() and out["bf16_matmul"] in ("amx", "avx512")
    assert 0.0 < out["kl_divergence"] < 0.01   # rounded, and close
