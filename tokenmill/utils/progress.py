"""Start-up reports: a model fetch's progress and the summary line of a load.

A fetch reports to a *progress* object: ``begin(text, total_bytes)``, ``update(done_bytes)``
(cumulative), ``end(text)``. `LogProgress`, the library's default, sends the two lines to a
logger (silent unless the application configures logging). `BarProgress`, the command
line's, adds a tqdm bar when the stream is a terminal, and otherwise a plain line per
quarter, so a log file or a pipe gets a few readable lines instead of a bar's redraws.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional, TextIO, TypeVar

T = TypeVar("T")


def format_bytes(num_bytes: int) -> str:
    """Decimal units, as pip prints them: 540 kB, 93 MB, 1.2 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            value = num_bytes / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{num_bytes} B"


class LogProgress:
    """A fetch as two INFO lines (begin, end) through ``log``; byte counts are dropped."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log

    def begin(self, text: str, total_bytes: Optional[int]) -> None:
        self.log.info(text)

    def update(self, done_bytes: int) -> None:
        pass

    def end(self, text: str) -> None:
        self.log.info(text)


class BarProgress(LogProgress):
    """`LogProgress` plus the bytes so far: a tqdm bar on ``stream`` when it is a terminal
    (``interactive`` overrides the check), else an INFO line at 25, 50 and 75 % of a known
    total. Nothing at all when ``log`` does not show INFO (``--log-level warning``)."""

    def __init__(self, log: logging.Logger, stream: TextIO,
                 interactive: Optional[bool] = None) -> None:
        super().__init__(log)
        self.stream = stream
        self.interactive = _isatty(stream) if interactive is None else interactive
        self._bar = None
        self._total: Optional[int] = None
        self._quarters_told = 0

    def begin(self, text: str, total_bytes: Optional[int]) -> None:
        super().begin(text, total_bytes)
        self._total, self._quarters_told = total_bytes, 0
        if self.interactive and self.log.isEnabledFor(logging.INFO):
            from tqdm import tqdm
            self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, file=self.stream,
                             leave=False, dynamic_ncols=True, mininterval=0.2)

    def update(self, done_bytes: int) -> None:
        if self._bar is not None:
            self._bar.update(max(0, done_bytes - self._bar.n))
        elif self._total and done_bytes < self._total:   # the end line says "done"
            quarter = 4 * done_bytes // self._total
            if quarter > self._quarters_told:
                self._quarters_told = quarter
                self.log.info(f"  {format_bytes(done_bytes)} of {format_bytes(self._total)} "
                              f"({25 * quarter} %)")

    def end(self, text: str) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        super().end(text)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):   # no isatty, or a closed stream
        return False


def load_summary(name: str, seconds: float, memory_stats: dict) -> str:
    """One line from an engine's ``get_memory_stats()``: what was loaded, how long it took,
    the weights' size (the parameters, then any tiled / prepacked copies made at load: in
    bf16 mode the tiles are most of the model) and the KV cache's capacity."""
    m = memory_stats
    tp = m.get("tensor_parallel_size", 1)
    split = f", over {tp} tensor-parallel ranks" if tp > 1 else ""
    copies = m.get("prepacked_weights", 0)
    copies = f" + {format_bytes(copies)} tiled / prepacked" if copies else ""
    return (f"loaded {name} in {seconds:.1f} s (weights {format_bytes(m['model_weights'])}{copies}, "
            f"KV cache {m['num_total_blocks']} blocks / {m['kv_capacity_tokens']} tokens, "
            f"{format_bytes(m['kv_cache'])}{split})")


def timed_load(name: str, build: Callable[[], T], log: logging.Logger) -> T:
    """``build()`` (an LLM or an LLMEngine), then its `load_summary` line at INFO."""
    start = time.perf_counter()
    loaded = build()
    log.info(load_summary(name, time.perf_counter() - start, loaded.get_memory_stats()))
    return loaded
