"""Is the database answering? A ping with a timeout, every second. A hung
database (a stopped process, a dead network path) does not refuse
connections, it just never answers, so only a timeout notices it.

While the database is down, calls that need it fail at once with
Unavailable (clients retry), and calls already waiting on it are released
with Unavailable when it is found down; the threads stuck in the driver
finish or fail on their own once the database answers again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from bots_server.errors import Unavailable
from bots_server.store import Store

log = logging.getLogger(__name__)

T = TypeVar("T")

CHECK_INTERVAL_S = 1.0


class DatabaseHealth:
    def __init__(self, store: Store, timeout_s: float) -> None:
        self.store = store
        self.timeout_s = timeout_s
        self.up: bool | None = None  # None until the first check
        self._down = asyncio.Event()
        self._ping: asyncio.Future[None] | None = None
        self._listeners: list[Callable[[bool], Awaitable[None]]] = []

    @property
    def bound_seconds(self) -> float:
        """How long a hang goes unnoticed at most."""
        return CHECK_INTERVAL_S + self.timeout_s

    def on_change(self, listener: Callable[[bool], Awaitable[None]]) -> None:
        self._listeners.append(listener)

    async def check(self) -> bool:
        """Ping (one at a time: a ping stuck in a hung driver is waited for,
        not piled on) and record the answer."""
        if self._ping is None or self._ping.done():
            self._ping = asyncio.ensure_future(asyncio.to_thread(self.store.ping))
        try:
            await asyncio.wait_for(asyncio.shield(self._ping), self.timeout_s)
        except (Unavailable, TimeoutError) as e:
            reason = str(e) or f"no answer within {self.timeout_s:g} s"
            await self._set(False, reason)
        else:
            await self._set(True, "")
        return bool(self.up)

    async def _set(self, up: bool, reason: str) -> None:
        if up == self.up:
            return
        if up:
            self._down.clear()
            log.info("database answering; ready")
        else:
            self._down.set()
            log.warning("database not answering; not ready", extra={"error": reason})
        self.up = up
        for listener in self._listeners:
            await listener(up)

    async def watch(self) -> None:
        """Until cancelled."""
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            await self.check()

    async def call(self, work: Awaitable[T]) -> T:
        """`work` (a store call on a worker thread), or Unavailable as soon as
        the database is found down while it waits."""
        if self._down.is_set():
            close = getattr(work, "close", None)
            if close is not None:
                close()  # a coroutine that will never run
            raise Unavailable("the database is not answering; retry")
        task = asyncio.ensure_future(work)
        down = asyncio.ensure_future(self._down.wait())
        try:
            await asyncio.wait((task, down), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.add_done_callback(_ignore_result)  # the caller left; the work ends on its own
            raise
        finally:
            down.cancel()
        if task.done():
            return task.result()
        task.add_done_callback(_ignore_result)  # the stuck thread's late answer
        raise Unavailable("the database stopped answering; retry")


def _ignore_result(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as lost
