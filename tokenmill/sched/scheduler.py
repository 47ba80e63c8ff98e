"""Continuous-batching scheduler (pure Python, no torch).

Every step hands out a token budget (``max_num_batched_tokens``) over at most ``max_num_seqs``
running requests. Running requests are served first, in policy order; each gets what it still
lacks (``num_tokens_with_spec - num_computed_tokens``: a decode token, 1 + k speculative tokens
or the rest of a prefill, chunked to the budget). Rejected drafts are rolled back by count in
``update_from_output``. If the pool is short, the lowest-ranked running request (see
``policy.pick_victim``) is preempted by recompute: its blocks are freed and it returns to the
waiting queue with ``num_computed_tokens = 0``. Waiting requests are admitted in policy order
while budget, seats and blocks last; prefix-cache hits advance them for free.
"""
from __future__ import annotations

import time
from typing import Optional

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.kv.kv_cache_manager import KVCacheManager
from tokenmill.kv.layout import KVLayout
from tokenmill.outputs import EngineCoreOutput, ModelRunnerOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.sched.grammar_steps import advance_grammar, grammar_bitmask, grammar_drafts
from tokenmill.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenmill.structured.stats import GrammarStats
from tokenmill.sched.policy import RequestQueue, pick_victim
from tokenmill.spec import draft_tree


