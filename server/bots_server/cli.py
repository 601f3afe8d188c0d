"""`bots-server`: run the service, migrate the schema, and small ops commands.

    bots-server serve [--db URL] [--listen HOST:PORT] ...
    bots-server migrate [--db URL] [--wait-seconds S] [--check]
    bots-server compact [--db URL] [--retention-steps N] [--experiment NAME]
    bots-server experiments list [--server HOST:PORT] [--tls | --tls-ca CA] [--tls-cert C --tls-key K]
    bots-server experiments show NAME [--server HOST:PORT] ...
    bots-server export NAME [--format csv|jsonl] [--output FILE] [--server HOST:PORT] ...
    bots-server token --name WHO [--tenant T] [--role reader|writer|tenant-admin|admin]
    bots-server tasks retire NAME [KEY ...] [--from-file FILE|-] [--server HOST:PORT] ...
    bots-server tasks reactivate NAME [KEY ...] [--from-file FILE|-] [--server HOST:PORT] ...
    bots-server groups list NAME [--server HOST:PORT] ...
    bots-server groups set NAME [GROUP=SHARE | GROUP=MIN:MAX ...] [--server HOST:PORT] ...

The ops commands read a bearer token from BOTS_TOKEN.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import dataclasses
import errno
import faulthandler
import json
import logging
import os
import signal
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import bots_client
from bots_server import __version__, logs, settings
from bots_server.store import DatabaseInUse, UnsupportedDatabase, open_store

DEFAULT_SERVER = "127.0.0.1:50051"
# The ops commands are run by a person at a terminal: a server that is down
# should be reported in seconds, not after the trainer's 60 s retry budget
# (which exists to ride through a server restart mid-training).
DEFAULT_RETRY_SECONDS = 5.0
# The exit status when standard output's reader went away (`export | head`):
# the shell's status of a command killed by SIGPIPE (cat, grep), 128 + 13.
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE
# Deadline of one list/show call; export streams a whole pool and keeps the
# client's bulk deadline.
DEFAULT_CALL_SECONDS = 10.0


def _serve(args: argparse.Namespace) -> int:
    from bots_server.core import allocator
    from bots_server.errors import Unavailable
    from bots_server.service.server import serve, usable_cores
    from bots_server.service.supervisor import SUPERVISED_ENV, Supervisor, process_count

    allocator.configure()
    # Until the server (or the supervisor) handles SIGHUP (re-read the
    # credentials), one must not kill it while it starts.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # `kill -USR1 <pid>` prints every thread's stack to stderr: how to see
    # where a server that does not answer (or does not stop) is waiting.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    config = settings.from_args(args)
    # A supervisor's processes share its stderr: each line must be one atomic write.
    shared = bool(os.environ.get(SUPERVISED_ENV))
    logs.configure(config.log_level, config.log_format, config.audit_log, config.log_queue_lines, shared)
    processes = process_count(config, usable_cores())
    try:
        if processes > 1:
            if config.migrate:
                # Each process migrates at its start: without the database
                # they would fail and be started again, forever.
                _ping(config.db)
            return Supervisor(config, processes, args.argv).run()
        asyncio.run(serve(config))
    except (Unavailable, UnsupportedDatabase) as e:
        # A server that cannot migrate at its start (a database missing or
        # unreachable) ends as `migrate` does: one line, not the driver's
        # chain of tracebacks. Without migrating it starts and waits.
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _ping(db: str) -> None:
    """Raise Unavailable unless the database at `db` answers."""
    store = open_store(db)
    try:
        store.ping()
    finally:
        store.close()


def _migrate(args: argparse.Namespace) -> int:
    """Upgrade the schema (or with --check only compare it), waiting up to
    --wait-seconds for the database: in Kubernetes the migrate job or init
    container may start before PostgreSQL accepts connections."""
    from bots_server.errors import Unavailable

    logs.configure("INFO", args.log_format)
    try:
        # On SQLite, never migrate a file a running server holds.
        store = open_store(args.db, exclusive=not args.check)
    except (DatabaseInUse, UnsupportedDatabase) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    deadline = time.monotonic() + args.wait_seconds
    try:
        while True:
            try:
                if args.check:
                    current, revisions, heads = store.schema_status()
                    if not current:
                        print(f"schema is at {revisions or 'nothing (empty database, or none yet)'}; the code needs {heads}")
                        return 3
                elif newer := store.migrate():
                    print(f"schema is at {newer}, newer than this code's migrations: left as it is; {SCHEMA_AHEAD}")
                    return 0
                break
            except Unavailable as e:
                if time.monotonic() >= deadline:
                    print(f"error: {e}", file=sys.stderr)
                    return 1
                print(f"waiting for the database: {e}", file=sys.stderr)
                time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
    finally:
        store.close()
    print("schema is at the latest revision")
    return 0


# What a server of an older release may do on a newer schema (docs/operations/upgrade-and-backup.md).
SCHEMA_AHEAD = "serve it only if the newer release's notes say its migrations were additive"


def _compact(args: argparse.Namespace) -> int:
    """Compact the event log of the database's experiments now, beside
    running servers or without them (store.compact clamps to each
    checkpoint and serializes with reports)."""
    from bots_server.core import tenancy
    from bots_server.core.checkpoints import compact_events
    from bots_server.errors import InvalidArgument, Unavailable

    if args.retention_steps < 1:
        print("error: --retention-steps must be >= 1", file=sys.stderr)
        return 1
    try:
        # As a server's administrator names it: "default/NAME" is NAME.
        stored = tenancy.resolve(tenancy.ANONYMOUS, args.experiment, "--experiment") if args.experiment else ""
        store = open_store(args.db)
    except (InvalidArgument, UnsupportedDatabase) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        # Read-only first: a mistyped --db must not become a new, empty database.
        current, revisions, heads = store.schema_status()
        if not current:
            print(
                f"error: the database at --db has no schema this code serves (it is at {revisions or 'nothing'}, "
                f"the code needs {heads}): a mistyped --db, or run `bots-server migrate` first",
                file=sys.stderr,
            )
            return 1
        if stored:
            found = store.find_experiment(stored)
            if found is None:
                print(f"error: experiment {args.experiment!r} not found", file=sys.stderr)
                return 1
            rows = [found]
        else:
            rows, after = [], ""
            while page := store.list_experiments(after, 1000):
                rows += page
                after = page[-1].name
        for row in rows:
            horizon, removed = compact_events(store, row.id, row.step - args.retention_steps)
            print(f"{row.name}: step {row.step}, events compacted through step {horizon}, {removed} values removed")
    except Unavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        store.close()
    return 0


def _connect(args: argparse.Namespace) -> bots_client.Client:
    """A client of the server the ops command names, with its TLS and token."""
    # The client's "not reachable, retrying" warning is for a trainer's long
    # retries; here the one line that ends a short retry says it (main).
    logging.getLogger("bots_client").setLevel(logging.ERROR)
    connection = bots_client.Connection(
        args.server, tls=args.tls, ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key, token=args.token
    )
    return connection.client(timeout=DEFAULT_CALL_SECONDS, retry_timeout=args.retry_seconds)


# What every command that calls a running server reads, shown in its --help.
CONNECTION_ENV = (
    "environment: BOTS_SERVER (the server, host:port; default 127.0.0.1:50051), BOTS_TOKEN (the bearer token, "
    "read from the environment only: flags show up in ps), BOTS_RETRY_SECONDS, BOTS_TLS, BOTS_TLS_CA, "
    "BOTS_CLIENT_CERT, BOTS_CLIENT_KEY; the flags above win over them"
)


def _connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = CONNECTION_ENV
    env = os.environ.get
    parser.add_argument(
        "--server", default=env("BOTS_SERVER", DEFAULT_SERVER), help=f"server address (env BOTS_SERVER; {DEFAULT_SERVER})"
    )
    retry_default = float(env("BOTS_RETRY_SECONDS", str(DEFAULT_RETRY_SECONDS)))
    parser.add_argument(
        "--retry-seconds", type=float, default=retry_default,
        help=f"retry an unreachable server this long (env BOTS_RETRY_SECONDS; default {DEFAULT_RETRY_SECONDS:g})",
    )  # fmt: skip
    parser.add_argument(
        "--tls", action="store_true", default=env("BOTS_TLS", "").lower() in ("1", "true", "yes"),
        help="TLS with the system's CA roots (env BOTS_TLS=1)",
    )  # fmt: skip
    parser.add_argument("--tls-ca", default=env("BOTS_TLS_CA", ""), help="PEM CA of the server's certificate (env BOTS_TLS_CA)")
    parser.add_argument(
        "--tls-cert", default=env("BOTS_CLIENT_CERT", ""), help="PEM client certificate, for mutual TLS (env BOTS_CLIENT_CERT)"
    )
    parser.add_argument("--tls-key", default=env("BOTS_CLIENT_KEY", ""), help="PEM key of --tls-cert (env BOTS_CLIENT_KEY)")
    # The token from the environment only: flags show up in `ps`.
    parser.set_defaults(token=env("BOTS_TOKEN", ""))


def _experiment_dict(e: bots_client.Experiment) -> dict[str, object]:
    d = dataclasses.asdict(e)
    d["create_time"] = e.create_time.isoformat()
    return d


def _list(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        experiments = client.list_experiments()
    print(f"{'NAME':<32} {'STRATEGY':<8} {'STEP':>8} {'TASKS':>10} {'OPEN':>5} CAPABILITY")
    for e in experiments:
        capability = "-" if e.capability is None else f"{e.capability:.4f}"
        print(f"{e.name:<32} {e.config.strategy:<8} {e.step:>8} {e.num_tasks:>10} {e.open_batches:>5} {capability}")
    return 0


def _show(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        print(json.dumps(_experiment_dict(client.get_experiment(args.name)), indent=2))
    return 0


def _export(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        # JSON lines carry each task's embedding too, when the experiment has them.
        embedded = args.format == "jsonl" and client.get_experiment(args.name).config.embedding_dim > 0
        snap = client.snapshot(args.name, include_features=embedded)
    if args.output == "-":
        _write_export(snap, args.format, sys.stdout)
        return 0
    _export_to_file(snap, args.format, args.output)
    print(f"wrote {len(snap.keys)} tasks of {args.name!r} at step {snap.step} to {args.output}", file=sys.stderr)
    return 0


def _export_to_file(snap: Any, fmt: str, output: str) -> None:
    """A regular file (or a new one) is written beside itself and renamed
    over itself once complete, with its mode kept (a new one: 0666 less the
    umask): a failed export (a full disk) leaves neither a cut file nor a
    good earlier export destroyed. A symlink's target is what is replaced.
    Anything else (a device, a FIFO, /dev/stdout), or a file in a folder
    this process may not write, is written through, as `>` would."""
    target = Path(os.path.realpath(output))
    if target.exists() and not target.is_file():
        with open(output, "w", newline="") as out:
            _write_export(snap, fmt, out)
        return
    try:
        part_file = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed below, by `with part_file`)
            "w", newline="", dir=target.parent, prefix=f".{target.name}.", suffix=".part", delete=False
        )
    except PermissionError:
        with open(output, "w", newline="") as out:
            _write_export(snap, fmt, out)
        return
    part = Path(part_file.name)
    try:
        with part_file as out:
            _write_export(snap, fmt, out)
            out.flush()
            os.fsync(out.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(part, stat.S_IMODE(target.stat().st_mode) if target.exists() else 0o666 & ~umask)
        os.replace(part, target)
    except OSError as e:
        raise OSError(e.errno, e.strerror, output) from None  # the file asked for, not the part
    finally:
        part.unlink(missing_ok=True)


def _write_export(snap: Any, fmt: str, out: IO[str]) -> None:
    """The snapshot's rows, one per task, as CSV or JSON lines (those with
    each task's embedding, when the snapshot has them)."""
    mean = snap.mean
    retired = snap.retired if snap.retired is not None else [False] * len(snap.keys)
    if fmt == "csv":
        writer = csv.writer(out)
        writer.writerow(["key", "alpha", "beta", "mean", "retired"])
        for i, key in enumerate(snap.keys):
            writer.writerow(
                [key, repr(float(snap.alpha[i])), repr(float(snap.beta[i])), repr(float(mean[i])), int(retired[i])]
            )
    else:
        for i, key in enumerate(snap.keys):
            row = {
                "key": key,
                "alpha": float(snap.alpha[i]),
                "beta": float(snap.beta[i]),
                "mean": float(mean[i]),
                "retired": bool(retired[i]),
            }
            if snap.embeddings is not None:
                row["embedding"] = snap.embeddings[i].tolist()  # float32 values, exact as doubles
            out.write(json.dumps(row) + "\n")


