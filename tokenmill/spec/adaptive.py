"""Adaptive speculation length: choose k (0 = no speculation) per step and batch size from
measured goodput, never from acceptance alone.

Each (batch-size bucket, k) is an arm whose value is its predicted goodput: expected tokens
per request x requests per second of its steps. The two halves are estimated apart because
their noise differs:
- A step's time hardly varies, so each arm's seconds per request are measured directly
  (decayed sums: the estimate follows drift within a few steps). They hold drafting, the
  engine's time between steps, and how batch size turns verification compute-bound: no cost
  model is needed.
- Tokens per step vary a lot (1 to k + 1 per request), and a bandit reading tokens / second per
  step locks onto a short k whenever a longer one had a few unlucky steps. So the tokens are
  predicted from counts kept per draft position j over every request of every arm that
  reached j: d_j = P(the request got a j-th draft) (prompt lookup may find fewer, or none) and
  a_j = P(draft j accepted | drafts 1..j-1 were). E[tokens | k] = 1 + sum_{i<=k} d_i
  prod_{j<=i} a_j. Every step of k = 3 also teaches k = 1 and 2.
A proposer with ``modes`` (prompt lookup with or without its drafter) doubles the arms: (mode,
k), each mode with its own counts, k = 0 shared.
The best arm is played; the others are re-measured now and then, with an interval that
doubles each time an arm loses and is at least the arm's measured regret (the best arm's steps
one of its steps loses) over EXPLORE_SHARE: an arm that costs three plain steps for no gain
(EAGLE drafting at batch 8) is looked at every ~200 steps, one that nearly ties as often as
doubling allows. That is what keeps speculation within a few percent of no speculation when
it does not pay. Intervals count the bucket's own steps: a bucket visited now and then (the
tail of a batch, a lull) explores as rarely as one that runs all the time, instead of
re-measuring a loser on every visit, at its first steps, whose costs are not the steady ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def bucket_of(batch_size: int) -> int:
    """Power-of-two bucket: batch sizes that cost about the same per step share estimates."""
    b = 1
    while b < batch_size:
        b *= 2
    return b


@dataclass
class _Arm:
    seconds: float = 0.0       # decayed sum of its steps' seconds
    rows: float = 0.0          # decayed sum of the requests in those steps
    count: int = 0
    last_step: int = -1        # its bucket's step count when it last ran
    interval: int = 8          # steps between re-measurements while not the best
    rate: float = 0.0          # predicted tokens / second
    clipped: bool = False      # its last step counted as a spike (AdaptiveK.SPIKE)


PRIOR = 4.0   # pseudo-requests behind a deeper position's rates (_Acceptance.expected_tokens)


@dataclass
class _Acceptance:
    """Decayed counts per draft position j (index j - 1): requests in steps of an arm with
    k >= j (seen), those of them that got a j-th draft (drafted), those offered draft j after
    accepting drafts 1..j-1 (offered), and those that accepted it (accepted)."""
    seen: list
    drafted: list
    offered: list
    accepted: list

    @classmethod
    def empty(cls, k_max: int) -> "_Acceptance":
        return cls(*([0.0] * k_max for _ in range(4)))

    def known(self, j: int) -> bool:
        """Was a request counted at position j (drafts or none)?"""
        return self.seen[j - 1] > 0

    def add(self, k: int, verdicts: Sequence[tuple[int, int]], decay: float) -> None:
        for counts in (self.seen, self.drafted, self.offered, self.accepted):
            for i in range(k):
                counts[i] *= decay
        for drafts, accepted in verdicts:
            for i in range(k):
                self.seen[i] += 1
                if drafts > i:
                    self.drafted[i] += 1
                    if accepted >= i:          # drafts 1..i accepted: draft i + 1 was offered
                        self.offered[i] += 1
                        self.accepted[i] += accepted > i

    def expected_tokens(self, k: int) -> float:
        """1 + sum_{i<=k} d_i prod_{j<=i} a_j. Past position 1 each rate starts from the one
        before it (PRIOR pseudo-requests): a position seen a few times, when only its arm's
        rare re-measurements reach it, must not read as 0 or 1 from one request."""
        total, accepted_before = 1.0, 1.0
        # position 1 starts from one request that got a draft and kept it: optimism that a
        # few unlucky first steps (no draft came, or it failed) cannot turn into a k that is
        # never measured again; it fades as requests are counted
        a = (self.accepted[0] + 1) / (self.offered[0] + 1)
        d = (self.drafted[0] + 1) / (self.seen[0] + 1)
        for i in range(k):
            if i > 0:
                a = (self.accepted[i] + PRIOR * a) / (self.offered[i] + PRIOR)
                d = (self.drafted[i] + PRIOR * d) / (self.seen[i] + PRIOR)
            total += d * accepted_before * a
            accepted_before *= a
        return total


class FixedK:
    """Always k, with the proposer as built (adaptive off)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, batch_size: int) -> tuple[int, int]:
        return self.k, 0

    def record(self, batch_size: int, k: int, seconds: float,
               verdicts: Sequence[tuple[int, int]] = (), mode: int = 0) -> None:
        pass

    def estimated_speedup(self) -> float:
        return 0.0


