"""The playground (/) and the dashboard (/dashboard) in a real headless Chromium against a
real server and engine: tokens arrive and Stop makes the server count an abort; the
dashboard's counters move under load and return to idle; with an API key the pages work only
after the key is typed, and the key never lands in the URL or the HTML; no CSP violations."""
import contextlib
import json
import os
import re
import threading
import time
import urllib.request

import pytest

from tests.entrypoints.openai.conftest import LiveServer, wait_idle
from tokenmill.entrypoints.openai.server import build_app

pytestmark = pytest.mark.e2e

MODEL = "tiny-web"
ABORTS = re.compile(r'^tokenmill:request_success_total\{[^}]*finished_reason="abort"[^}]*\}\s+(\S+)$',
                    re.M)
SCREENSHOT_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "images")


def serve(engine, **kwargs) -> LiveServer:
    return LiveServer(build_app(engine, MODEL, **kwargs))


def http(url: str, body=None, key=None, timeout=60.0):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def num_aborts(server: LiveServer, key=None) -> float:
    return sum(float(v) for v in ABORTS.findall(http(server.url + "/metrics", key=key)))


def wait_for(predicate, timeout=15.0, interval=0.1, what="condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


class Load:
    """Background completions (long, ignore_eos) from a few threads until stopped."""

    def __init__(self, server: LiveServer, key=None, num_threads=4, max_tokens=400,
                 model=MODEL) -> None:
        self.server, self.key, self.max_tokens, self.model = server, key, max_tokens, model
        self.stop_event = threading.Event()
        self.errors: list = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(num_threads)]

    def _run(self, i: int) -> None:
        while not self.stop_event.is_set():
            body = {"model": self.model, "prompt": f"Load request {i}: the quick brown fox",
                    "max_tokens": self.max_tokens, "temperature": 0.8, "seed": i,
                    "ignore_eos": True}
            try:
                http(self.server.url + "/v1/completions", body, self.key)
            except Exception as e:  # reported by the test, not swallowed
                self.errors.append(e)
                return

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(60)


def watch_csp(page) -> list:
    """Collects CSP violations and console errors of ``page`` (from before its first script)."""
    problems: list = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
            if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.add_init_script("""
        window.__csp = [];
        document.addEventListener('securitypolicyviolation',
            (e) => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI));
    """)
    return problems


def reply_text(page) -> str:
    return page.locator(".reply .content").last.text_content() or ""


@contextlib.contextmanager
def slowed(engine, seconds: float):
    """Each engine step takes at least ``seconds`` more: a reply of many tokens then surely
    still streams when the test acts on it (the tiny model writes 1900 tokens in ~2 s, which
    a loaded CI box's browser could let pass before Stop is clicked)."""
    def add_delay(e):
        execute = e.runner.execute
        def slow(*args, **kwargs):
            time.sleep(seconds)
            return execute(*args, **kwargs)
        e.runner.execute = slow
    engine.call(add_delay).result(10)
    try:
        yield
    finally:
        engine.call(lambda e: e.runner.__dict__.pop("execute", None)).result(10)


def test_playground_streams_and_stop_aborts_on_server(web_engine, page):
    with serve(web_engine) as server, slowed(web_engine, 0.01):
        problems = watch_csp(page)
        page.goto(server.url + "/")
        page.wait_for_selector("body[data-ready='1']")
        wait_for(lambda: page.text_content("#model-name") == MODEL, what="the model name")
        before = num_aborts(server)
        page.fill("#max-tokens", "1900")
        page.fill("#prompt", "Tell me a very long story.")
        page.click("#send")
        assert page.is_enabled("#stop")
        lengths = set()
        wait_for(lambda: lengths.add(len(reply_text(page))) or len(lengths - {0}) >= 2,
                 timeout=30, interval=0.05, what="the reply to grow")
        page.click("#stop")
        page.wait_for_selector(".reply.stopped")
        stopped_at = len(reply_text(page))
        assert stopped_at > 0
        wait_for(lambda: num_aborts(server) >= before + 1, what="the server to count the abort")
        assert num_aborts(server) == before + 1
        state = wait_idle(web_engine)
        assert state["unfinished"] == 0 and state["free_blocks"] == state["total_blocks"]
        time.sleep(0.3)                              # no token lands after Stop
        assert len(reply_text(page)) == stopped_at
        assert page.is_enabled("#send") and not page.is_enabled("#stop")
        assert "stopped" in page.text_content(".reply .reply-stats")
        # A second turn completes and reports its figures (the history went with it).
        page.fill("#max-tokens", "12")
        page.fill("#prompt", "And a short one.")
        page.click("#send")
        page.wait_for_function("() => document.querySelectorAll('.reply:not(.streaming)').length == 2")
        stats = page.locator(".reply .reply-stats").last.text_content()
        assert re.search(r"12 tokens · TTFT \d+ ms · [\d.]+ tok/s · cached \d+/\d+ prompt tokens", stats), stats
        assert page.locator(".message.user").count() == 2
        assert problems == [] and page.evaluate("window.__csp") == []