def _token(args: argparse.Namespace) -> int:
    """A new bearer token and the credentials-file entry that admits it."""
    from bots_server.core import tenancy
    from bots_server.errors import InvalidArgument
    from bots_server.service.credentials import hash_token, new_token

    try:
        role = tenancy.Role.parse(args.role)
        tenancy.check_tenant(args.tenant)
    except (ValueError, InvalidArgument) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    token = new_token()
    print(f"# The token of {args.name!r}: give it to them (BOTS_TOKEN); it is not stored anywhere.")
    print(token)
    print("# Add this to the credentials file; the server picks it up within seconds:")
    print("[[principals]]")
    print(f"name = {json.dumps(args.name)}")
    print(f"tenant = {json.dumps(args.tenant)}")
    print(f"role = {json.dumps(role.label)}")
    print(f'token_sha256 = "{hash_token(token)}"')
    return 0


def _task_keys(args: argparse.Namespace) -> list[str]:
    """The keys on the command line, then those of --from-file: one per line,
    blank lines and lines starting with # skipped; "-" reads standard input."""
    keys = list(args.keys)
    if args.from_file:
        with contextlib.nullcontext(sys.stdin) if args.from_file == "-" else open(args.from_file) as lines:
            keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return keys


def _retire(args: argparse.Namespace) -> int:
    keys = _task_keys(args)
    if not keys:
        print("error: no task keys given (as arguments or with --from-file)", file=sys.stderr)
        return 1
    with _connect(args) as client:
        if args.action == "retire":
            result = client.retire_tasks(args.name, keys)
        else:
            result = client.reactivate_tasks(args.name, keys)
    done = "retired" if args.action == "retire" else "reactivated"
    print(
        f"{done} {result.changed} of {len(keys)} tasks of {args.name!r} ({len(keys) - result.changed} already were); "
        f"{result.num_retired} of {result.num_tasks} tasks are retired"
    )
    return 0


