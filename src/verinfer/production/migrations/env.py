"""Alembic environment of the verification history: runs on the connection ``store.upgrade`` hands
it (``config.attributes["connection"]``), or on ``sqlalchemy.url`` for the alembic command line."""

from alembic import context
from sqlalchemy import create_engine

from verinfer.production.store import Base, database_url

config = context.config


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:  # `alembic -x` style use with a URL in the config (e.g. autogenerating a new revision)
    with create_engine(database_url(config.get_main_option("sqlalchemy.url"))).connect() as conn:
        _run(conn)
        conn.commit()
