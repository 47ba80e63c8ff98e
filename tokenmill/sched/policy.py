"""Waiting-queue orderings. ``fcfs``: arrival order. ``priority``: lower ``priority`` value
first, ties by arrival. Preempted requests go back to the waiting queue with their original
arrival time, so under fcfs they resume before newer requests."""
from __future__ import annotations

import heapq
from typing import Iterator, Optional

from tokenmill.request import Request


class RequestQueue:
    def __init__(self, policy: str = "fcfs") -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}; choose 'fcfs' or 'priority'")
        self.policy = policy
        self._heap: list[tuple[tuple, int, Request]] = []
        self._counter = 0

    def sort_key(self, request: Request) -> tuple:
        if self.policy == "priority":
            return (request.priority, request.arrival_time)
        return (request.arrival_time,)

    def add(self, request: Request) -> None:
        self._counter += 1
        heapq.heappush(self._heap, (self.sort_key(request), self._counter, request))

    def remove(self, request: Request) -> bool:
        for i, (_, _, r) in enumerate(self._heap):
            if r is request:
                self._heap.pop(i)
                heapq.heapify(self._heap)
                return True
        return False

    def ordered(self) -> list[Request]:
        return [r for _, _, r in sorted(self._heap, key=lambda e: (e[0], e[1]))]

    def peek(self) -> Optional[Request]:
        return self._heap[0][2] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.ordered())


def pick_victim(running: list[Request], policy: str) -> Request:
    """Preemption victim: fcfs takes the most recently admitted running request; priority
    takes the worst (highest priority value, then latest arrival)."""
    if policy == "priority":
        return max(running, key=lambda r: (r.priority, r.arrival_time))
    return running[-1]
