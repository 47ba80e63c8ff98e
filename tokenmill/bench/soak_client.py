"""The soak's client side: a seeded plan of mixed requests, and one request sent and checked
on its own (standard library only, like bench/serve.py).

Terms: a request *completes* when the client read a whole answer; it is *aborted* when the
client hung up on purpose first (mid-stream, or before a non-streamed answer came);
*rejected* is a 503 (the server's queue was full); *bad input* is a request made invalid
on purpose, which must get a 400 with an OpenAI-style body. A *twin* is a copy of an
earlier request (same seed), sent the other way (streamed vs whole): their texts must match.
"""
from __future__ import annotations

import json
import random
import time
import urllib.parse
from dataclasses import dataclass, field
from http.client import HTTPConnection
from typing import Optional

VALID_FINISH = ("stop", "length")
_WORDS = ("time year people way day man thing woman life child world school state family "
          "student group country problem hand part place case week company system program "
          "question work government number night point home water room mother area money "
          "story fact month lot right study book eye job word business issue side kind head "
          "house service friend father power hour game line end member law car city").split()
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}}}
BAD_BODIES = ({"max_tokens": -3}, {"n": 0}, {"temperature": -1.0}, {"top_p": 7},
              {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}})


@dataclass
class SoakRequest:
    index: int
    endpoint: str                      # "chat" | "completions"
    stream: bool
    body: dict
    abort_after: Optional[float] = None   # streamed: chunks read; whole: seconds waited
    twin_of: Optional[int] = None
    bad_input: bool = False
    stop: Optional[str] = None
    schema: bool = False


@dataclass
class Outcome:
    index: int
    kind: str = "error"                # completed | aborted | rejected | bad_input | error
    status: int = 0
    texts: dict = field(default_factory=dict)          # choice index -> text
    finish_reasons: dict = field(default_factory=dict)
    num_samples: int = 1
    e2e_s: Optional[float] = None
    ttft_s: Optional[float] = None
    violations: list = field(default_factory=list)


class RequestPlan:
    """Seeded request mix; ``next()`` draws the next request (twins of recent ones among them)."""

    def __init__(self, seed: int, abort_fraction: float, model_name: str) -> None:
        self.rng = random.Random(seed)
        self.abort_fraction = abort_fraction
        self.model_name = model_name
        self.prefixes = [" ".join(self.rng.choice(_WORDS) for _ in range(60)) for _ in range(4)]
        self.recent: list[SoakRequest] = []
        self.count = 0

    def next(self) -> SoakRequest:
        rng, i = self.rng, self.count
        self.count += 1
        if self.recent and rng.random() < 0.15:
            twin = self._twin(rng.choice(self.recent), i)
            if twin is not None:
                return twin
        req = self._fresh(i)
        if rng.random() < 0.03:
            req.body.update(rng.choice(BAD_BODIES))
            req.bad_input, req.abort_after = True, None
        elif rng.random() < self.abort_fraction:
            req.abort_after = rng.randint(1, 4) if req.stream else rng.uniform(0.05, 1.0)
        if not req.bad_input and req.abort_after is None:
            self.recent = (self.recent + [req])[-32:]
        return req

    def _fresh(self, i: int) -> SoakRequest:
        rng = self.rng
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 30)))
        text = f"{rng.choice(self.prefixes)} {words}" if rng.random() < 0.5 else words
        body = {"model": self.model_name, "max_tokens": rng.randint(4, 48),
                "temperature": rng.choice([0.0, 0.8]), "seed": rng.randrange(1 << 30),
                "n": 2 if rng.random() < 0.2 else 1}
        endpoint = rng.choice(["chat", "completions"])
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        req = SoakRequest(i, endpoint, rng.random() < 0.5, body)
        if rng.random() < 0.2:
            req.stop = body["stop"] = rng.choice([" the", " and", "."])
        elif rng.random() < 0.1:
            req.schema = True
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "person", "schema": SCHEMA}}
        return req

    def _twin(self, first: SoakRequest, i: int) -> Optional[SoakRequest]:
        if first.twin_of is not None:
            return None
        return SoakRequest(i, first.endpoint, not first.stream, dict(first.body),
                           twin_of=first.index, stop=first.stop, schema=first.schema)


