"""Fixtures for the server tests: one real SmolLM2 AsyncEngine for the whole session (loading
takes ~10 s), and a helper that serves a FastAPI app with uvicorn on a free loopback port in a
background thread. Each test module builds its own app (cheap) on the shared engine."""
import socket
import threading
import time

import pytest
import uvicorn

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.entrypoints.openai.server import build_app

MODEL_NAME = "smollm2-135m"


class LiveServer:
    """uvicorn in a thread, bound to 127.0.0.1 on a port the OS picked."""

    def __init__(self, app) -> None:
        self.app = app
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def engine_state(async_engine: AsyncEngine, timeout: float = 10.0) -> dict:
    """Counts read inside the engine thread (the engine is never touched from another)."""
    def read(engine):
        kv = engine.scheduler.kv
        return {"running": len(engine.scheduler.running),
                "waiting": len(engine.scheduler.waiting),
                "unfinished": engine.scheduler.num_unfinished,
                "free_blocks": kv.num_free_blocks, "total_blocks": kv.num_total_blocks}
    return async_engine.call(read).result(timeout)


def wait_idle(async_engine: AsyncEngine, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = engine_state(async_engine)
        if state["unfinished"] == 0 or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


@pytest.fixture(scope="session")
def smollm2_path():
    from tokenmill.models.hub import resolve_model
    try:
        return resolve_model(MODEL_NAME)
    except Exception as e:  # no network and no cache
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")


@pytest.fixture(scope="session")
def async_engine(smollm2_path):
    from tokenmill.entrypoints.llm import LLM

    # One torch thread: the test process and uvicorn share the 2 cores with the engine, and
    # OpenMP spin-waiting on an oversubscribed machine makes every step many times slower.
    engine = AsyncEngine(lambda: LLM(model=smollm2_path, max_model_len=1024, num_kv_blocks=512,
                                     max_num_seqs=16, num_threads=1).engine, max_pending=64)
    engine.start()
    engine.ready.wait(120)
    if engine.load_error:
        pytest.skip(f"SmolLM2 failed to load: {engine.load_error}")
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def server(async_engine):
    with LiveServer(build_app(async_engine, MODEL_NAME)) as live:
        yield live


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory, smollm2_path):
    """A tiny random Llama (fast: milliseconds per step) that speaks SmolLM2's tokenizer and
    chat template, so chat routes work end to end; max 64 positions bounds every generation."""
    from tests.conftest import save_tiny_chat_llama
    from tokenmill.models.loader import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    path = tmp_path_factory.mktemp("tiny_chat_llama")
    return save_tiny_chat_llama(path, tok, max_position_embeddings=64)


@pytest.fixture(scope="session")
def long_model_dir(tmp_path_factory, smollm2_path):
    """A tiny random Llama with SmolLM2's tokenizer and 2048 positions: a few hundred tokens
    a request keep the engine busy for seconds at milliseconds a step, so a test can act
    (signal, send a late request) while requests are surely still running."""
    from tests.conftest import save_tiny_chat_llama
    from tokenmill.models.loader import load_tokenizer
    path = tmp_path_factory.mktemp("tiny_llama_2k")
    return save_tiny_chat_llama(path, load_tokenizer(smollm2_path), max_position_embeddings=2048)


def start_engine(make_llm, timeout: float = 120.0, **engine_kwargs) -> AsyncEngine:
    """An AsyncEngine around ``make_llm().engine``, started and loaded (or the test fails)."""
    engine = AsyncEngine(lambda: make_llm().engine, **engine_kwargs)
    engine.start()
    engine.ready.wait(timeout)
    assert engine.load_error is None, engine.load_error
    return engine


def start_tiny_engine(model_dir: str, **engine_kwargs) -> AsyncEngine:
    from tokenmill.entrypoints.llm import LLM
    return start_engine(lambda: LLM(model=model_dir, num_kv_blocks=64, block_size=16,
                                    max_num_seqs=8, num_threads=1), **engine_kwargs)
