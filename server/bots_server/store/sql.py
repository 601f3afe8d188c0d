"""The store in SQLAlchemy Core, shared by the SQLite and PostgreSQL dialects.

Every method is one transaction (but for SQLite's uploads and deletes in
parts, sql_task_rows.py). What differs between the two databases goes
through the hook methods at the end of SqlBase (sql_base.py), implemented in
sqlite.py and postgresql.py; nothing here depends on either.

Database errors are translated in one place, sql_base.py: connection loss,
timeouts and a locked SQLite file become `Unavailable` (retryable);
constraint violations become domain errors.

SqlStore is one mixin per thing stored, over SqlBase (connections, error
translation, schema, tenant admission, dialect hooks):

- sql_experiments.py: experiments (create, copy, find, list, delete, usage);
- sql_tasks.py: tasks and the posterior state (load, features, checkpoints,
  step events, compaction);
- sql_task_rows.py: tasks rows written and removed in parts, where a write
  holds every other writer (SQLite);
- sql_batches.py: batches and reports, retirements and group shares;
- sql_statements.py: the statements built once, which dialects reuse;
- sql_rows.py: the row conversions these share.
"""

from __future__ import annotations

from bots_server.store.sql_batches import BatchesSql
from bots_server.store.sql_experiments import ExperimentsSql
from bots_server.store.sql_tasks import TasksSql


class SqlStore(ExperimentsSql, TasksSql, BatchesSql):
    """All SQL of the service, over an engine a dialect configured.

    `engine` is public for tests, benchmarks and tooling that read the tables
    directly; the core uses the Store methods only. `on_error(kind)` is
    called for every database error a method raises (kinds: see sql_base.error_kind).
    """
