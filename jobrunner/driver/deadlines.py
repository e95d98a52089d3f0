"""Deadlines inside a worker: a storage call (reading a shard's input, writing its part) that does not answer
in time fails the shard naming what it was doing, instead of hanging the shard forever.

A Python thread cannot be cancelled, so the call runs on a helper thread and the caller stops waiting for
it at the deadline; the abandoned call can only ever finish into its attempt's own temporary key (fenced
commits), never into a published part.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class PhaseTimeout(TimeoutError):
    """A worker phase (reading input, writing a part) passed its deadline; the message names shard and phase."""

    def __reduce__(self):  # plain re-creation across Ray's pickling
        return (PhaseTimeout, self.args)


def call_with_deadline(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """fn() on a helper thread; its result or exception, or PhaseTimeout("<what>: no answer for N s")."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as is
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name=f"deadline: {what[:40]}", daemon=True).start()
    if not done.wait(timeout_s):
        raise PhaseTimeout(f"{what}: no answer for {timeout_s:g} s (cluster.io_timeout_s)")
    if "error" in box:
        raise box["error"]
    return box["value"]
