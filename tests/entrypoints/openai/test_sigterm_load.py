"""SIGTERM under load, against a real `tokenmill serve` process over real HTTP.

The contract tested here:
- During the drain every in-flight request finishes normally (finish_reason stop / length,
  a whole JSON body or a stream ending in ``[DONE]``); a new request gets 503 with an
  OpenAI-style error body and Retry-After; ``/health`` says "draining". Once the process
  has exited the listener is closed, so a later request is refused at connect.
- The process exits 0 once the last request finished (a second or two later: the
  sockets close, the engine stops, the interpreter exits).
- When ``--drain-timeout`` passes first, the requests still running end with an error the
  client can read (an SSE error event then ``[DONE]``, or a 5xx JSON body): each client sees
  an end, none hangs. The process still exits 0 (it stopped as asked), within the timeout
  plus a few seconds, and no child process (data-parallel replicas) outlives it.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import requests

pytestmark = pytest.mark.e2e
COMPLETE = {"stop", "length"}
NUM_REQUESTS = 16
# After the drain deadline: end the cut requests (END_GRACE_S at most), close the sockets,
# stop the replicas (about 1 + 4 s measured on 2 busy cores; generous for a loaded CI box).
EXIT_MARGIN_S = 15.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`tokenmill serve` in a child process on a free loopback port; killed if a test fails."""

    def __init__(self, model_dir: str, *flags: str) -> None:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--model", model_dir,
               "--port", str(port), "--num-threads", "1", "--served-model-name", "tiny",
               "--log-level", "warning", "--disable-web-ui", *flags]
        # The log goes to a file, not a pipe: nobody reads a pipe while the test runs, and a
        # full one would block the server in its next write.
        self.log = tempfile.TemporaryFile("w+")
        # Its own process group, as under systemd: a test can signal the whole group.
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                     start_new_session=True)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def __enter__(self) -> "Served":
        try:
            self._wait_healthy()
        except BaseException:   # __exit__ would not run: never leave the server behind
            self.__exit__()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        raise AssertionError("server did not become healthy")

    def __exit__(self, *exc) -> None:
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.log.close()

    def wait_admitted(self, n: int, calls: list, timeout: float = 60) -> None:
        """Until the engine holds ``n`` requests and every stream has a token: a request
        the server had not yet accepted would rightly get a 503 once draining."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if _gauge(self.url, "running") + _gauge(self.url, "waiting") >= n and all(
                    c.first.is_set() for c in calls if c.stream):
                return
            time.sleep(0.05)
        raise AssertionError("the load never reached the engine")


def _gauge(url: str, name: str) -> float:
    # Summed over labels: a data-parallel server reports one series per replica.
    total = 0.0
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"tokenmill:num_requests_{name}{{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def descendants(pid: int) -> set:
    """Every live process below ``pid`` (from /proc: no psutil here)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Call(threading.Thread):
    """One client request, recording what the client saw."""

    def __init__(self, url: str, i: int, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.stream, chat = i % 2 == 0, i % 4 < 2
        self.route = url + ("/v1/chat/completions" if chat else "/v1/completions")
        self.body = {"model": "tiny", "max_tokens": max_tokens, "ignore_eos": True,
                     "temperature": 0, "stream": self.stream}
        if chat:
            self.body["messages"] = [{"role": "user", "content": f"Tell story number {i}."}]
        else:
            self.body["prompt"] = f"Once upon a time, number {i},"
        self.first = threading.Event()
        self.status = None
        self.finishes, self.errors, self.done = [], [], False
        self.exc = None
        self.last_data_at = self.ended_at = 0.0

    def run(self) -> None:
        try:
            with requests.post(self.route, json=self.body, stream=self.stream,
                               timeout=(5, 60)) as r:
                self.status = r.status_code
                self._read_stream(r) if self.stream else self._read_body(r.json())
        except Exception as e:   # a truncated stream or a reset: recorded, then asserted on
            self.exc = e
        self.ended_at = time.monotonic()

    def _read_body(self, body: dict) -> None:
        if "error" in body:
            self.errors.append(body["error"])
        else:
            self.finishes = [c["finish_reason"] for c in body["choices"]]

    def _read_stream(self, r) -> None:
        for line in r.iter_lines(decode_unicode=True):
            if not line.startswith("data: "):
                continue
            self.first.set()
            self.last_data_at = time.monotonic()
            if line == "data: [DONE]":
                self.done = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                self.errors.append(chunk["error"])
            for c in chunk.get("choices", ()):
                if c.get("finish_reason"):
                    self.finishes.append(c["finish_reason"])


def _load(url: str, max_tokens: int) -> list:
    calls = [Call(url, i, max_tokens) for i in range(NUM_REQUESTS)]
    for c in calls:
        c.start()
    return calls


def _assert_refused_503(url: str) -> None:
    r = requests.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hi",
                                                     "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "shutting down" in error["message"] and error["code"] == "server_shutting_down"
    assert error["type"] == "service_unavailable"
    health = requests.get(url + "/health", timeout=10)
    assert health.status_code == 503 and health.json()["reason"] == "draining"


def test_sigterm_under_load_finishes_every_request_then_exits_zero(long_model_dir):
    with Served(long_model_dir, "--drain-timeout", "60") as served:
        calls = _load(served.url, max_tokens=250)
        served.wait_admitted(NUM_REQUESTS, calls)
        sigterm_at = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        _assert_refused_503(served.url)
        for c in calls:
            c.join(60)
        rc = served.proc.wait(60)
        exited_at = time.monotonic()
        print(f"drained {NUM_REQUESTS} requests and exited {exited_at - sigterm_at:.2f} s after "
              f"SIGTERM, {exited_at - max(c.ended_at for c in calls):.2f} s after the last answer")
        assert rc == 0, served.output()
        for c in calls:
            assert c.exc is None and c.status == 200 and not c.errors, (c.body, c.exc, c.errors)
            assert c.finishes and set(c.finishes) <= COMPLETE, c.finishes
            assert c.done or not c.stream
        # Under load for real: the streams were still generating when the signal came.
        assert sum(c.last_data_at > sigterm_at for c in calls if c.stream) >= NUM_REQUESTS // 4
        with pytest.raises(requests.ConnectionError):   # the listener is gone with the process
            requests.post(served.url + "/v1/completions", json={"prompt": "Hi"}, timeout=5)


@pytest.mark.slow   # two replica processes start (and stop) on two cores: 20-40 s
def test_drain_deadline_ends_the_rest_cleanly_and_leaves_no_child(long_model_dir):
    deadline_s = 1.0
    with Served(long_model_dir, "--drain-timeout", str(deadline_s),
                "--data-parallel-size", "2") as served:
        children = descendants(served.proc.pid)
        assert children, "expected data-parallel replica processes"
        calls = _load(served.url, max_tokens=1900)
        served.wait_admitted(NUM_REQUESTS, calls)
        sigterm_at = time.monotonic()
        # To the whole group, as systemd stops a service: the replicas must leave the
        # drain to the server (they ignore it) instead of dying with their requests.
        os.killpg(served.proc.pid, signal.SIGTERM)
        rc = served.proc.wait(deadline_s + EXIT_MARGIN_S)
        exited_s = time.monotonic() - sigterm_at
        for c in calls:
            c.join(5)
        print(f"drain deadline {deadline_s} s: every client had its end "
              f"{max(c.ended_at for c in calls) - sigterm_at:.2f} s after SIGTERM, "
              f"the server exited after {exited_s:.2f} s")
        assert rc == 0, served.output()
        cut = 0
        for c in calls:
            assert not c.is_alive() and c.exc is None, (c.body, c.exc)   # every client saw an end
            if c.errors:
                cut += 1
                assert "shut down" in c.errors[0]["message"] and (c.stream or c.status >= 500)
            else:
                assert set(c.finishes) <= COMPLETE and c.finishes
            assert c.done or not c.stream
        assert cut > 0, "the deadline cut nothing: the test needs more work per request"
        time.sleep(0.5)
        assert not [pid for pid in children if _alive(pid)], "a replica outlived the server"
