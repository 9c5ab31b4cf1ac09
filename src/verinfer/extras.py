"""Optional parts of the install (``pyproject.toml``'s extras): what a command needs beyond the demo's
dependencies, and the one-line error that names the extra to install when it is missing.

The quick start installs the core only (issue #31: ``ray[data]`` as a hard dependency made a 2.3 GB
venv that took ten minutes to install, for one option of one command).
"""

from __future__ import annotations

import importlib
from types import ModuleType

# extra -> the modules it provides (the first one missing is named in the error)
EXTRAS: dict[str, tuple[str, ...]] = {
    "ray": ("ray", "ray.data"),
    "production": ("sqlalchemy", "alembic", "prometheus_client", "httptools"),  # and psycopg, for postgresql:// only
}


class MissingExtra(ImportError):
    """A command or option needs an optional extra that is not installed."""


def message(feature: str, extra: str) -> str:
    return f"{feature} needs the {extra!r} extra: pip install -e '.[{extra}]'"


def require(extra: str, feature: str, only: tuple[str, ...] | None = None) -> list[ModuleType]:
    """Import the modules of ``extra`` (``EXTRAS``; ``only`` those of them ``feature`` uses) for
    ``feature`` (the command or option that needs them, as a user types it), or raise ``MissingExtra``
    saying which extra to install."""
    modules = []
    for name in EXTRAS[extra] if only is None else [n for n in EXTRAS[extra] if n in only]:
        try:
            modules.append(importlib.import_module(name))
        except ImportError as exc:
            raise MissingExtra(message(feature, extra), name=name) from exc
    return modules
