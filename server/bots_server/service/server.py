"""Server lifecycle: build, serve, and shut down gracefully on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from bots_client._proto import bots_pb2, bots_pb2_grpc
from bots_server.core.selector import CheckpointPolicy, SelectorService
from bots_server.errors import Unavailable
from bots_server.service.servicer import TaskSelectorServicer
from bots_server.settings import ServerSettings
from bots_server.store import Store

log = logging.getLogger(__name__)

SERVICE_NAME = bots_pb2.DESCRIPTOR.services_by_name["TaskSelector"].full_name
# Readiness is reported for the service name (it follows the database);
# the empty name is liveness (serving while the process runs).
READINESS_SERVICE = SERVICE_NAME
DB_CHECK_INTERVAL_S = 5.0


class BotsServer:
    """A running server. `port` is the bound port (useful with port 0)."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.store = Store(settings.db)
        self.selector = SelectorService(
            self.store,
            checkpoint_policy=CheckpointPolicy(settings.checkpoint_every_steps, settings.checkpoint_every_seconds),
            max_workers=settings.workers,
        )
        self.health = HealthServicer()
        self.server = grpc.aio.server()
        bots_pb2_grpc.add_TaskSelectorServicer_to_server(TaskSelectorServicer(self.selector), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )
        self.port = self.server.add_insecure_port(settings.listen)
        if self.port == 0:
            raise SystemExit(f"cannot listen on {settings.listen}")
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        if self.settings.migrate:
            await asyncio.to_thread(self.store.migrate)
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._check_database()
        self._tasks = [
            asyncio.create_task(self.selector.run_checkpoints(), name="checkpoints"),
            asyncio.create_task(self._watch_database(), name="database-health"),
        ]
        log.info("serving", extra={"listen": self.settings.listen, "port": self.port, "db": _redact(self.settings.db)})

    async def _check_database(self) -> None:
        try:
            await asyncio.to_thread(self.store.ping)
        except Unavailable as e:
            log.warning("database unreachable; not ready", extra={"error": str(e)})
            status = health_pb2.HealthCheckResponse.NOT_SERVING
        else:
            status = health_pb2.HealthCheckResponse.SERVING
        await self.health.set(READINESS_SERVICE, status)

    async def _watch_database(self) -> None:
        while True:
            await asyncio.sleep(DB_CHECK_INTERVAL_S)
            await self._check_database()

    async def stop(self) -> None:
        """Stop accepting calls, let in-flight ones finish, checkpoint, close."""
        log.info("shutting down", extra={"grace_seconds": self.settings.grace_seconds})
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.settings.grace_seconds)
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.selector.close()
        self.store.close()
        log.info("stopped")


def _redact(url: str) -> str:
    """The database URL without its password, for logs."""
    from sqlalchemy import make_url

    return make_url(url).render_as_string(hide_password=True)


async def serve(settings: ServerSettings) -> None:
    server = BotsServer(settings)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()
