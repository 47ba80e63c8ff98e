"""Fixtures for the browser tests: a real headless Chromium (Debian's ``chromium`` package,
driven by Playwright's Python package; ``playwright install`` cannot download browsers here),
and a tiny random Llama with 2048 positions, so a reply streams long enough to press Stop."""
import shutil

import pytest

from tests.entrypoints.openai.conftest import smollm2_path, start_engine  # noqa: F401  (a fixture)

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-dev-shm-usage"]


@pytest.fixture(scope="session")
def chromium_browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright Python package is not installed (pip install playwright)")
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        pytest.skip("no chromium executable on PATH (apt-get install chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(chromium_browser):
    context = chromium_browser.new_context(viewport={"width": 1200, "height": 800},
                                           service_workers="block")
    page = context.new_page()
    page.set_default_timeout(20_000)
    yield page
    context.close()


@pytest.fixture(scope="session")
def long_tiny_model_dir(tmp_path_factory, smollm2_path):  # noqa: F811
    from tests.conftest import save_tiny_chat_llama
    from tokenmill.models.loader import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    path = tmp_path_factory.mktemp("tiny_chat_llama_2048")
    return save_tiny_chat_llama(path, tok, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def web_engine(long_tiny_model_dir):
    from tokenmill.entrypoints.llm import LLM

    # One torch thread: Chromium, uvicorn and the engine share two cores.
    engine = start_engine(lambda: LLM(model=long_tiny_model_dir, max_model_len=2048,
                                      num_kv_blocks=160, block_size=16, max_num_seqs=8,
                                      num_threads=1))
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def spec_engine(long_tiny_model_dir):
    """The tiny model speculating with n-gram drafts (greedy random models repeat, so drafts
    get accepted). k is fixed: on this model a step that looks up runs ~1.3x a plain one and finds
    nothing for the first ~40 tokens, so the adaptive controller rightly stops asking, and
    these tests are about showing drafts, not about when they pay."""
    from tokenmill.entrypoints.llm import LLM

    engine = start_engine(lambda: LLM(model=long_tiny_model_dir, max_model_len=2048, num_kv_blocks=160,
                                block_size=16, max_num_seqs=8, num_threads=1,
                                speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                    "adaptive": False}))
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def readable_engine(smollm2_path):  # noqa: F811
    """SmolLM2-135M with n-gram speculation, for README screenshots with readable text."""
    from tokenmill.entrypoints.llm import LLM

    engine = start_engine(lambda: LLM(model=smollm2_path, max_model_len=2048, num_kv_blocks=256,
                                max_num_seqs=8, num_threads=2,
                                speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                    "adaptive": False}))
    yield engine
    engine.stop()
