"""Server settings: command-line flags, each with an environment variable.

Secrets (the bearer tokens) are read from the environment or a file only,
never from a flag: flags show up in `ps` and in the pod spec.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from bots_server import logs
from bots_server.core.priority import DEFAULT_BULK_SHARE
from bots_server.metric_labels import LABEL_MODES, MIN_KEY_CHARS, TENANT_LABEL_MODES
from bots_server.metrics_http import Access


@dataclass(frozen=True)
class Setting:
    flag: str  # "" for settings read from the environment only
    env: str
    default: str
    help: str
    shown_default: str = ""  # what --help says of a default computed from other settings


# Time a stop has after the grace period: the final checkpoints (a 1M-task
# pool's took 0.9-2.2 s in bench/checkpoint.py) and closing, with room to spare.
SHUTDOWN_AFTER_GRACE_SECONDS = 25.0

SETTINGS = (
    Setting(
        "--db", "BOTS_DB", "sqlite:///bots.db", "database URL: sqlite:///FILE or postgresql://USER@HOST/DB"
    ),
    Setting("--listen", "BOTS_LISTEN", "127.0.0.1:50051", "gRPC address to listen on"),
    # 9464, not Prometheus's own 9090: a Prometheus on the same host (or a
    # sidecar in the pod) must not take our port or we its. 9464 is the
    # OpenTelemetry Prometheus exporter's port, which this server never runs.
    Setting(
        "--metrics-listen",
        "BOTS_METRICS_LISTEN",
        "127.0.0.1:9464",
        "HOST:PORT of the Prometheus /metrics HTTP endpoint; empty: no endpoint",
    ),
    Setting(
        "--metrics-max-experiments",
        "BOTS_METRICS_MAX_EXPERIMENTS",
        "1000",
        "at start, publish step and pool-size gauges of up to this many experiments of the store (by name) "
        "before any is loaded; 0: only experiments this replica touches",
    ),
    Setting(
        "--metrics-labels",
        "BOTS_METRICS_LABELS",
        "auto",
        "how metrics label experiments and groups: names, or opaque (tenant/<HMAC of the name keyed by "
        "--metrics-label-key-file>) so that the metrics show no tenant's names and confirm none a scraper guesses; "
        "auto: opaque with a credentials file, else names",
    ),
    Setting(
        "--metrics-tenant-labels",
        "BOTS_METRICS_TENANT_LABELS",
        "names",
        "names, or opaque: tenants appear in the metrics as t-<HMAC of the tenant> (with opaque --metrics-labels)",
    ),
    Setting(
        "--metrics-label-key-file",
        "BOTS_METRICS_LABEL_KEY_FILE",
        "",
        "file holding the secret (16 characters or more) that keys the opaque labels; the same key on every "
        "replica and after restarts gives the same labels; none (and no BOTS_METRICS_LABEL_KEY): a key drawn "
        "at start",
    ),
    Setting(
        "--metrics-token-file",
        "BOTS_METRICS_TOKEN_FILE",
        "",
        "file of bearer tokens, one per line: /metrics answers only a request that sends one "
        "(Authorization: Bearer <token>), and 401 to any other",
    ),
    Setting(
        "--metrics-tls-cert",
        "BOTS_METRICS_TLS_CERT",
        "",
        "PEM certificate (chain) of the /metrics endpoint; with --metrics-tls-key: serve it over HTTPS only",
    ),
    Setting("--metrics-tls-key", "BOTS_METRICS_TLS_KEY", "", "PEM private key of --metrics-tls-cert"),
    Setting(
        "--metrics-tls-client-ca",
        "BOTS_METRICS_TLS_CLIENT_CA",
        "",
        "PEM CA certificates: scrapers must present a client certificate they signed",
    ),
    Setting("--checkpoint-every-steps", "BOTS_CHECKPOINT_EVERY_STEPS", "100", "write a checkpoint every N steps"),
    Setting("--checkpoint-every-seconds", "BOTS_CHECKPOINT_EVERY_SECONDS", "60", "and at least every T seconds"),
    Setting(
        "--event-retention-steps",
        "BOTS_EVENT_RETENTION_STEPS",
        "10000",
        "after each checkpoint, remove the outcomes and batch tasks of steps more than this many steps before it "
        "(bounded storage; docs/design.md); 0: keep every event",
    ),
    Setting("--grace-seconds", "BOTS_GRACE_SECONDS", "20", "on SIGTERM, how long in-flight calls may finish"),
    Setting(
        "--shutdown-seconds",
        "BOTS_SHUTDOWN_SECONDS",
        "",
        "on SIGTERM, exit after this long at most (grace, final checkpoints, closing), with exit code 3 and every "
        "thread's stack logged if it was not done; more than --grace-seconds",
        shown_default=f"--grace-seconds + {SHUTDOWN_AFTER_GRACE_SECONDS:g}",
    ),
    Setting("--workers", "BOTS_WORKERS", "8", "threads for database and numpy work"),
    Setting(
        "--processes",
        "BOTS_PROCESSES",
        "0",
        "server processes behind the one --listen address (PostgreSQL only; each uses a core); 0: the CPUs this "
        "container may use on PostgreSQL, 1 on SQLite",
    ),
    Setting(
        "--process-stall-seconds",
        "BOTS_PROCESS_STALL_SECONDS",
        "30",
        "with --processes above 1: a server process whose event loop has not run for this long is killed (its "
        "threads' stacks logged) and started again; 0: never, else at least 3",
    ),
    Setting(
        "--database-timeout-seconds",
        "BOTS_DATABASE_TIMEOUT_SECONDS",
        "5",
        "a database that does not answer a ping this long (checked every second) is down: readiness turns "
        "NOT_SERVING and calls answer UNAVAILABLE until it answers again",
    ),
    Setting("--log-level", "BOTS_LOG_LEVEL", "INFO", "DEBUG, INFO, WARNING or ERROR"),
    Setting("--log-format", "BOTS_LOG_FORMAT", "text", "text or json (one JSON object per line)"),
    Setting(
        "--log-queue-lines",
        "BOTS_LOG_QUEUE_LINES",
        str(logs.QUEUE_LINES),
        "log lines that may wait for a slow reader of stderr (a log shipper behind) while calls go on; past that, "
        "new lines are dropped and counted (bots_log_lines_dropped_total) and a line says how many",
    ),
    Setting("--migrate", "BOTS_MIGRATE", "true", "upgrade the schema on start (true/false)"),
    Setting("--tls-cert", "BOTS_TLS_CERT", "", "PEM certificate (chain) of the server; with --tls-key: serve TLS only"),
    Setting("--tls-key", "BOTS_TLS_KEY", "", "PEM private key of --tls-cert"),
    Setting(
        "--tls-client-ca",
        "BOTS_TLS_CLIENT_CA",
        "",
        "PEM CA certificates: clients must present a certificate they signed (mutual TLS)",
    ),
    Setting(
        "--health-listen",
        "BOTS_HEALTH_LISTEN",
        "",
        "HOST:PORT of a plaintext port serving only the gRPC health service (for probes when the main port is TLS)",
    ),
    Setting(
        "--credentials-file",
        "BOTS_CREDENTIALS_FILE",
        "",
        "TOML file of principals (tenant, role, hashed token or certificate identity) and tenant quotas; "
        "re-read when it changes and on SIGHUP (docs/security.md)",
    ),
    Setting(
        "--max-experiments-per-tenant",
        "BOTS_MAX_EXPERIMENTS_PER_TENANT",
        "1000",
        "quota: experiments one tenant may hold (0: no limit; the credentials file may set it per tenant)",
    ),
    Setting(
        "--max-tasks-per-experiment",
        "BOTS_MAX_TASKS_PER_EXPERIMENT",
        "2000000",
        "quota: tasks one experiment may hold (0: no limit)",
    ),
    Setting(
        "--max-tasks-per-tenant",
        "BOTS_MAX_TASKS_PER_TENANT",
        "20000000",
        "quota: tasks all of one tenant's experiments may hold together (0: no limit)",
    ),
    Setting(
        "--max-stream-tasks",
        "BOTS_MAX_STREAM_TASKS",
        "1000000",
        "tasks one AddTasks or RestoreExperiment stream may carry",
    ),
    Setting("--max-stream-mb", "BOTS_MAX_STREAM_MB", "256", "megabytes one AddTasks or RestoreExperiment stream may carry"),
    Setting(
        "--stream-idle-seconds",
        "BOTS_STREAM_IDLE_SECONDS",
        "60",
        "an AddTasks or RestoreExperiment stream that sends no task this long is ended (RESOURCE_EXHAUSTED) and the "
        "memory held for it freed",
    ),
    Setting(
        "--memory-budget-mb",
        "BOTS_MEMORY_BUDGET_MB",
        "1024",
        "memory for experiments held in memory: over it, idle ones are dropped and rebuilt from the database "
        "on their next call (0: no budget)",
    ),
    Setting(
        "--inflight-budget-mb",
        "BOTS_INFLIGHT_BUDGET_MB",
        "768",
        "memory all calls together may hold at once while they buffer (AddTasks, RestoreExperiment) or stream "
        "out (Snapshot); a call beyond it waits up to 5 s, then gets RESOURCE_EXHAUSTED (0: no bound)",
    ),
    Setting(
        "--tenant-inflight-budget-mb",
        "BOTS_TENANT_INFLIGHT_BUDGET_MB",
        "768",
        "the same bound for each tenant's calls; below --inflight-budget-mb on a shared server, so that one "
        "tenant cannot hold all of it (0: no bound)",
    ),
    Setting(
        "--tenant-bulk-calls",
        "BOTS_TENANT_BULK_CALLS",
        "1",
        "how many of one tenant's bulk calls (AddTasks, RestoreExperiment, Snapshot) each server process runs at "
        "once; the rest queue in arrival order, so that one tenant's flood takes one worker, not all of them "
        "(0: no bound)",
    ),
    Setting(
        "--bulk-share",
        "BOTS_BULK_SHARE",
        "0.2",
        "the least share of the time bulk calls (uploads, restores, snapshots) keep while selects and reports are "
        "in flight, which they otherwise give way to; lower: trainers' latency nearer to their latency alone, "
        "slower uploads meanwhile (in (0, 1]; 1: no giving way)",
    ),
    Setting(
        "--audit-log",
        "BOTS_AUDIT_LOG",
        "all",
        "audit lines (INFO, with the principal): all, experiments (no line per training step) or off",
    ),
    Setting(
        "--otlp-endpoint",
        "BOTS_OTLP_ENDPOINT",
        "",
        "OpenTelemetry collector (OTLP/gRPC, e.g. http://otel-collector:4317): trace every call and its database calls "
        "(needs the tracing extra)",
    ),
    Setting(
        "--auth-tokens-file",
        "BOTS_AUTH_TOKENS_FILE",
        "",
        "file of bearer tokens, one per line, each an admin of the default tenant; callers must send one "
        "(health and reflection stay open)",
    ),
)

# Read from the environment only (see the module docstring).
ENV_ONLY = (
    Setting(
        "",
        "BOTS_AUTH_TOKENS",
        "",
        "comma-separated bearer tokens; with BOTS_AUTH_TOKENS_FILE, the union; none: no authentication",
    ),
    Setting(
        "",
        "BOTS_METRICS_LABEL_KEY",
        "",
        "the secret that keys the opaque metrics labels (instead of --metrics-label-key-file)",
    ),
    Setting(
        "",
        "BOTS_METRICS_TOKEN",
        "",
        "comma-separated bearer tokens /metrics accepts; with BOTS_METRICS_TOKEN_FILE, the union",
    ),
)


@dataclass(frozen=True)
class ServerSettings:
    db: str = "sqlite:///bots.db"
    listen: str = "127.0.0.1:50051"
    metrics_listen: str = "127.0.0.1:9464"
    metrics_max_experiments: int = 1000
    metrics_labels: str = "auto"
    metrics_tenant_labels: str = "names"
    metrics_label_key: str = ""  # a secret: from a file or the environment only
    metrics_tokens: frozenset[str] = frozenset()
    metrics_tls_cert: str = ""
    metrics_tls_key: str = ""
    metrics_tls_client_ca: str = ""
    checkpoint_every_steps: int = 100
    checkpoint_every_seconds: float = 60.0
    event_retention_steps: int = 10_000
    grace_seconds: float = 20.0
    shutdown_seconds: float = 45.0
    workers: int = 8
    processes: int = 1
    process_stall_seconds: float = 30.0
    database_timeout_seconds: float = 5.0
    log_level: str = "INFO"
    log_format: str = "text"
    log_queue_lines: int = logs.QUEUE_LINES
    migrate: bool = True
    auth_tokens: frozenset[str] = frozenset()
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    health_listen: str = ""
    credentials_file: str = ""
    max_experiments_per_tenant: int = 1000
    max_tasks_per_experiment: int = 2_000_000
    max_tasks_per_tenant: int = 20_000_000
    max_stream_tasks: int = 1_000_000
    max_stream_mb: float = 256.0
    stream_idle_seconds: float = 60.0
    memory_budget_mb: float = 1024.0
    inflight_budget_mb: float = 768.0
    tenant_inflight_budget_mb: float = 768.0
    tenant_bulk_calls: int = 1
    bulk_share: float = DEFAULT_BULK_SHARE
    audit_log: str = "all"

    otlp_endpoint: str = ""

    def __post_init__(self) -> None:
        if not self.shutdown_seconds > self.grace_seconds:
            raise ValueError(
                f"--shutdown-seconds = {self.shutdown_seconds:g} must be more than "
                f"--grace-seconds = {self.grace_seconds:g}: the stop's limit includes the grace"
            )

    @property
    def auth(self) -> bool:
        return bool(self.auth_tokens or self.credentials_file)

    @property
    def metrics_access(self) -> Access:
        return Access(self.metrics_tokens, self.metrics_tls_cert, self.metrics_tls_key, self.metrics_tls_client_ca)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for s in SETTINGS:
        default = os.environ.get(s.env, s.default)
        shown = s.shown_default or repr(s.default)
        parser.add_argument(s.flag, default=default, help=f"{s.help} (env {s.env}; default {shown})")


def split_host_port(address: str, what: str) -> tuple[str, int]:
    """'HOST:PORT', '[V6]:PORT' or ':PORT' (all interfaces) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise SystemExit(f"{what} = {address!r}: expected HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def auth_tokens(env_value: str, file: str, what: str = "--auth-tokens-file / BOTS_AUTH_TOKENS_FILE") -> frozenset[str]:
    tokens = {t.strip() for t in env_value.split(",")}
    if file:
        try:
            with open(file, encoding="utf-8") as f:
                tokens |= {line.strip() for line in f if not line.lstrip().startswith("#")}
        except OSError as e:
            raise SystemExit(f"{what} = {file!r}: {e.strerror}") from e
    tokens.discard("")
    return frozenset(tokens)


def metrics_label_key(env_value: str, file: str) -> str:
    """The opaque labels' key: the file's content (stripped), else the
    environment's; empty if neither is set."""
    key = env_value.strip()
    if file:
        try:
            with open(file, encoding="utf-8") as f:
                key = f.read().strip()
        except OSError as e:
            raise SystemExit(f"--metrics-label-key-file / BOTS_METRICS_LABEL_KEY_FILE = {file!r}: {e.strerror}") from e
    if key and len(key) < MIN_KEY_CHARS:
        raise SystemExit(
            f"the metrics label key (--metrics-label-key-file / BOTS_METRICS_LABEL_KEY) has {len(key)} characters; "
            f"at least {MIN_KEY_CHARS} are needed (e.g. `openssl rand -hex 32`)"
        )
    return key


def _count(text: str, what: str, zero: bool = True) -> int:
    value = int(text)
    if value < (0 if zero else 1):
        raise ValueError(f"{what} = {text!r} must be {'>= 0' if zero else '>= 1'}")
    return value


def _share(text: str, what: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{what} = {text!r} must be in (0, 1]")
    return value


def _amount(text: str, what: str, zero: bool = True) -> float:
    value = float(text)
    if not value >= (0 if zero else 1e-6):  # also NaN
        raise ValueError(f"{what} = {text!r} must be {'>= 0' if zero else '> 0'}")
    return value


# A process touches its heartbeat every second (service/supervisor.py): a
# shorter limit would kill processes that are only a little late.
MIN_PROCESS_STALL_SECONDS = 3.0


def _stall_seconds(text: str) -> float:
    value = _amount(text, "--process-stall-seconds")
    if 0 < value < MIN_PROCESS_STALL_SECONDS:
        raise ValueError(
            f"--process-stall-seconds = {text!r} must be 0 (never) or at least {MIN_PROCESS_STALL_SECONDS:g} "
            "(three heartbeats)"
        )
    return value


def _shutdown_seconds(args: argparse.Namespace) -> float:
    if not str(args.shutdown_seconds).strip():
        return float(args.grace_seconds) + SHUTDOWN_AFTER_GRACE_SECONDS
    return _amount(args.shutdown_seconds, "--shutdown-seconds", zero=False)


def from_args(args: argparse.Namespace) -> ServerSettings:
    migrate = str(args.migrate).lower()
    if migrate not in ("true", "false", "1", "0", "yes", "no"):
        raise SystemExit(f"--migrate / BOTS_MIGRATE = {args.migrate!r}: expected true or false")
    if args.log_format not in ("text", "json"):
        raise SystemExit(f"--log-format / BOTS_LOG_FORMAT = {args.log_format!r}: expected text or json")
    if args.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise SystemExit(f"--log-level / BOTS_LOG_LEVEL = {args.log_level!r}: expected DEBUG, INFO, WARNING or ERROR")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("--tls-cert and --tls-key (BOTS_TLS_CERT, BOTS_TLS_KEY): set both or neither")
    if args.tls_client_ca and not args.tls_cert:
        raise SystemExit("--tls-client-ca (BOTS_TLS_CLIENT_CA) needs --tls-cert and --tls-key")
    if args.audit_log not in logs.AUDIT_LEVELS:
        raise SystemExit(f"--audit-log / BOTS_AUDIT_LOG = {args.audit_log!r}: expected one of {', '.join(logs.AUDIT_LEVELS)}")
    if args.metrics_labels not in LABEL_MODES:
        raise SystemExit(
            f"--metrics-labels / BOTS_METRICS_LABELS = {args.metrics_labels!r}: expected one of {', '.join(LABEL_MODES)}"
        )
    if args.metrics_tenant_labels not in TENANT_LABEL_MODES:
        raise SystemExit(
            f"--metrics-tenant-labels / BOTS_METRICS_TENANT_LABELS = {args.metrics_tenant_labels!r}: expected one of "
            f"{', '.join(TENANT_LABEL_MODES)}"
        )
    if args.metrics_tenant_labels == "opaque" and args.metrics_labels == "names":
        raise SystemExit(
            "--metrics-tenant-labels opaque needs opaque experiment labels (--metrics-labels opaque or auto): "
            "an experiment's name holds its tenant's"
        )
    if bool(args.metrics_tls_cert) != bool(args.metrics_tls_key):
        raise SystemExit(
            "--metrics-tls-cert and --metrics-tls-key (BOTS_METRICS_TLS_CERT, BOTS_METRICS_TLS_KEY): set both or neither"
        )
    if args.metrics_tls_client_ca and not args.metrics_tls_cert:
        raise SystemExit(
            "--metrics-tls-client-ca (BOTS_METRICS_TLS_CLIENT_CA) needs --metrics-tls-cert and --metrics-tls-key"
        )
    if args.health_listen.strip():
        split_host_port(args.health_listen.strip(), "--health-listen / BOTS_HEALTH_LISTEN")
    metrics_listen = args.metrics_listen.strip()
    if metrics_listen:
        split_host_port(metrics_listen, "--metrics-listen / BOTS_METRICS_LISTEN")
    try:
        return ServerSettings(
            db=args.db,
            listen=args.listen,
            metrics_listen=metrics_listen,
            metrics_max_experiments=int(args.metrics_max_experiments),
            metrics_labels=args.metrics_labels,
            metrics_tenant_labels=args.metrics_tenant_labels,
            metrics_label_key=metrics_label_key(
                os.environ.get("BOTS_METRICS_LABEL_KEY", ""), args.metrics_label_key_file
            ),
            metrics_tokens=auth_tokens(
                os.environ.get("BOTS_METRICS_TOKEN", ""),
                args.metrics_token_file,
                "--metrics-token-file / BOTS_METRICS_TOKEN_FILE",
            ),
            metrics_tls_cert=args.metrics_tls_cert,
            metrics_tls_key=args.metrics_tls_key,
            metrics_tls_client_ca=args.metrics_tls_client_ca,
            checkpoint_every_steps=int(args.checkpoint_every_steps),
            checkpoint_every_seconds=float(args.checkpoint_every_seconds),
            event_retention_steps=_count(args.event_retention_steps, "--event-retention-steps"),
            grace_seconds=_amount(args.grace_seconds, "--grace-seconds"),
            shutdown_seconds=_shutdown_seconds(args),
            workers=int(args.workers),
            processes=_count(args.processes, "--processes"),
            process_stall_seconds=_stall_seconds(args.process_stall_seconds),
            database_timeout_seconds=float(args.database_timeout_seconds),
            log_level=args.log_level.upper(),
            log_format=args.log_format,
            log_queue_lines=_count(args.log_queue_lines, "--log-queue-lines", zero=False),
            migrate=migrate in ("true", "1", "yes"),
            auth_tokens=auth_tokens(os.environ.get("BOTS_AUTH_TOKENS", ""), args.auth_tokens_file),
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            health_listen=args.health_listen.strip(),
            credentials_file=args.credentials_file,
            max_experiments_per_tenant=_count(args.max_experiments_per_tenant, "--max-experiments-per-tenant"),
            max_tasks_per_experiment=_count(args.max_tasks_per_experiment, "--max-tasks-per-experiment"),
            max_tasks_per_tenant=_count(args.max_tasks_per_tenant, "--max-tasks-per-tenant"),
            max_stream_tasks=_count(args.max_stream_tasks, "--max-stream-tasks", zero=False),
            max_stream_mb=_amount(args.max_stream_mb, "--max-stream-mb", zero=False),
            stream_idle_seconds=_amount(args.stream_idle_seconds, "--stream-idle-seconds", zero=False),
            memory_budget_mb=_amount(args.memory_budget_mb, "--memory-budget-mb"),
            inflight_budget_mb=_amount(args.inflight_budget_mb, "--inflight-budget-mb"),
            tenant_inflight_budget_mb=_amount(args.tenant_inflight_budget_mb, "--tenant-inflight-budget-mb"),
            tenant_bulk_calls=_count(args.tenant_bulk_calls, "--tenant-bulk-calls"),
            bulk_share=_share(args.bulk_share, "--bulk-share"),
            audit_log=args.audit_log,
            otlp_endpoint=args.otlp_endpoint.strip(),
        )
    except ValueError as e:
        raise SystemExit(f"bad setting: {e}") from e