class AdaptiveK:
    """Arms are (mode, k): k drafts from the proposer's mode (0: as built; a proposer with
    ``modes`` offers cheaper ones, e.g. prompt lookup without its drafter). k = 0 is one arm,
    mode 0. Each mode has its own acceptance counts: its drafts come from elsewhere."""
    # per-record decay of an arm's time sums and of the acceptance counts: time follows drift
    # within a few steps; acceptance, the noisy half, keeps the last ~500 steps' requests
    TIME_DECAY = 0.8
    ACCEPT_DECAY = 1 - 1 / 512
    EXPLORE_SHARE = 0.01   # a losing arm's re-measurements cost at most ~this share of steps
    SPIKE = 1.5     # a step's seconds count up to this multiple of its arm's estimate

    def __init__(self, k_max: int, modes: int = 1, warmup: int = 2, max_interval: int = 1024) -> None:
        self.k_max, self.modes = k_max, modes
        self.arms_k = sorted({0, 1, 2, 4, k_max} & set(range(k_max + 1)))
        self.warmup, self.max_interval = warmup, max_interval
        self.arms: dict[tuple[int, int, int], _Arm] = {}       # (bucket, mode, k)
        self.acceptance: dict[tuple[int, int], _Acceptance] = {}  # (bucket, mode)
        self.steps: dict[int, int] = {}   # bucket -> steps chosen in it (intervals count these)
        self._last_bucket = 1

    def _arm(self, bucket: int, key: tuple[int, int]) -> _Arm:
        return self.arms.setdefault((bucket, *key), _Arm())

    def _accept(self, bucket: int, mode: int) -> _Acceptance:
        return self.acceptance.setdefault((bucket, mode), _Acceptance.empty(self.k_max))

    def _keys(self) -> list[tuple[int, int]]:
        return [(0, 0)] + [(m, k) for m in range(self.modes) for k in self.arms_k if k > 0]

    def _best(self, bucket: int) -> tuple[int, int]:
        """(mode, k) of the best arm."""
        return max(self._keys(), key=lambda key: self._arm(bucket, key).rate)

    def _measured(self, bucket: int, key: tuple[int, int]) -> bool:
        mode, k = key
        return self._arm(bucket, key).count >= self.warmup and \
            (k == 0 or self._accept(bucket, mode).known(1))

    def _eligible(self, bucket: int) -> list[tuple[int, int]]:
        """Arms worth measuring: k = 0, k = 1 of each mode, then in each mode each larger k
        only while the next smaller one came within 10% of the best so far. A large k costs
        most when speculation does not pay, so it is never tried blindly (that would spend the
        5% budget on exploration)."""
        out = [(0, 0)]
        for mode in range(self.modes):
            for prev, k in zip(self.arms_k[1:], self.arms_k[2:]):
                out.append((mode, prev))
                best = max(self._arm(bucket, key).rate for key in out)
                arm = self._arm(bucket, (mode, prev))
                if not self._measured(bucket, (mode, prev)) or arm.rate < 0.9 * best:
                    break
            else:
                if len(self.arms_k) > 1:
                    out.append((mode, self.arms_k[-1]))
        return out

    def choose(self, batch_size: int) -> tuple[int, int]:
        """(k, mode) for the next step."""
        bucket = self._last_bucket = bucket_of(batch_size)
        step = self.steps[bucket] = self.steps.get(bucket, 0) + 1
        eligible = self._eligible(bucket)
        for key in eligible:                        # measure eligible arms a few times first
            if not self._measured(bucket, key):
                return key[1], key[0]
        best = max(eligible, key=lambda key: self._arm(bucket, key).rate)
        for key in eligible:                        # then re-measure losers, rarely
            arm = self._arm(bucket, key)
            if key != best and step - arm.last_step >= arm.interval:
                arm.last_step = step
                return key[1], key[0]
        return best[1], best[0]

    def record(self, batch_size: int, k: int, seconds: float,
               verdicts: Sequence[tuple[int, int]] = (), mode: int = 0) -> None:
        """One step of arm (mode, k): ``batch_size`` requests in ``seconds`` (drafting
        included); ``verdicts``: (drafts verified, drafts accepted) of each request of a k > 0
        step."""
        if seconds <= 0 or k not in self.arms_k or batch_size <= 0 or not 0 <= mode < self.modes:
            return
        key = (mode if k else 0, k)
        bucket = bucket_of(batch_size)
        arm = self._arm(bucket, key)
        if arm.count >= self.warmup and arm.rows > 0:
            # a spike (a collection, the drafter writing 256 queued rows, the OS) is not what
            # this arm costs: left whole it would sink the arm until its next re-measurement,
            # which may be a thousand steps away. A second one in a row is the arm's cost
            # changing (load, longer contexts, cheap warmup steps): that one counts whole
            cap = self.SPIKE * batch_size * arm.seconds / arm.rows
            arm.clipped = seconds > cap and not arm.clipped
            if arm.clipped:
                seconds = cap
        arm.seconds = self.TIME_DECAY * arm.seconds + seconds
        arm.rows = self.TIME_DECAY * arm.rows + batch_size
        arm.count += 1
        arm.last_step = self.steps.get(bucket, 0)
        if k > 0 and verdicts:
            self._accept(bucket, mode).add(k, verdicts, self.ACCEPT_DECAY)
        for other_key in self._keys():              # new counts move every arm's prediction
            other = self._arm(bucket, other_key)
            if other.seconds > 0:
                tokens = self._accept(bucket, other_key[0]).expected_tokens(other_key[1])
                other.rate = tokens * other.rows / other.seconds
        if arm.count > self.warmup:
            # A loser backs off (doubling, and at least as far as keeps its measured regret
            # under EXPLORE_SHARE of the bucket's steps), a winner is watched closely again.
            best = self._arm(bucket, self._best(bucket))
            if arm is best:
                arm.interval = 8
            else:
                regret = self._regret_steps(arm, best)
                arm.interval = min(max(2 * arm.interval, int(regret / self.EXPLORE_SHARE)), self.max_interval)

    @staticmethod
    def _regret_steps(arm: _Arm, best: _Arm) -> float:
        """Steps of the best arm lost by playing ``arm`` once: its step's time less the time
        the best arm takes for the same tokens, in units of the best arm's step."""
        if arm.rows <= 0 or best.rows <= 0 or best.seconds <= 0 or best.rate <= 0:
            return 0.0
        relative_cost = (arm.seconds / arm.rows) / (best.seconds / best.rows)
        return relative_cost * max(0.0, 1.0 - arm.rate / best.rate)

    def estimated_speedup(self) -> float:
        """Goodput of the best arm over no speculation, for the latest batch-size bucket."""
        base = self._arm(self._last_bucket, (0, 0)).rate
        best = self._arm(self._last_bucket, self._best(self._last_bucket)).rate
        return best / base if base > 0 else 0.0
