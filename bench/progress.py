"""Progress bars for the benchmark run: one place decides how progress is shown.

A *progress factory* is what every benchmark part takes as its ``progress`` argument::

    progress(desc: str, total: int) -> bar

It opens a bar of ``total`` steps labelled ``desc``; the bar has ``update(n=1)`` (n more steps done) and
``close()``, like a ``tqdm.tqdm`` (which is what ``factory()`` returns bars of: counts, elapsed time and an ETA
on stderr). ``progress`` may also be None: the part then shows nothing. A part should not test for None
itself; ``open_bar(progress, desc, total)`` gives a bar that does nothing in that case, and works as a
context manager that closes the bar::

    def run(quick: bool, progress) -> list[dict]:
        with open_bar(progress, "memory recipes", total=3) as bar:
            for recipe in recipes:
                ...
                bar.update()

Bars write to stderr and results to stdout, so ``python bench/run.py > summary.txt`` keeps a clean summary.
Without tqdm installed (it comes with the ``bench`` extra), ``factory()`` falls back to one line per bar,
printed when the bar closes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Protocol

__all__ = ["Bar", "ProgressFactory", "factory", "open_bar"]


class Bar(Protocol):
    """What a progress factory returns (a ``tqdm.tqdm`` satisfies it)."""

    def update(self, n: int = 1) -> object: ...

    def close(self) -> None: ...


ProgressFactory = Callable[[str, int], Bar]


class _ClosingBar:
    """Wraps a bar so that ``with`` closes it; forwards ``update`` and ``close``."""

    def __init__(self, bar: Bar | None) -> None:
        self._bar = bar

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> _ClosingBar:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _LineBar:
    """The fallback without tqdm: one line with the count and the time taken, when the bar closes."""

    def __init__(self, desc: str, total: int) -> None:
        self.desc, self.total, self.done = desc, total, 0
        self._started = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.done += n

    def close(self) -> None:
        elapsed = time.perf_counter() - self._started
        print(f"{self.desc}: {self.done}/{self.total} in {elapsed:.1f}s", file=sys.stderr, flush=True)


def factory(enabled: bool = True) -> ProgressFactory | None:
    """The run's progress factory: tqdm bars on stderr (a plain line per bar without tqdm); None when disabled.

    Args:
        enabled: False gives None, the factory that shows nothing.
    """
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return _LineBar

    def make(desc: str, total: int) -> Bar:
        # A top-level bar stays on screen when done (the finished bars log what ran and how long it took); a bar
        # opened while another is running (leave=None) is nested and disappears when it closes.
        # When stderr is a file (CI logs), redraw rarely rather than write a line per update.
        return tqdm(
            total=total,
            desc=desc,
            file=sys.stderr,
            dynamic_ncols=True,
            leave=None,
            mininterval=0.2 if sys.stderr.isatty() else 10.0,
            bar_format="{desc:<34} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]",
        )

    return make


def open_bar(progress: ProgressFactory | None, desc: str, total: int) -> _ClosingBar:
    """A bar from ``progress`` (a no-op bar when it is None) that closes itself at the end of a ``with`` block.

    Args:
        progress: the run's progress factory, or None.
        desc: what the bar counts, shown at its left.
        total: the number of steps it will count.
    """
    return _ClosingBar(None if progress is None else progress(desc, total))
