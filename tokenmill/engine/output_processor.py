"""Turn per-step EngineCoreOutputs into user-facing RequestOutputs: detokenize incrementally,
find stop strings, gather the n samples of a request, collect logprobs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput,
                               EngineCoreOutput, RequestOutput)
from tokenmill.request import Request


@dataclass
class _Sample:
    index: int
    detokenizer: Optional[IncrementalDetokenizer]
    want_logprobs: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    cumulative_logprob: float = 0.0
    text: str = ""                      # text released so far (never a partial stop string)
    finish_reason: Optional[str] = None
    stop_reason: object = None
    error: Optional[str] = None


@dataclass
class _Parent:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    samples: dict[str, _Sample]
    want_prompt_logprobs: bool
    prompt_logprobs: dict = field(default_factory=dict)   # position -> entry
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: Optional[float] = None
    is_pooling: bool = False
    pooled: Optional[list[float]] = None     # a pooling request's vector, once finished


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, str] = {}

    def add(self, prompt: Optional[str], requests: list[Request]) -> None:
        first = requests[0]
        params = first.sampling_params
        is_pooling = first.pooling_params is not None
        samples = {}
        for r in requests:
            detok = None
            if self.tokenizer is not None and not is_pooling:
                detok = IncrementalDetokenizer(self.tokenizer, params, r.prompt_token_ids)
            samples[r.request_id] = _Sample(r.sample_index, detok, params.logprobs is not None)
            self._child_to_parent[r.request_id] = first.parent_id
        self._parents[first.parent_id] = _Parent(
            first.parent_id, prompt, first.prompt_token_ids, samples,
            params.prompt_logprobs is not None, arrival_time=first.arrival_time,
            is_pooling=is_pooling)

    def has(self, request_id: str) -> bool:
        return request_id in self._parents

    def child_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return list(parent.samples) if parent else []

    def drop(self, request_id: str) -> None:
        parent = self._parents.pop(request_id, None)
        for child in (parent.samples if parent else []):
            self._child_to_parent.pop(child, None)

    @property
    def num_unfinished(self) -> int:
        return len(self._parents)

    def process(self, outputs: list[EngineCoreOutput],
                requests: dict[str, Request]) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Returns changed RequestOutputs and (child id, stop string) pairs whose request must
        now be finished by the scheduler."""
        changed: dict[str, _Parent] = {}
        stops: list[tuple[str, str]] = []
        for out in outputs:
            parent_id = self._child_to_parent.get(out.req_id)
            if parent_id is None:
                continue
            parent = self._parents[parent_id]
            sample = parent.samples[out.req_id]
            req = requests.get(out.req_id)
            if req is not None and sample.index == 0:
                parent.num_cached_tokens = req.num_cached_tokens
            stop_str = self._apply(parent, sample, out)
            if stop_str is not None:
                stops.append((out.req_id, stop_str))
            changed[parent_id] = parent
        results = [self._make_output(p) for p in changed.values()]
        for p in changed.values():
            if all(s.finish_reason is not None for s in p.samples.values()):
                del self._parents[p.request_id]
                for child in p.samples:
                    self._child_to_parent.pop(child, None)
        return results, stops

    def _apply(self, parent: _Parent, sample: _Sample, out: EngineCoreOutput) -> Optional[str]:
        if out.new_prompt_logprobs:
            first_pos, entries = out.new_prompt_logprobs
            for k, entry in enumerate(entries):
                parent.prompt_logprobs.setdefault(first_pos + k, entry)
        if out.pooled is not None:
            parent.pooled = out.pooled
        sample.token_ids.extend(out.new_token_ids)
        for tok, entry in zip(out.new_token_ids, out.new_logprobs):
            sample.cumulative_logprob += entry[tok].logprob
            if sample.want_logprobs:
                self._decode_entry(entry)
                sample.logprobs.append(entry)
        stop_str = None
        finished = out.finished
        if sample.detokenizer is not None and sample.finish_reason is None:
            stop_hit = out.finished and isinstance(out.stop_reason, int)
            stop_str = sample.detokenizer.update(out.new_token_ids, stop_hit)
            if stop_str is not None:
                finished = True
                sample.finish_reason, sample.stop_reason = "stop", stop_str
            sample.text += sample.detokenizer.get_delta(finished)
        if out.finished and sample.finish_reason is None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
        if out.error is not None:
            sample.error = out.error
        return stop_str

    def _decode_entry(self, entry: dict) -> None:
        if self.tokenizer is None:
            return
        for tok, lp in entry.items():
            if lp.decoded_token is None:
                lp.decoded_token = self.tokenizer.decode([tok], skip_special_tokens=False)

    def _make_output(self, parent: _Parent) -> "RequestOutput | EmbeddingRequestOutput":
        if parent.is_pooling:
            return self._make_embedding_output(parent)
        completions = []
        for s in sorted(parent.samples.values(), key=lambda s: s.index):
            completions.append(CompletionOutput(
                index=s.index, text=s.text, token_ids=list(s.token_ids),
                cumulative_logprob=s.cumulative_logprob if s.want_logprobs else None,
                logprobs=list(s.logprobs) if s.want_logprobs else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason, error=s.error))
        prompt_lps = None
        if parent.want_prompt_logprobs:
            prompt_lps = [None] + [parent.prompt_logprobs.get(p)
                                   for p in range(1, len(parent.prompt_token_ids))]
            for entry in prompt_lps:
                if entry:
                    self._decode_entry(entry)
        finished = all(c.finish_reason is not None for c in completions)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, prompt_lps,
                             completions, finished, parent.num_cached_tokens)

    @staticmethod
    def _make_embedding_output(parent: _Parent) -> EmbeddingRequestOutput:
        sample = next(iter(parent.samples.values()))
        return EmbeddingRequestOutput(
            parent.request_id, parent.prompt, parent.prompt_token_ids,
            EmbeddingOutput(parent.pooled) if parent.pooled is not None else None,
            sample.finish_reason is not None, sample.finish_reason, sample.error,
            parent.num_cached_tokens)
