"""The `tokenmill` command line on the real default model (skipped if it can't be had)."""
import json
import subprocess
import sys

import pytest

from tokenmill.entrypoints.cli import main


@pytest.fixture(scope="module")
def model_path():
    from tokenmill.models.hub import resolve_model
    try:
        return resolve_model("smollm2-135m")
    except Exception as e:
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")


def test_pull_list_names_the_default(capsys):
    assert main(["pull", "--list"]) == 0
    assert "smollm2-135m" in capsys.readouterr().out


def test_unknown_model_is_a_clear_error(capsys):
    assert main(["generate", "--model", "no-such-model", "hi"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "smollm2-135m" in err


def test_generate_json(model_path, capsys):
    rc = main(["generate", "--model", model_path, "--max-tokens", "6", "--json",
               "--max-model-len", "256", "--num-kv-blocks", "64", "The capital of France is"])
    assert rc == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(row["token_ids"]) == 6 and row["finish_reason"] == "length" and row["text"]


def test_bad_sampling_flag_is_a_clear_error(model_path, capsys):
    rc = main(["generate", "--model", model_path, "--top-p", "1.5", "x"])
    assert rc == 2 and "top_p" in capsys.readouterr().err


def test_chat_streams_an_answer(model_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tokenmill.entrypoints.cli", "chat", "--model", model_path,
         "--max-tokens", "16", "--max-model-len", "512", "--num-kv-blocks", "64"],
        input="What is the capital of France?\n\n", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_help_everywhere():
    for argv in (["--help"], ["generate", "--help"], ["chat", "--help"], ["pull", "--help"],
                 ["bench", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0


def test_engine_flags_reach_the_engine(tiny_llama_dir, capsys, monkeypatch):
    """--quantization / --quant-activations / speculative flags are engine options on every
    command (serve no longer refuses them); bad values are clear errors."""
    from tokenmill.entrypoints.cli import _make_llm, build_parser
    from tokenmill.entrypoints.openai.cli_serve import _check_args, unimplemented_flags
    parser = build_parser()
    args = parser.parse_args(["serve", "--model", tiny_llama_dir, "--quantization", "int4-g32",
                              "--quant-activations", "q8", "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert unimplemented_flags(args) == [] and _check_args(args) is None
    from tokenmill.entrypoints import llm as llm_module
    real = llm_module.LLM
    monkeypatch.setattr(llm_module, "LLM", lambda **kw: real(**kw, skip_tokenizer_init=True))
    engine = _make_llm(args).engine   # (the tiny checkpoint has no tokenizer)
    down = engine.model.model.layers[0].mlp.down_proj
    assert down.packed[0].kind == "i4" and down.quant_method.activations == "q8"
    assert engine.config.speculative.num_speculative_tokens == 3
    assert args.cpu_weight_prepack is True and engine.config.model.cpu_weight_prepack is True
    assert parser.parse_args(["serve", "--no-cpu-weight-prepack"]).cpu_weight_prepack is False
    assert "not valid JSON" in _check_args(parser.parse_args(["serve", "--speculative-config", "{nope"]))
    tp_args = parser.parse_args(["serve", "--tensor-parallel-size", "2"])
    assert tp_args.tensor_parallel_size == 2 and unimplemented_flags(tp_args) == []
    assert main(["generate", "--model", tiny_llama_dir, "--quantization", "int3", "x"]) == 2
    assert "unknown quantization 'int3'" in capsys.readouterr().err
