"""Server settings: command-line flags, each with an environment variable."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    flag: str
    env: str
    default: str
    help: str


SETTINGS = (
    Setting("--db", "BOTS_DB", "sqlite:///bots.db", "database URL: sqlite:///FILE or postgresql+psycopg://USER@HOST/DB"),
    Setting("--listen", "BOTS_LISTEN", "127.0.0.1:50051", "gRPC address to listen on"),
    Setting("--checkpoint-every-steps", "BOTS_CHECKPOINT_EVERY_STEPS", "100", "write a checkpoint every N steps"),
    Setting("--checkpoint-every-seconds", "BOTS_CHECKPOINT_EVERY_SECONDS", "60", "and at least every T seconds"),
    Setting("--grace-seconds", "BOTS_GRACE_SECONDS", "20", "on SIGTERM, how long in-flight calls may finish"),
    Setting("--workers", "BOTS_WORKERS", "8", "threads for database and numpy work"),
    Setting("--log-level", "BOTS_LOG_LEVEL", "INFO", "DEBUG, INFO, WARNING or ERROR"),
    Setting("--log-format", "BOTS_LOG_FORMAT", "text", "text or json (one JSON object per line)"),
    Setting("--migrate", "BOTS_MIGRATE", "true", "upgrade the schema on start (true/false)"),
)


@dataclass(frozen=True)
class ServerSettings:
    db: str = "sqlite:///bots.db"
    listen: str = "127.0.0.1:50051"
    checkpoint_every_steps: int = 100
    checkpoint_every_seconds: float = 60.0
    grace_seconds: float = 20.0
    workers: int = 8
    log_level: str = "INFO"
    log_format: str = "text"
    migrate: bool = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for s in SETTINGS:
        default = os.environ.get(s.env, s.default)
        parser.add_argument(s.flag, default=default, help=f"{s.help} (env {s.env}; default {s.default})")


def from_args(args: argparse.Namespace) -> ServerSettings:
    migrate = str(args.migrate).lower()
    if migrate not in ("true", "false", "1", "0", "yes", "no"):
        raise SystemExit(f"--migrate / BOTS_MIGRATE = {args.migrate!r}: expected true or false")
    if args.log_format not in ("text", "json"):
        raise SystemExit(f"--log-format / BOTS_LOG_FORMAT = {args.log_format!r}: expected text or json")
    try:
        return ServerSettings(
            db=args.db,
            listen=args.listen,
            checkpoint_every_steps=int(args.checkpoint_every_steps),
            checkpoint_every_seconds=float(args.checkpoint_every_seconds),
            grace_seconds=float(args.grace_seconds),
            workers=int(args.workers),
            log_level=args.log_level.upper(),
            log_format=args.log_format,
            migrate=migrate in ("true", "1", "yes"),
        )
    except ValueError as e:
        raise SystemExit(f"bad setting: {e}") from e