def _print_groups(groups: list[bots_client.GroupInfo]) -> None:
    print(f"{'GROUP':<24} {'TASKS':>8} {'RETIRED':>8} {'SHARE':>11} {'NOW':>6} {'MEAN':>6} {'NEAR_TARGET':>11} INFORMATIVE")
    for g in groups:
        share = "-" if g.min_share is None else (
            f"{g.min_share:g}" if g.min_share == g.max_share else f"{g.min_share:g}:{g.max_share:g}"
        )  # fmt: skip
        now = "-" if g.adaptive_share is None else f"{g.adaptive_share:.3f}"
        name = g.name or "(none)"
        print(
            f"{name:<24} {g.num_tasks:>8} {g.num_retired:>8} {share:>11} {now:>6} {g.mean_success:>6.3f} "
            f"{g.near_target:>11.3f} {g.informative:.3f}"
        )


def _groups_list(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        _print_groups(client.list_groups(args.name))
    return 0


def _share(text: str) -> tuple[str, float | tuple[float, float]]:
    """GROUP=SHARE or GROUP=MIN:MAX."""
    group, sep, value = text.rpartition("=")
    if not sep or not group:
        raise argparse.ArgumentTypeError(f"expected GROUP=SHARE or GROUP=MIN:MAX, got {text!r}")
    try:
        low, colon, high = value.partition(":")
        return group, (float(low), float(high)) if colon else float(low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: shares are numbers in [0, 1]") from None


def _groups_set(args: argparse.Namespace) -> int:
    shares = dict(args.shares)
    if len(shares) != len(args.shares):
        print("error: a group is named more than once", file=sys.stderr)
        return 1
    with _connect(args) as client:
        _print_groups(client.set_group_shares(args.name, shares))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bots-server",
        description="BOTS selection service",
        epilog="serve, migrate and compact read BOTS_DB (the database URL; sqlite:///bots.db by default) and the "
        "BOTS_* variables their --help names. experiments, export, tasks and groups call a running server: "
        "BOTS_SERVER (host:port; default 127.0.0.1:50051) and BOTS_TOKEN (its bearer token, if it wants one), "
        "and the TLS variables of their --help.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the gRPC server")
    settings.add_arguments(serve)
    serve.set_defaults(run=_serve)

    migrate = commands.add_parser("migrate", help="create or upgrade the database schema, then exit")
    migrate.add_argument("--db", default=os.environ.get("BOTS_DB", "sqlite:///bots.db"), help="database URL (env BOTS_DB)")
    migrate.add_argument(
        "--wait-seconds",
        type=float,
        default=float(os.environ.get("BOTS_MIGRATE_WAIT_SECONDS", "0")),
        help="retry while the database is unreachable, up to this long (env BOTS_MIGRATE_WAIT_SECONDS; default 0)",
    )
    migrate.add_argument(
        "--check", action="store_true",
        help="change nothing (nor create a missing SQLite file); exit 3 if the schema is not at the latest revision",
    )  # fmt: skip
    migrate.add_argument(
        "--log-format", choices=("text", "json"), default=os.environ.get("BOTS_LOG_FORMAT", "text"),
        help="text or json (env BOTS_LOG_FORMAT)",
    )  # fmt: skip
    migrate.set_defaults(run=_migrate)

    compact = commands.add_parser(
        "compact", help="remove old events of the database's experiments now (servers also do it after checkpoints)"
    )
    compact.add_argument("--db", default=os.environ.get("BOTS_DB", "sqlite:///bots.db"), help="database URL (env BOTS_DB)")
    compact.add_argument(
        "--retention-steps", type=int,
        default=int(os.environ.get("BOTS_EVENT_RETENTION_STEPS", "10000") or 0),
        help="keep the events of this many steps before each experiment's current step (never past its checkpoint; "
        "env BOTS_EVENT_RETENTION_STEPS; default 10000)",
    )  # fmt: skip
    compact.add_argument(
        "--experiment", default="", help="only this experiment: NAME (tenant default) or TENANT/NAME"
    )
    compact.set_defaults(run=_compact)

    experiments = commands.add_parser("experiments", help="list or show experiments of a running server")
    sub = experiments.add_subparsers(dest="action", required=True)
    listing = sub.add_parser("list", help="one line per experiment: strategy, step, tasks, open batches, capability")
    listing.set_defaults(run=_list)
    show = sub.add_parser("show", help="an experiment's config and state, as JSON")
    show.add_argument("name", help="experiment")
    show.set_defaults(run=_show)
    for p in (listing, show):
        _connection_arguments(p)

    export = commands.add_parser("export", help="export an experiment's posterior to CSV or JSON lines")
    export.add_argument("name", help="experiment")
    export.add_argument("--format", choices=("csv", "jsonl"), default="csv", help="csv (default) or jsonl")
    export.add_argument("--output", default="-", help="file to write (default: standard output)")
    _connection_arguments(export)
    export.set_defaults(run=_export)

    tasks = commands.add_parser("tasks", help="retire or re-activate tasks of a running experiment")
    task_actions = tasks.add_subparsers(dest="action", required=True)
    for action, text in (
        ("retire", "never select these tasks again (their posterior is kept); all or nothing"),
        ("reactivate", "make retired tasks selectable again; all or nothing"),
    ):
        p = task_actions.add_parser(action, help=text)
        p.add_argument("name", help="experiment")
        p.add_argument("keys", nargs="*", help="task keys")
        p.add_argument("--from-file", default="", help="also the keys in this file, one per line ('-': standard input)")
        _connection_arguments(p)
        p.set_defaults(run=_retire)

    groups = commands.add_parser("groups", help="list an experiment's groups, or set their shares of each batch")
    group_actions = groups.add_subparsers(dest="action", required=True)
    group_list = group_actions.add_parser("list", help="groups with sizes, shares and posterior signals")
    group_list.add_argument("name", help="experiment")
    group_list.set_defaults(run=_groups_list)
    group_set = group_actions.add_parser(
        "set", help="replace the shares: GROUP=SHARE (fixed) or GROUP=MIN:MAX; none: no quotas; all or nothing"
    )
    group_set.add_argument("name", help="experiment")
    group_set.add_argument("shares", nargs="*", type=_share, help="GROUP=SHARE or GROUP=MIN:MAX")
    group_set.set_defaults(run=_groups_set)
    for p in (group_list, group_set):
        _connection_arguments(p)

    token = commands.add_parser(
        "token", help="make a bearer token and print it with its credentials-file entry (docs/security.md)",
        epilog="The one it is for passes the token as BOTS_TOKEN (the ops commands, bots_client.Connection.from_env).",
    )  # fmt: skip
    token.add_argument("--name", required=True, help="who the token is for (shown in audit lines)")
    token.add_argument("--tenant", default="default", help="the tenant (default: default)")
    token.add_argument("--role", default="writer", help="reader, writer, tenant-admin (every call on its own tenant) or admin (every tenant) (default: writer)")
    token.set_defaults(run=_token)
    return parser


def _one_line(message: str) -> str:
    return " ".join(message.split())


# Write errors of a full disk or quota (standard output on one).
_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # a supervisor starts its processes with them
    try:
        code = int(args.run(args))
        sys.stdout.flush()  # now, not at exit: a reader gone is handled below
        return code
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as `cat` does.
        # Python's recipe: stdout to devnull, or the flush at exit fails again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except OSError as e:
        # A file that cannot be read or written, a full disk under standard
        # output: one line, no traceback (and standard output not flushed
        # again at exit). Anything else stays a traceback.
        if e.filename is not None:
            print(f"error: {e.filename}: {e.strerror or e}", file=sys.stderr)
        elif e.errno in _FULL:
            print(f"error: cannot write standard output: {e.strerror}", file=sys.stderr)
        else:
            raise
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except bots_client.UnavailableError as e:
        # One line a person can act on; the gRPC detail (connection refused,
        # DNS failure, database down) stays at the end for the curious.
        server = getattr(args, "server", "?")
        print(
            f"error: server {server} unavailable after {args.retry_seconds:g} s of retries "
            f"(is it running? set --server or BOTS_SERVER): {_one_line(e.message)}",
            file=sys.stderr,
        )
        return 2
    except bots_client.DeadlineExceededError as e:
        # A host that drops packets instead of refusing the connection.
        print(f"error: server {args.server} did not answer in time: {_one_line(e.message)}", file=sys.stderr)
        return 2
    except bots_client.UnauthenticatedError as e:
        # The server's hint (send 'authorization' metadata) is for programs;
        # a person at a terminal sets BOTS_TOKEN.
        why = _one_line(e.message.partition(";")[0])
        print(f"error: {e.code.name}: {why}; set BOTS_TOKEN to a token {args.server} accepts", file=sys.stderr)
        return 1
    except bots_client.BotsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