# -- sending -------------------------------------------------------------------------------------
def send(base_url: str, req: SoakRequest, timeout: float) -> Outcome:
    u = urllib.parse.urlsplit(base_url)
    path = u.path.rstrip("/") + ("/chat/completions" if req.endpoint == "chat" else "/completions")
    body = dict(req.body, stream=req.stream)
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    out = Outcome(req.index, num_samples=req.body.get("n", 1) or 1)
    conn = HTTPConnection(u.hostname, u.port, timeout=timeout)
    start = time.perf_counter()
    try:
        if not req.stream and req.abort_after is not None:
            conn.timeout = req.abort_after   # hang up if the answer is not there by then
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out.status = resp.status
        if resp.status != 200:
            _read_error(resp, req, out)
        elif req.stream:
            _read_stream(resp, req, out, start)
        else:
            _read_whole(resp, req, out)
    except TimeoutError:
        if req.abort_after is None:
            out.violations.append(f"no answer within {timeout} s")
        else:
            out.kind = "aborted"
    except (OSError, ValueError) as e:
        out.violations.append(f"transport: {type(e).__name__}: {e}")
    finally:
        conn.close()
    out.e2e_s = time.perf_counter() - start
    return out


def _read_error(resp, req: SoakRequest, out: Outcome) -> None:
    try:
        error = json.loads(resp.read())["error"]
        shaped = isinstance(error.get("message"), str) and "type" in error
    except (ValueError, KeyError, TypeError):
        shaped = False
    if not shaped:
        out.violations.append(f"HTTP {resp.status} without an OpenAI-style error body")
    if req.bad_input and resp.status == 400:
        out.kind = "bad_input"
    elif resp.status == 503:
        out.kind = "rejected"
    else:
        out.violations.append(f"unexpected HTTP {resp.status}")


def _read_whole(resp, req: SoakRequest, out: Outcome) -> None:
    data = json.loads(resp.read())
    if req.bad_input:
        out.violations.append("bad input was accepted")
    for choice in data.get("choices", []):
        text = choice["message"]["content"] if req.endpoint == "chat" else choice["text"]
        out.texts[choice["index"]] = text or ""
        out.finish_reasons[choice["index"]] = choice["finish_reason"]
    out.kind = "completed"
    check_choices(req, out)


def _read_stream(resp, req: SoakRequest, out: Outcome, start: float) -> None:
    num_chunks, done = 0, False
    for raw in resp:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        if done:
            out.violations.append("data after [DONE]")
            break
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        if "error" in event:
            out.violations.append(f"stream error: {event['error'].get('message')}")
            continue
        num_chunks += _take_chunk(event, req, out, start)
        if req.abort_after is not None and num_chunks >= req.abort_after:
            out.kind = "aborted"
            return   # hang up mid-stream
    if not done:
        out.violations.append("the stream ended without [DONE]")
    out.kind = "completed"
    check_choices(req, out)


def _take_chunk(event: dict, req: SoakRequest, out: Outcome, start: float) -> int:
    """Adds one event's text per choice; 1 if it carried content."""
    had_text = 0
    for choice in event.get("choices") or []:
        k = choice["index"]
        piece = (choice.get("delta") or {}).get("content") if req.endpoint == "chat" else choice.get("text")
        if piece:
            if k in out.finish_reasons:
                out.violations.append(f"choice {k}: text after its finish_reason")
            out.texts[k] = out.texts.get(k, "") + piece
            had_text = 1
            if out.ttft_s is None:
                out.ttft_s = time.perf_counter() - start
        if choice.get("finish_reason") is not None:
            out.texts.setdefault(k, "")   # a choice that ended at once streamed no text
            if k in out.finish_reasons:
                out.violations.append(f"choice {k}: finish_reason sent twice")
            out.finish_reasons[k] = choice["finish_reason"]
    return had_text


def check_choices(req: SoakRequest, out: Outcome) -> None:
    """What a completed answer must satisfy on its own."""
    if sorted(out.finish_reasons) != list(range(out.num_samples)):
        out.violations.append(f"choices {sorted(out.finish_reasons)} for n={out.num_samples}")
    for k, reason in out.finish_reasons.items():
        text = out.texts.get(k, "")
        if reason not in VALID_FINISH:
            out.violations.append(f"choice {k}: finish_reason {reason!r}")
        if req.stop and req.stop in text:
            out.violations.append(f"choice {k}: the stop string {req.stop!r} is in the text")
        if req.schema and reason == "stop" and not _fits_schema(text):
            out.violations.append(f"choice {k}: not the schema's JSON: {text[:60]!r}")


def _fits_schema(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"name", "age"}
            and isinstance(value["name"], str) and len(value["name"]) <= 12
            and isinstance(value["age"], int) and 0 <= value["age"] <= 99)
