"""Alembic environment: run by bots_server.store.revisions.upgrade with an open connection,
or by the alembic CLI with `-x url=...` (for writing new revisions)."""

from alembic import context
from sqlalchemy import create_engine

from bots_server.store.schema import metadata

config = context.config
connection = config.attributes.get("connection")

if connection is not None:
    context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    url = context.get_x_argument(as_dictionary=True)["url"]
    with create_engine(url).begin() as conn:
        context.configure(connection=conn, target_metadata=metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
