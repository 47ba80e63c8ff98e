"""`tokenmill serve` / `generate` / `chat` say what they are doing: the load line on stderr,
and serve's URL once it answers, on a tiny random Llama with a tokenizer trained here (no
download, no network)."""
import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.conftest import save_tiny_llama

pytestmark = pytest.mark.e2e
CLI = [sys.executable, "-m", "tokenmill.entrypoints.cli"]
ENGINE_FLAGS = ["--num-kv-blocks", "16", "--block-size", "16", "--num-threads", "1"]
LOADED = re.compile(r"INFO tokenmill\.\w+: loaded (\S+) in [\d.]+ s \(weights [\d.]+ \w?B"
                    r"(?: \+ [\d.]+ \w?B tiled / prepacked)?, "
                    r"KV cache 16 blocks / 256 tokens, [\d.]+ \w?B\)")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer random Llama plus a 300-token byte-level BPE tokenizer beside it."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world, the model says hello"] * 5, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tiny_startup")
    save_tiny_llama(path, vocab_size=tok.get_vocab_size(), max_position_embeddings=64,
                    bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>",
                                                            "eos_token": "</s>"}))
    return str(path)


def test_generate_says_what_it_loaded(tiny_model_dir):
    proc = subprocess.run(CLI + ["generate", "--model", tiny_model_dir, "--max-tokens", "2",
                                 *ENGINE_FLAGS, "hello"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    match = LOADED.search(proc.stderr)
    assert match and match.group(1) == tiny_model_dir, proc.stderr
    assert "fetching" not in proc.stderr          # a local directory is never fetched
    assert "loaded" not in proc.stdout             # reports stay off the output


def test_chat_says_what_it_loaded(tiny_model_dir):
    proc = subprocess.run(CLI + ["chat", "--model", tiny_model_dir, *ENGINE_FLAGS], input="\n",
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert LOADED.search(proc.stderr), proc.stderr


def _lines(proc) -> "queue.Queue[str]":
    """The process's output, line by line, read in a thread (so waits can time out)."""
    lines: "queue.Queue[str]" = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
    threading.Thread(target=pump, daemon=True).start()
    return lines


def _wait_for(lines, pattern, seen: list, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError("no line matching %r in:\n%s" % (pattern, "\n".join(seen)))


def test_serve_prints_its_url_once_it_answers(tiny_model_dir):
    proc = subprocess.Popen(CLI + ["serve", "--model", tiny_model_dir, "--port", "0",
                                   "--served-model-name", "tiny", *ENGINE_FLAGS],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        ready = _wait_for(_lines(proc), r"INFO tokenmill\.server: serving tiny at "
                                        r"(http://127\.0\.0\.1:(\d+)) \(OpenAI API under /v1\)$",
                          seen)
        assert int(ready.group(2)) > 0                 # the port the OS gave, not "0"
        assert any(LOADED.search(line) for line in seen[:-1]), seen   # loaded, then ready
        # Ready means ready: the very first probe after the line is answered, and healthy.
        health = requests.get(ready.group(1) + "/health", timeout=10)
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        models_ = requests.get(ready.group(1) + "/v1/models", timeout=10).json()
        assert models_["data"][0]["id"] == "tiny"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
