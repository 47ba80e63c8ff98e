"""POST /v1/embeddings on a tiny random Llama with SmolLM2's tokenizer: OpenAI's shape, vectors
equal to the offline ``LLM.embed`` on the same weights, base64 = the float list, batches equal
single inputs, the pooling choice (request field and server default), bad input -> 400 naming
the param, and generation running beside embeddings keeps its greedy text."""
import base64
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.entrypoints.openai.conftest import LiveServer, start_tiny_engine
from tokenmill import LLM
from tokenmill.entrypoints.openai.server import build_app
from tokenmill.pooling_params import PoolingParams

pytestmark = pytest.mark.e2e
TEXTS = ["The quick brown fox", "jumps over the lazy dog and keeps running far away", "a"]


@pytest.fixture(scope="module")
def engine(tiny_chat_model_dir):
    engine = start_tiny_engine(tiny_chat_model_dir)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def server(engine):
    with LiveServer(build_app(engine, "tiny")) as live:
        yield live


@pytest.fixture(scope="module")
def offline(tiny_chat_model_dir):
    return LLM(model=tiny_chat_model_dir, num_kv_blocks=64, block_size=16, num_threads=1)


def post(server, **body):
    return requests.post(server.url + "/v1/embeddings", json={"model": "tiny", **body}, timeout=60)


def vectors(server, **body) -> list:
    r = post(server, **body)
    assert r.status_code == 200, r.text
    return [d["embedding"] for d in r.json()["data"]]


def close(a, b, atol=1e-5) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < atol


def test_float_response_shape_and_values_equal_offline(server, offline):
    r = post(server, input=TEXTS, user="someone")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "tiny"
    assert [d["object"] for d in body["data"]] == ["embedding"] * 3
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    want = offline.embed(TEXTS, use_tqdm=False)
    for d, w in zip(body["data"], want):
        assert len(d["embedding"]) == 64
        assert close(d["embedding"], w.outputs.embedding)
    num_tokens = sum(len(w.prompt_token_ids) for w in want)
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}


def test_base64_decodes_to_the_float_list(server):
    floats = vectors(server, input=TEXTS[1])[0]
    r = post(server, input=TEXTS[1], encoding_format="base64")
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == floats


def test_batch_equals_one_at_a_time_for_text_and_token_ids(server):
    alone = [vectors(server, input=t)[0] for t in TEXTS]
    assert all(close(a, b) for a, b in zip(vectors(server, input=TEXTS), alone))
    ids = [[5, 9, 200, 31, 7], [42] * 20]
    alone = [vectors(server, input=p)[0] for p in ids]
    assert all(close(a, b) for a, b in zip(vectors(server, input=ids), alone))


def test_pooling_field_and_server_default(engine, server, offline):
    last = offline.embed(TEXTS[:2], PoolingParams(pooling_type="last", normalize=False),
                         use_tqdm=False)
    got = vectors(server, input=TEXTS[:2], pooling="last", normalize=False)
    assert all(close(g, w.outputs.embedding) for g, w in zip(got, last))
    mean = vectors(server, input=TEXTS[:2])
    assert not close(mean[0], got[0])
    with LiveServer(build_app(engine, "tiny", pooling_type="last")) as last_default:
        normalized_last = offline.embed(TEXTS[:2], PoolingParams(pooling_type="last"),
                                        use_tqdm=False)
        assert all(close(g, w.outputs.embedding) for g, w in
                   zip(vectors(last_default, input=TEXTS[:2]), normalized_last))
        assert all(close(g, m) for g, m in
                   zip(vectors(last_default, input=TEXTS[:2], pooling="mean"), mean))


def test_dimensions_equal_to_the_hidden_size_is_accepted(server):
    assert vectors(server, input=TEXTS[0], dimensions=64) == vectors(server, input=TEXTS[0])


@pytest.mark.parametrize("changes,param", [
    ({"input": []}, "input"), ({"input": [""]}, "input"), ({"input": ""}, "input"),
    ({"input": [[]]}, "input"), ({"input": ["ok", ""]}, "input"),
    ({"input": [1, 10**7]}, "input"), ({"input": [[3, 4], [5, 10**7]]}, "input"),
    ({"input": "word " * 200}, "input"),
    ({"encoding_format": "int8"}, "encoding_format"),
    ({"dimensions": 32}, "dimensions"), ({"dimensions": 0}, "dimensions"),
    ({"pooling": "cls"}, "pooling"), ({"normalize": "maybe"}, "normalize"),
    ({"model": "other"}, "model"),
])
def test_bad_input_is_a_400_naming_the_param(server, engine, changes, param):
    r = post(server, **{"input": "hello", **changes})
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param
    assert close(vectors(server, input="hello")[0], vectors(server, input="hello")[0])
    assert engine.call(lambda e: e.scheduler.num_unfinished).result(10) == 0


def test_generation_beside_embeddings_keeps_its_greedy_text(server):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    alone = requests.post(server.url + "/v1/completions", json=body, timeout=60).json()
    with ThreadPoolExecutor(6) as pool:
        completions = [pool.submit(requests.post, server.url + "/v1/completions", json=body,
                                   timeout=60) for _ in range(2)]
        embeddings = [pool.submit(post, server, input=TEXTS * 3) for _ in range(4)]
        texts = [f.result().json()["choices"][0]["text"] for f in completions]
        assert all(f.result().status_code == 200 for f in embeddings)
    assert texts == [alone["choices"][0]["text"]] * 2
