"""A benchmark stopped by its time limit keeps what it measured.

``bash bench/gpu_check.sh`` runs every phase under ``timeout``, which sends SIGTERM at the phase's limit and
SIGKILL a grace period later. A script that wants its measurements to survive that runs inside
``sigterm_raises()``: SIGTERM then raises ``Interrupted`` in the main thread, the script's top level catches it
(or ``KeyboardInterrupt``, for a Ctrl-C by hand: ``STOPPED`` holds both), writes what it has with the
interruption recorded, and exits with ``exit_status(stop)``::

    with interrupt.sigterm_raises():
        try:
            measure(rows)          # rows filled as they are measured
        except interrupt.STOPPED as stop:
            stopped = interrupt.describe(stop, where="the kernel sweep")
    with interrupt.sigterm_ignored():
        save(rows, stopped)

``Interrupted`` derives from ``BaseException``, like ``KeyboardInterrupt``, so the ``except Exception`` that turns
a failing provider or part into a reported row does not swallow it. After the first SIGTERM further ones are
ignored, so a second signal cannot cut the writing short (SIGKILL still can: write the important files first).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

__all__ = ["Interrupted", "STOPPED", "sigterm_raises", "sigterm_ignored", "describe", "exit_status"]


class Interrupted(BaseException):
    """SIGTERM arrived while a benchmark ran inside ``sigterm_raises()``."""


STOPPED = (Interrupted, KeyboardInterrupt)


_fired = False  # a SIGTERM arrived: from then on the process ignores SIGTERM, whatever block it is in


def _raise(signum: int, frame: object) -> None:
    global _fired
    _fired = True
    signal.signal(signum, signal.SIG_IGN)  # one signal stops the run; the rest must not stop the writing
    raise Interrupted(signal.Signals(signum).name)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block SIGTERM raises ``Interrupted`` (main thread only); the previous handler comes back after,
    unless a SIGTERM fired: then it stays ignored, so a second one cannot cut the writing short."""
    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN if _fired else previous)


@contextlib.contextmanager
def sigterm_ignored() -> Iterator[None]:
    """Within the block SIGTERM is ignored: the final writes of a run, complete or stopped, finish (SIGKILL aside)."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def describe(stop: BaseException, where: str | None = None) -> dict:
    """What a results file records about an interruption: the signal (or ``KeyboardInterrupt``) and where."""
    return {"signal": str(stop) if isinstance(stop, Interrupted) else type(stop).__name__, "during": where}


def exit_status(stop: BaseException) -> int:
    """The shell's status for a process ended by the signal: 143 for SIGTERM, 130 for SIGINT (Ctrl-C)."""
    return 128 + (signal.SIGTERM if isinstance(stop, Interrupted) else signal.SIGINT)
