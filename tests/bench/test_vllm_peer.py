"""The vLLM peer's KV budget comes from the model's HF config (vLLM itself is optional)."""
import json

from tokenmill.bench.peers.vllm_engine import _kv_bytes_per_token


def test_kv_bytes_per_token_from_the_hf_config(tmp_path):
    cfg = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
           "num_hidden_layers": 30}   # SmolLM2-135M: head_dim from hidden / heads
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert _kv_bytes_per_token(str(tmp_path), "float32") == 2 * 30 * 3 * 64 * 4
    assert _kv_bytes_per_token(str(tmp_path), "bfloat16") == 2 * 30 * 3 * 64 * 2
    cfg.update(head_dim=256, num_key_value_heads=None, num_attention_heads=4)   # explicit head_dim
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert _kv_bytes_per_token(str(tmp_path), "bfloat16") == 2 * 30 * 4 * 256 * 2
