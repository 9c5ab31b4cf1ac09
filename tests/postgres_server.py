"""A real PostgreSQL server for the store and monitor tests.

``VERINFER_TEST_POSTGRES_URL`` (e.g. ``postgresql://postgres@127.0.0.1:5432/postgres``) names a
running server; unset, a throwaway one is started here (initdb + pg_ctl on a free port in a
temporary directory, as the ``postgres`` user when running as root: PostgreSQL refuses root).
Each test gets its own fresh database on it. Without a server the tests skip, except under
``CI=true``, where a missing PostgreSQL is a failure (``.ci/run`` installs Debian's package).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid

import pytest

from tests.audit_servers import free_port


def _binaries() -> str | None:
    """The directory holding initdb and pg_ctl: PATH first, then Debian's versioned directories."""
    found = shutil.which("pg_ctl")
    if found and shutil.which("initdb"):
        return os.path.dirname(os.path.realpath(found))
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.path.exists(f"{d}/pg_ctl") and os.path.exists(f"{d}/initdb"):
            return d
    return None


def _missing(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"PostgreSQL is required in CI: {reason}")
    pytest.skip(reason)


def _as_postgres(argv: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


@pytest.fixture(scope="session")
def postgres_server():
    """Base URL of a PostgreSQL server (the ``postgres`` database), given or started for the session."""
    url = os.environ.get("VERINFER_TEST_POSTGRES_URL")
    if url:
        yield url
        return
    bindir = _binaries()
    if bindir is None:
        _missing("no PostgreSQL binaries (initdb, pg_ctl) and VERINFER_TEST_POSTGRES_URL is unset")
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        _missing("running as root without runuser to start PostgreSQL as the postgres user")
    root = tempfile.mkdtemp(prefix="verinfer-pg-")
    data = os.path.join(root, "data")
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    port = free_port()
    run = dict(check=True, capture_output=True, text=True, timeout=120)
    try:
        subprocess.run(_as_postgres([f"{bindir}/initdb", "-D", data, "-A", "trust", "-U", "postgres", "-E", "UTF8"]),
                       **run)
        subprocess.run(_as_postgres([f"{bindir}/pg_ctl", "-D", data, "-l", f"{root}/log", "-w", "-t", "60", "-o",
                                     f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off "
                                     "-c max_connections=100", "start"]), **run)
    except (subprocess.CalledProcessError, OSError) as exc:
        _missing(f"could not start a throwaway PostgreSQL: {getattr(exc, 'stderr', '') or exc}")
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(_as_postgres([f"{bindir}/pg_ctl", "-D", data, "-m", "immediate", "-w", "stop"]),
                       capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


def fresh_database(server_url: str) -> str:
    """A new empty database on the server; its URL."""
    import psycopg

    name = f"verinfer_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return server_url.rsplit("/", 1)[0] + f"/{name}"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """Each test once against SQLite (a file) and once against PostgreSQL (a fresh database)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/history.db"
    return fresh_database(request.getfixturevalue("postgres_server"))
