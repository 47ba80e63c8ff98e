"""Adaptive speculation length: choose k (0 = no speculation) per step and batch size from
measured goodput, never from acceptance alone.

Each (batch-size bucket, k) is an arm of a bandit whose reward is the step's goodput:
tokens emitted / (verify step time + time spent drafting for it). That one number already
holds acceptance, drafting cost and how batch size turns verification compute-bound, so no
cost model is needed. The best arm is played; the others are re-measured now and then, with
an interval that doubles each time an arm loses (so a bad k costs a vanishing share of steps,
which is what keeps speculation within a few percent of no speculation when it does not pay).
"""
from __future__ import annotations

from dataclasses import dataclass


def bucket_of(batch_size: int) -> int:
    """Power-of-two bucket: batch sizes that cost about the same per step share estimates."""
    b = 1
    while b < batch_size:
        b *= 2
    return b


@dataclass
class _Arm:
    rate: float = 0.0          # EMA of tokens / second
    count: int = 0
    last_step: int = -1
    interval: int = 8          # steps between re-measurements while not the best


class FixedK:
    """Always k (adaptive off)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, batch_size: int) -> int:
        return self.k

    def record(self, batch_size: int, k: int, num_tokens: int, seconds: float) -> None:
        pass

    def estimated_speedup(self) -> float:
        return 0.0


class AdaptiveK:
    def __init__(self, k_max: int, ema: float = 0.25, warmup: int = 2,
                 max_interval: int = 1024) -> None:
        self.arms_k = sorted({0, 1, 2, 4, k_max} & set(range(k_max + 1)))
        self.ema, self.warmup, self.max_interval = ema, warmup, max_interval
        self.arms: dict[tuple[int, int], _Arm] = {}
        self.step = 0
        self._last_bucket = 1

    def _arm(self, bucket: int, k: int) -> _Arm:
        return self.arms.setdefault((bucket, k), _Arm())

    def _best(self, bucket: int) -> int:
        return max(self.arms_k, key=lambda k: self._arm(bucket, k).rate)

    def _eligible(self, bucket: int) -> list[int]:
        """Arms worth measuring: k = 0, 1, then each larger k only while the next smaller one
        came within 10% of the best so far. A large k costs most when speculation does not
        pay, so it is never tried blindly (that would spend the 5% budget on exploration)."""
        out = [self.arms_k[0]]
        for prev, k in zip(self.arms_k, self.arms_k[1:]):
            arm = self._arm(bucket, prev)
            best = max(self._arm(bucket, j).rate for j in out)
            if prev > 0 and (arm.count < self.warmup or arm.rate < 0.9 * best):
                break
            out.append(k)
        return out

    def choose(self, batch_size: int) -> int:
        self.step += 1
        bucket = self._last_bucket = bucket_of(batch_size)
        eligible = self._eligible(bucket)
        for k in eligible:                          # measure eligible arms a few times first
            if self._arm(bucket, k).count < self.warmup:
                return k
        best = max(eligible, key=lambda k: self._arm(bucket, k).rate)
        for k in eligible:                          # then re-measure losers, rarely
            arm = self._arm(bucket, k)
            if k != best and self.step - arm.last_step >= arm.interval:
                arm.last_step = self.step
                return k
        return best

    def record(self, batch_size: int, k: int, num_tokens: int, seconds: float) -> None:
        if seconds <= 0 or k not in self.arms_k:
            return
        bucket = bucket_of(batch_size)
        arm = self._arm(bucket, k)
        rate = num_tokens / seconds
        arm.rate = rate if arm.count == 0 else (1 - self.ema) * arm.rate + self.ema * rate
        arm.count += 1
        arm.last_step = self.step
        if arm.count > self.warmup:
            best = self._best(bucket)
            # A loser backs off (doubling), a winner is watched closely again.
            arm.interval = 8 if k == best else min(2 * arm.interval, self.max_interval)

    def estimated_speedup(self) -> float:
        """Goodput of the best arm over no speculation, for the latest batch-size bucket."""
        base = self._arm(self._last_bucket, 0).rate
        best = self._arm(self._last_bucket, self._best(self._last_bucket)).rate
        return best / base if base > 0 else 0.0