class Scheduler:
    def __init__(self, sched_config: SchedulerConfig, cache_config: CacheConfig,
                 kv_layout: KVLayout, max_model_len: int, num_lookahead_tokens: int = 0) -> None:
        self.config = sched_config
        # Extra slots a drafter writes draft KV into after a step (layer_skip, draft_model).
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(kv_layout, cache_config.block_size,
                                 cache_config.enable_prefix_caching)
        self.waiting = RequestQueue(sched_config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._known_to_runner: set[str] = set()
        self._finished_ids: set[str] = set()
        self._leaders: dict[str, Request] = {}   # parent id -> sample 0 of an n > 1 request
        self.recently_finished: dict[str, Request] = {}   # cleared by the engine each step
        self.num_preemptions = 0
        self.grammar_stats = GrammarStats()
        # Requests of a failed step: id -> num_computed_tokens the failed step would have
        # reached. Each runs alone until it gets there (see recover_failed_step).
        self.suspects: dict[str, int] = {}
        self._unsent_preempted: set[str] = set()   # preempted by a failed step

    # -- admission ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Admit a request or raise ValueError if it can never run."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        worst_case = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        short = self.kv.shortfall(worst_case, self._max_step_tokens)
        if short is not None:
            raise ValueError(
                f"request needs up to {short[0]} KV blocks ({request.num_prompt_tokens} prompt + "
                f"{request.max_tokens} max_tokens) but the KV cache holds only "
                f"{short[1]} blocks of {self.kv.block_size} tokens; lower max_tokens "
                f"or give the cache more memory")
        self.requests[request.request_id] = request
        if request.grammar is not None:
            kind = request.sampling_params.structured_outputs.kind
            self.grammar_stats.num_requests[kind] = self.grammar_stats.num_requests.get(kind, 0) + 1
        if request.sample_index == 0 and request.sampling_params.n > 1:
            self._leaders[request.parent_id] = request
        self.waiting.add(request)

    @property
    def _max_step_tokens(self) -> int:
        """The most tokens one request's step may take slots for."""
        return self.config.max_num_batched_tokens + self.num_lookahead_tokens

    def max_request_tokens(self) -> Optional[int]:
        """The longest request ``add_request`` admits (None: any, every KV group slides)."""
        return self.kv.max_request_tokens(self._max_step_tokens)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def take_finished_ids(self) -> set[str]:
        """Ids finished since the last schedule(); the runner drops their state (used when
        the engine goes idle, so no stale state waits for a next step)."""
        ids, self._finished_ids = self._finished_ids, set()
        return ids

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.suspects:
            return self._schedule_alone(self.requests[next(iter(self.suspects))])
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()
        spec: dict[str, list[int]] = {}
        trees: dict[str, list[int]] = {}

        self.running.sort(key=self.waiting.sort_key)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens_with_spec - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            new_block_ids, num_new = self._allocate_running(req, num_new)
            if new_block_ids is None:
                victim = pick_victim(self.running[i:], "fcfs")  # running is in policy order
                self._preempt(victim)
                preempted.add(victim.request_id)
                continue   # retry req (unless it was the victim: the list got shorter)
            budget -= num_new
            num_scheduled[req.request_id] = num_new
            num_drafts = num_new - (req.num_tokens - req.num_computed_tokens)
            if num_drafts > 0:   # drafts past the budget are simply not verified this step
                spec[req.request_id] = req.spec_token_ids[:num_drafts]
                parents = req.spec_parents[:num_drafts] if req.spec_parents else None
                if not draft_tree.is_chain(parents):   # a prefix of a tree is a tree too
                    trees[req.request_id] = parents
            cached_reqs.append(self._request_data(req, new_block_ids, new_reqs))
            i += 1
        cached_reqs = [c for c in cached_reqs if c is not None]

        if not preempted:
            budget = self._admit_waiting(budget, num_scheduled, new_reqs)
        return self._output(new_reqs, cached_reqs, num_scheduled, preempted, spec, trees)

    def _output(self, new_reqs: list[NewRequestData], cached_reqs: list[CachedRequestData],
                num_scheduled: dict[str, int], preempted: set[str],
                spec: dict[str, list[int]], trees: Optional[dict] = None) -> SchedulerOutput:
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self._finished_ids,
            preempted_req_ids=preempted | self._unsent_preempted,
            scheduled_spec_token_ids=spec, scheduled_spec_parents=trees or {},
            grammar_bitmask=grammar_bitmask(self.requests, num_scheduled, spec))
        self._finished_ids, self._unsent_preempted = set(), set()
        return out

    # -- failed steps -----------------------------------------------------------------------
    def recover_failed_step(self, sched_out: SchedulerOutput, error: str) -> list[EngineCoreOutput]:
        """Undo a step whose execution raised. Run alone, its request caused it and fails
        with ``error``. Otherwise every request of the step is preempted (recompute: nothing
        of the failed step is kept) and becomes a suspect that re-runs alone up to where the
        step had taken it: the one at fault then fails by itself, the others go on with
        exactly the tokens they would have had (a transient fault costs them only time)."""
        self._finished_ids |= sched_out.finished_req_ids   # the runner may not have seen them
        self._unsent_preempted |= sched_out.preempted_req_ids
        reqs = [self.requests[r] for r in sched_out.num_scheduled_tokens if r in self.requests]
        if len(reqs) == 1:
            req = reqs[0]
            req.error = error
            self._finish(req, RequestStatus.FINISHED_ERROR)
            return [EngineCoreOutput(req.request_id, [], finished=True, error=error,
                                     finish_reason=req.status.finish_reason)]
        for req in reqs:
            reached = req.num_computed_tokens + sched_out.num_scheduled_tokens[req.request_id]
            self.suspects[req.request_id] = min(reached, req.num_tokens)
            self._preempt(req, counted=False)
            self._unsent_preempted.add(req.request_id)
        return []

    def _schedule_alone(self, req: Request) -> SchedulerOutput:
        """A step for one suspect (no drafts): the other requests wait, and give up seats
        and blocks to it if they must."""
        budget, preempted = self.config.max_num_batched_tokens, set()
        req.spec_token_ids = []
        new_reqs, cached_reqs = [], []
        if req.status == RequestStatus.RUNNING:
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while (new_block_ids := self._allocate_running(req, num_new)[0]) is None:
                preempted.add(self._preempt_other(req))
            data = self._request_data(req, new_block_ids, new_reqs)   # None: sent as new
            cached_reqs = [data] if data is not None else []
        else:
            while len(self.running) >= self.config.max_num_seqs:
                preempted.add(self._preempt_other(req))
            hit, num_cached = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_cached, budget)
            while self.kv.allocate_slots(req, num_new, hit) is None:
                preempted.add(self._preempt_other(req))
            self._start_running(req, num_cached)
            self._request_data(req, [], new_reqs)
        return self._output(new_reqs, cached_reqs, {req.request_id: num_new}, preempted, {})

    def _preempt_other(self, keep: Request) -> str:
        victim = next(r for r in reversed(self.running) if r is not keep)
        self._preempt(victim)
        return victim.request_id

    def _allocate_running(self, req: Request, num_new: int) -> tuple[Optional[tuple], int]:
        """Slots for num_new tokens plus the drafter's lookahead. Speculation is optional, so
        when the pool is short the lookahead and then the drafts go before anyone is preempted."""
        ids = self.kv.allocate_slots(req, num_new + self.num_lookahead_tokens)
        if ids is None and self.num_lookahead_tokens:
            ids = self.kv.allocate_slots(req, num_new)
        if ids is None and req.spec_token_ids:
            req.spec_token_ids = []
            num_new = min(num_new, req.num_tokens - req.num_computed_tokens)
            ids = self.kv.allocate_slots(req, num_new)
        return ids, num_new

    def _request_data(self, req: Request, new_block_ids: tuple[list[int], ...],
                      new_reqs: list[NewRequestData]) -> Optional[CachedRequestData]:
        if req.request_id in self._known_to_runner:
            return CachedRequestData(req.request_id, new_block_ids, req.num_computed_tokens)
        new_reqs.append(NewRequestData(
            req_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            output_token_ids=list(req.output_token_ids), sampling_params=req.sampling_params,
            block_tables=self.kv.block_tables(req.request_id),
            num_computed_tokens=req.num_computed_tokens, generator_seed=_sample_seed(req),
            pooling_params=req.pooling_params))
        self._known_to_runner.add(req.request_id)
        return None

    def _admit_waiting(self, budget: int, num_scheduled: dict[str, int],
                       new_reqs: list[NewRequestData]) -> int:
        for req in self.waiting.ordered():
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self._held_back(req):
                continue
            hit, num_cached = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_cached, budget)
            if self.kv.allocate_slots(req, num_new, hit) is None:
                break   # head of line waits for blocks; later ones must not starve it
            self._start_running(req, num_cached)
            budget -= num_new
            num_scheduled[req.request_id] = num_new
            self._request_data(req, [], new_reqs)
        return budget

    def _start_running(self, req: Request, num_cached: int) -> None:
        self.waiting.remove(req)
        req.num_computed_tokens = num_cached
        if req.num_preemptions == 0 or req.status == RequestStatus.WAITING:
            req.num_cached_tokens = num_cached
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        self.running.append(req)

    def _held_back(self, req: Request) -> bool:
        """Samples 1..n-1 of an n > 1 request wait until sample 0 has computed the prompt, so
        they share its KV blocks through the prefix cache instead of recomputing them."""
        if req.sample_index == 0 or not self.kv.enable_caching:
            return False
        leader = self._leaders.get(req.parent_id)
        return (leader is not None and not leader.is_finished
                and leader.num_computed_tokens < leader.num_prompt_tokens - 1)

    def _preempt(self, req: Request, counted: bool = True) -> None:
        """Free the request's blocks; it recomputes from scratch when it runs again.
        ``counted``: a preemption for lack of blocks (num_preemptions), not a failed step's."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        self._known_to_runner.discard(req.request_id)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += int(counted)
        self.waiting.add(req)

    # -- results ---------------------------------------------------------------------------
    def update_from_output(self, sched_out: SchedulerOutput,
                           runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = []
        sampled = dict(zip(runner_out.req_ids, runner_out.sampled_token_ids))
        for req_id, num_new in sched_out.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                continue
            token_ids = sampled.get(req_id, [])
            num_rejected = self._num_rejected(sched_out, req_id, token_ids)
            req.num_computed_tokens += num_new - num_rejected
            if req.drafts_are_forced:
                self.grammar_stats.count_forced(sched_out.scheduled_spec_token_ids.get(req_id, []),
                                                num_rejected)
            req.spec_token_ids = []
            out = EngineCoreOutput(req_id, [])
            out.new_prompt_logprobs = runner_out.prompt_logprobs.get(req_id, [])
            error = runner_out.errors.get(req_id)
            if error is not None:
                req.error = out.error = error
                self._finish(req, RequestStatus.FINISHED_ERROR)
            else:
                self.kv.cache_computed_blocks(req)
                if req.pooling_params is not None:   # prompt-only: samples no tokens
                    self._finish_pooled(req, runner_out.pooled.get(req_id), out)
                self._append_tokens(req, token_ids, out, runner_out.logprobs.get(req_id, []))
                out.error = req.error
                if not req.is_finished and token_ids:   # drafts follow a sampled token
                    req.spec_token_ids, req.spec_parents = self._usable_drafts(
                        req, runner_out.draft_token_ids.get(req_id),
                        runner_out.draft_parents.get(req_id))
            reached = self.suspects.get(req_id)   # (a finished suspect is gone already)
            if reached is not None and req.num_computed_tokens >= reached:
                del self.suspects[req_id]   # it got past the failed step alone
            out.finished = req.is_finished
            out.finish_reason = req.status.finish_reason
            out.stop_reason = req.stop_reason
            if out.new_token_ids or out.finished or out.new_prompt_logprobs:
                outputs.append(out)
        return outputs

    @staticmethod
    def _num_rejected(sched_out: SchedulerOutput, req_id: str, token_ids: list[int]) -> int:
        """k scheduled drafts yield a accepted + 1 recovered/bonus token; the k - a rejected
        ones leave num_computed_tokens (their KV slots are simply overwritten later)."""
        drafts = sched_out.scheduled_spec_token_ids.get(req_id)
        if not drafts:
            return 0
        return len(drafts) + 1 - len(token_ids) if token_ids else len(drafts)

    def _usable_drafts(self, req: Request, drafts: Optional[list[int]],
                       parents: Optional[list[int]] = None) -> tuple[list[int], Optional[list[int]]]:
        """Drop drafts that could only produce tokens past max_tokens or max_model_len (drafts
        of depth d make up to d + 1 tokens), and those the request's grammar refuses (they
        would be rejected anyway, and the grammar cannot step through them to mask what
        follows; a grammar takes a tree's chain alone). Returns (drafts, their parents: None
        for a chain)."""
        room = max(min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1, 0)
        req.drafts_are_forced = False
        drafts = list(drafts or [])
        if parents is not None and (req.grammar is not None or draft_tree.is_chain(parents)):
            drafts, parents = drafts[:draft_tree.chain_length(parents)], None
        if req.grammar is not None:   # its forced tokens become drafts, proposed or not
            drafts = grammar_drafts(req, drafts, self.config.max_forced_drafts)
        if parents is None:
            return list(drafts[:room]), None
        # every node takes a slot (up to max_model_len), the tree's depth bounds its tokens
        nodes = max(self.max_model_len - req.num_tokens - 1, 0)
        keep = [i for i, d in enumerate(draft_tree.depths(parents[:nodes])) if d <= room]
        return [drafts[i] for i in keep], [parents[i] for i in keep]

    def _append_tokens(self, req: Request, token_ids: list[int], out: EngineCoreOutput,
                       logprobs: list) -> None:
        for k, token in enumerate(token_ids):
            req.append_output_token(token)
            out.new_token_ids.append(token)
            if k < len(logprobs):
                out.new_logprobs.append(logprobs[k])
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            status = advance_grammar(req, token, self.grammar_stats) or self._check_stop(req, token)
            if status is not None:
                self._finish(req, status)
                break

    def _finish_pooled(self, req: Request, pooled: Optional[list[float]],
                       out: EngineCoreOutput) -> None:
        """A pooling request is done once its whole prompt is computed; the runner pools the
        step that computes the last prompt row."""
        if req.num_computed_tokens < req.num_prompt_tokens:
            return
        if pooled is None:
            req.error = out.error = "the runner returned no pooled vector"
            self._finish(req, RequestStatus.FINISHED_ERROR)
            return
        out.pooled = pooled
        self._finish(req, RequestStatus.FINISHED_STOPPED)

    def _check_stop(self, req: Request, token: int) -> Optional[RequestStatus]:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens and token in params.all_stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_requests(self, req_ids, status: RequestStatus, stop_reason=None) -> None:
        """Finish from outside a step (abort, stop string found by the detokenizer)."""
        for req_id in ([req_ids] if isinstance(req_ids, str) else req_ids):
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                continue
            if stop_reason is not None:
                req.stop_reason = stop_reason
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.finished_time = time.monotonic()
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        self._known_to_runner.discard(req.request_id)
        self._finished_ids.add(req.request_id)
        self.suspects.pop(req.request_id, None)
        del self.requests[req.request_id]
        self.recently_finished[req.request_id] = req
        if self._leaders.get(req.parent_id) is req:
            del self._leaders[req.parent_id]


def _sample_seed(req: Request) -> Optional[int]:
    seed = req.sampling_params.seed
    if seed is None:
        return None
    return (seed + req.sample_index) % (2**63)
