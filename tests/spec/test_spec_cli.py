"""`tokenmill verify-spec` on the tiny model: PASS for a correct configuration (exit 0)."""
from tokenmill.entrypoints.cli import main


def test_verify_spec_passes(tiny_llama_dir, capsys):
    rc = main(["verify-spec", "--model", tiny_llama_dir, "--speculative-config",
               '{"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3}',
               "--prompt-ids", "5,6,7,5,6,7,5,6", "--prompt-ids", "9,10,11,12,9,10",
               "--max-tokens", "8", "--num-samples", "200", "--sample-tokens", "2"])
    out = capsys.readouterr().out
    assert "greedy: PASS" in out and "PASS" in out.splitlines()[-2], out
    assert rc == 0
