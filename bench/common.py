"""What the benchmarks share: the machine they ran on, percentiles, servers
and scratch databases."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"

if str(REPO) not in sys.path:  # `python bench/x.py` as well as `python -m bench.x`
    sys.path.insert(0, str(REPO))

# The benchmarks read a server's memory as the tests do: (VmRSS, VmHWM) in bytes.
from bots_server.testing.processes import rss_bytes as rss_bytes  # noqa: E402


def machine_info() -> dict[str, object]:
    """nproc, CPU model, RAM, versions and the load when the run started."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    info: dict[str, object] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "mem_gib": mem_gib,
        "loadavg_at_start": [round(x, 2) for x in load],
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
    }
    try:
        import grpc

        info["grpcio"] = grpc.__version__
    except ImportError:
        pass
    try:
        import sqlalchemy

        info["sqlalchemy"] = sqlalchemy.__version__
    except ImportError:
        pass
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
        info["git"] = commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def machine_line(info: dict[str, object]) -> str:
    return (
        f"{info['date']}: {info['nproc']} cores ({info['cpu']}), {info['mem_gib']} GiB RAM, "
        f"load at start {info['loadavg_at_start']}, Python {info['python']}, numpy {info['numpy']}, git {info.get('git')}"
    )


def percentiles(values_s: Sequence[float]) -> dict[str, float]:
    """p50 / p90 / p99 / max / mean in milliseconds (NaN when empty)."""
    if len(values_s) == 0:
        return {
            "n": 0,
            "p50": float("nan"),
            "p90": float("nan"),
            "p99": float("nan"),
            "max": float("nan"),
            "mean": float("nan"),
        }
    a = np.asarray(values_s, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "n": int(a.size),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(a.max()),
        "mean": float(a.mean()),
    }


def median_range(values: Sequence[float], digits: int = 1) -> str:
    """Repeated measurements as the docs' tables give them: `median (min-max)`."""
    return f"{float(np.median(values)):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def before_after(
    measures: Sequence[tuple[str, Callable[[dict[str, Any]], Iterable[float]]]],
    before: Mapping[str, list[dict[str, Any]]],
    after: Mapping[str, list[dict[str, Any]]],
) -> list[str]:
    """A before/after table: per backend (the keys of `before` and `after`,
    their runs the values) and measure (a label and the values one run
    gives), the median over every run's values (range, n)."""
    lines = ["| backend | measure | before: median (range) | after: median (range) |", "|---|---|---|---|"]
    for backend in dict.fromkeys([*before, *after]):
        for label, read in measures:
            cells = []
            for runs in (before.get(backend, []), after.get(backend, [])):
                values = [float(v) for r in runs for v in read(r)]
                cells.append(f"{median_range(values, 2)}, n={len(values)}" if values else "not measured")
            lines.append(f"| {backend} | {label.strip()} | {cells[0]} | {cells[1]} |")
    return lines


def write_json(path: Path, data: object, indent: int | None = 1) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=_json_default) + "\n")


def _json_default(value: object) -> object:
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def scratch_dir() -> str:
    """A temporary directory, on tmpfs when there is one (the simulator does
    not measure durability)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="bots-bench-", dir=base)


@contextmanager
def database(backend: str, directory: str | None = None) -> Iterator[str]:
    """A fresh, empty database URL on `backend` ("sqlite" or "postgresql"),
    removed afterwards. SQLite files go to `directory` (default: a temporary
    directory on disk, since durability is part of what perf measures)."""
    if backend == "sqlite":
        own = directory is None
        path = Path(directory or tempfile.mkdtemp(prefix="bots-bench-"))
        db = path / "bench.db"
        try:
            yield f"sqlite:///{db}"
        finally:
            if own:
                shutil.rmtree(path, ignore_errors=True)
            else:
                for leftover in path.glob("bench.db*"):  # the file, -wal and -shm
                    leftover.unlink(missing_ok=True)
    elif backend == "postgresql":
        from bots_server.testing.postgres import create_pg_database, drop_pg_database

        url = create_pg_database(prefix="bots_bench")
        try:
            yield url
        finally:
            drop_pg_database(url)
    else:
        raise ValueError(f"unknown backend {backend!r}: expected sqlite or postgresql")


def postgres_available() -> bool:
    from bots_server.testing.postgres import postgres_available as available

    return available()


def server_process(db_url: str, extra_args: Sequence[str] = (), processes: int = 1):  # -> ServerProcess
    """`bots-server serve` as a child process on a free loopback port
    (`processes` > 1: a supervisor of that many, PostgreSQL only)."""
    from bots_server.testing.processes import ServerProcess

    return ServerProcess(db_url, extra_args=list(extra_args), processes=processes)


def io_counters(pid: int) -> dict[str, int]:
    """/proc/PID/io: wchar (bytes given to write()), write_bytes (bytes sent to storage)."""
    out = {}
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        name, _, value = line.partition(":")
        out[name.strip()] = int(value)
    return out
