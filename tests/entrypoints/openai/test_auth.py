"""With an API key set, every route the app has (enumerated, so a new route cannot slip
through) answers 401 without the key or with a wrong one, except the allow-list (/health,
and the web pages with their static files, which hold no data)."""
import pytest
import requests

from tests.entrypoints.openai.conftest import MODEL_NAME, LiveServer
from tokenmill.entrypoints.openai.server import build_app, open_without_key

pytestmark = pytest.mark.e2e
KEY = "sk-test-123"


@pytest.fixture(scope="module")
def keyed(async_engine):
    app = build_app(async_engine, MODEL_NAME, api_key=KEY)
    with LiveServer(app) as live:
        yield app, live


def _routes(app) -> list[tuple[str, str]]:
    pairs = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or {"GET"}):
            pairs.append((method, route.path))
    return pairs


def _request(method: str, url: str, headers: dict) -> requests.Response:
    """One request; streamed and closed after the headers, since the engine stream never ends."""
    r = requests.request(method, url, headers=headers, json={}, timeout=30, stream=True)
    if "text/event-stream" not in r.headers.get("content-type", ""):
        r.content   # read the (finite) body, so r.json() works after close
    r.close()
    return r


def test_every_route_but_the_allow_list_needs_the_key(keyed):
    app, live = keyed
    routes = _routes(app)
    assert ("GET", "/openapi.json") in routes and ("POST", "/v1/chat/completions") in routes
    assert ("GET", "/v1/engine/stream") in routes and ("GET", "/dashboard") in routes
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}):
            r = _request(method, live.url + path, headers)
            if open_without_key(path, web_ui=True):
                assert r.status_code != 401, (method, path)
            else:
                assert r.status_code == 401, (method, path, headers, r.status_code)
                if method != "HEAD":
                    assert r.json()["error"]["type"] == "authentication_error"


def test_the_key_opens_every_route(keyed):
    app, live = keyed
    headers = {"Authorization": f"Bearer {KEY}"}
    for method, path in _routes(app):
        r = _request(method, live.url + path, headers)
        assert r.status_code != 401, (method, path)
    r = requests.post(live.url + "/v1/completions", headers=headers, timeout=60,
                      json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200


def test_unknown_paths_need_the_key_too(keyed):
    _, live = keyed
    assert requests.get(live.url + "/v2/secret", timeout=10).status_code == 401