def test_completions_mode(web_engine, page):
    with serve(web_engine) as server:
        page.goto(server.url + "/")
        page.wait_for_selector("body[data-ready='1']")
        page.select_option("#mode", "completions")
        assert page.is_disabled("#system")
        page.fill("#max-tokens", "8")
        page.fill("#seed", "7")
        page.fill("#prompt", "Once upon a time")
        page.click("#send")
        page.wait_for_selector(".reply:not(.streaming)")
        assert page.locator(".message.prompt").text_content().endswith("Once upon a time")
        assert "8 tokens" in page.text_content(".reply .reply-stats")
        assert reply_text(page) != ""


def test_dashboard_moves_under_load_and_returns_to_idle(web_engine, page):
    with serve(web_engine) as server:
        problems = watch_csp(page)
        streams = []
        page.on("request", lambda r: streams.append(r.url) if "/v1/engine/stream" in r.url else None)
        page.goto(server.url + "/dashboard")
        page.wait_for_selector("#status[data-state='live']")
        page.wait_for_function("() => Number(document.body.dataset.events || 0) >= 2")
        assert page.text_content("#num-running") == "0"
        assert page.get_attribute("#kv-map", "data-used") == "0"
        num_blocks = int(page.get_attribute("#kv-map", "data-num-blocks"))
        assert num_blocks == 160
        finished_before = int(page.text_content("#num-finished").replace(",", ""))
        seen = {"running": False, "tps": False, "used": False}

        def moved():
            seen["running"] |= int(page.text_content("#num-running")) > 0
            seen["tps"] |= float(page.text_content("#generation-tps")) > 0
            seen["used"] |= int(page.get_attribute("#kv-map", "data-used")) > 0
            return all(seen.values())

        with Load(server) as load:
            wait_for(moved, timeout=20, interval=0.1, what=f"the dashboard to move ({seen})")
            time.sleep(1.0)
        assert load.errors == []
        wait_idle(web_engine)
        page.wait_for_function(
            "() => document.getElementById('num-running').textContent === '0'"
            " && document.getElementById('kv-map').dataset.used === '0'"
            " && document.getElementById('generation-tps').textContent === '0.0'", timeout=10_000)
        assert int(page.text_content("#num-finished").replace(",", "")) > finished_before
        cached = int(page.get_attribute("#kv-map", "data-cached"))
        assert cached + int(page.get_attribute("#kv-map", "data-free")) == num_blocks
        assert page.text_content("#ttft-p50") != "–"
        assert len(streams) == 1, streams                 # one connection for the whole run
        assert problems == [] and page.evaluate("window.__csp") == []


def test_api_key_is_asked_for_and_never_leaks(web_engine, page):
    key = "sekret"
    with serve(web_engine, api_key=key) as server:
        problems = watch_csp(page)
        page.goto(server.url + "/")
        page.wait_for_selector("body[data-ready='1']")
        assert page.is_visible("#auth-panel")
        page.fill("#prompt", "hello")
        page.click("#send")                              # no key yet: refused, nothing sent
        page.wait_for_selector("#error:not([hidden])")
        assert page.locator(".reply").count() == 0
        page.fill("#api-key", "wrong")
        page.click("#api-key-save")
        page.click("#send")
        page.wait_for_selector("#auth-panel:not([hidden])")   # the 401 brings the form back
        assert page.locator(".reply").count() == 0
        page.fill("#api-key", key)
        page.click("#api-key-save")
        assert page.is_hidden("#auth-panel")
        page.fill("#max-tokens", "6")
        page.fill("#prompt", "hello")
        page.click("#send")
        page.wait_for_selector(".reply:not(.streaming)")
        assert reply_text(page) != "" and "6 tokens" in page.text_content(".reply .reply-stats")
        assert key not in page.url and key not in page.content()
        assert page.evaluate("sessionStorage.getItem('tokenmill.apiKey')") == key

        # Same tab: the dashboard's stream works with the stored key.
        page.goto(server.url + "/dashboard")
        page.wait_for_selector("#status[data-state='live']")
        page.wait_for_function("() => Number(document.body.dataset.events || 0) >= 2")
        assert page.text_content("#model-name") == MODEL
        assert key not in page.url and key not in page.content()

        # A new tab has no key: the dashboard asks for it and streams once it is given.
        other = page.context.browser.new_context().new_page()
        other.goto(server.url + "/dashboard")
        other.wait_for_selector("#status[data-state='auth']")
        assert other.is_visible("#auth-panel")
        other.fill("#api-key", key)
        other.press("#api-key", "Enter")
        other.wait_for_selector("#status[data-state='live']")
        assert key not in other.content()
        other.context.close()
        # The 401s above were shown in the page; the only console errors are those refusals.
        assert all("401" in p for p in problems), problems
        assert page.evaluate("window.__csp") == []


