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
        self._waiting: set[asyncio.Future[Any]] = set()  # calls waiting on the database

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
            for waiting in list(self._waiting):  # their threads finish or fail on their own later
                if not waiting.done():
                    waiting.set_exception(Unavailable("the database stopped answering; retry"))
        self.up = up
        for listener in self._listeners:
            await listener(up)

    async def watch(self) -> None:
        """Until cancelled."""
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            await self.check()

    async def call(self, submit: Callable[[], asyncio.Future[T]]) -> T:
        """The result of the work `submit` starts (a store call on a worker
        thread), or Unavailable at once while the database is down, or as
        soon as it is found down while the work waits. A plain callback
        passes the result on: no task per call (a select or report makes one
        call)."""
        if self._down.is_set():
            raise Unavailable("the database is not answering; retry")
        work = submit()
        released: asyncio.Future[T] = work.get_loop().create_future()

        def finished(done: asyncio.Future[T]) -> None:
            if released.done():  # released when the database went down, or the caller left
                _ignore_result(done)
            elif done.cancelled():
                released.cancel()
            elif (error := done.exception()) is not None:
                released.set_exception(error)
            else:
                released.set_result(done.result())

        work.add_done_callback(finished)
        self._waiting.add(released)
        try:
            return await released
        finally:
            self._waiting.discard(released)


def _ignore_result(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as lost