def test_pages_have_a_strict_csp_and_no_violations(web_engine, page):
    with serve(web_engine) as server:
        for path in ("/", "/dashboard"):
            problems = watch_csp(page)
            response = page.goto(server.url + path)
            csp = response.headers["content-security-policy"]
            assert "script-src 'self'" in csp and "style-src 'self'" in csp and "unsafe" not in csp
            page.wait_for_selector("body[data-ready='1']")
            page.wait_for_timeout(1200)                  # the dashboard draws a few events
            assert problems == [], (path, problems)
            assert page.evaluate("window.__csp") == [], path
            # The policy is enforced and the detector works: an inline script is refused.
            page.evaluate("""() => { const s = document.createElement('script');
                                     s.textContent = 'window.__ran = 1'; document.body.append(s); }""")
            page.wait_for_function("() => window.__csp.length > 0")
            assert page.evaluate("window.__ran") is None


def test_speculative_acceptance_is_shown(spec_engine, page):
    with serve(spec_engine) as server:
        page.goto(server.url + "/")
        page.wait_for_selector("body[data-ready='1']")
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "120")
        page.fill("#prompt", "one two three one two three one two three")
        page.click("#send")
        page.wait_for_selector(".reply:not(.streaming)")
        stats = page.text_content(".reply .reply-stats")
        assert re.search(r"spec accepted \d+% · mean length [\d.]+ · \d+/\d+ drafted", stats), stats
        page.goto(server.url + "/dashboard")
        page.wait_for_selector("#spec-panel:not([hidden])")
        assert "ngram" in page.text_content("#spec-method")
        assert page.text_content("#spec-drafts") not in ("–", "0")


def test_screenshots(request, page, tmp_path):
    """Pictures of both pages (the dashboard during a load). With TOKENMILL_WRITE_SCREENSHOTS=1
    they are taken on SmolLM2 (readable replies) and written to docs/images for the README;
    otherwise on the tiny model, into a temporary folder."""
    readme = os.environ.get("TOKENMILL_WRITE_SCREENSHOTS") == "1"
    out = SCREENSHOT_DIR if readme else str(tmp_path)
    os.makedirs(out, exist_ok=True)
    engine = request.getfixturevalue("readable_engine" if readme else "web_engine")
    model = "smollm2-135m" if readme else MODEL
    with LiveServer(build_app(engine, model)) as server:
        http(server.url + "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 4})
        page.goto(server.url + "/")
        page.wait_for_selector("body[data-ready='1']")
        page.fill("#system", "You are a helpful assistant. Answer briefly.")
        page.fill("#temperature", "0.3")
        page.fill("#seed", "1")
        for text, n in (("What is the capital of France?", "40"),
                        ("Name three things to see there.", "80")):
            page.fill("#max-tokens", n)
            page.fill("#prompt", text)
            page.click("#send")
            page.wait_for_function("() => !document.querySelector('.reply.streaming')")
        page.screenshot(path=os.path.join(out, "playground.png"))
        page.goto(server.url + "/dashboard")
        page.wait_for_selector("#status[data-state='live']")
        with Load(server, num_threads=6, max_tokens=120 if readme else 300, model=model):
            page.wait_for_timeout(8000)
            page.screenshot(path=os.path.join(out, "dashboard.png"), full_page=True)
    for name in ("playground.png", "dashboard.png"):
        assert os.path.getsize(os.path.join(out, name)) > 10_000
