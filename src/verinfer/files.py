"""The output-file policy every command follows: atomic writes, outputs never equal to inputs,
default names that keep the whole stem, and I/O errors that name the file.

A result file is written under a temporary name in the same directory, flushed and fsync'd,
then renamed over the destination (``os.replace`` is atomic on POSIX) and the directory fsync'd
(so the rename itself survives a power loss), so a crash or a full disk leaves the previous file
intact and never a truncated one.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
from pathlib import Path
from typing import Iterable, Iterator


class OutputError(ValueError):
    """An output path that would destroy an input, or an output that cannot be written."""


def fsync_directory(directory: str | Path) -> None:
    """Make a rename or a new file in ``directory`` durable (POSIX: fsync the directory itself)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | Path, durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` atomically
    (``durable``: the file and the rename fsync'd first and after).

    On any error the temporary file is removed, the destination is untouched, and an ``OSError``
    is re-raised as an ``OutputError`` naming the destination.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # the pid tells a live writer from a killed one
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        if durable and tmp.exists():
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
        if durable:
            fsync_directory(path.parent)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write ({exc.strerror or exc})") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def write_atomic(path: str | Path, data: str | bytes, durable: bool = True) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` by temporary file and rename (``atomic_path``)."""
    path = Path(path)
    with atomic_path(path, durable) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def derived_path(source: str | Path, suffix: str, keep_extension: bool = False) -> Path:
    """The default output beside ``source``: its whole name, extension dropped (unless
    ``keep_extension``), plus ``suffix``.

    ``run.v1.jsonl`` -> ``run.v1.scores.parquet``, so two inputs never share an output.
    """
    source = Path(source)
    stem = source.name[: -len(source.suffix)] if source.suffix and not keep_extension else source.name
    return source.with_name(stem + suffix)


def fresh_path(path: str | Path, directory: bool = False) -> Path:
    """The first of ``path``, ``path-2``, ``path-3``, ... (``name-2.json`` for a file) that nothing
    occupies, claimed at once (the directory made, or an empty file created exclusively) so that two
    runs never get the same one: a default output never overwrites another run's results, nor
    anything committed (issue #31, item 5)."""
    path = Path(path)
    stem, suffix = (path.name, "") if directory or not path.suffix else (path.name[: -len(path.suffix)], path.suffix)
    for i in itertools.count(1):
        candidate = path if i == 1 else path.with_name(f"{stem}-{i}{suffix}")
        try:
            if directory:
                candidate.mkdir(parents=True)
            else:
                candidate.parent.mkdir(parents=True, exist_ok=True)
                os.close(os.open(candidate, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            continue
        except OSError as exc:
            raise OutputError(f"{candidate}: cannot create ({exc.strerror or exc})") from None
        return candidate
    raise AssertionError("unreachable")  # pragma: no cover


def missing_input(spec: str | Path) -> str | None:
    """Why an input path or pattern names nothing (a plain path that does not exist), or None. Glob
    patterns pass: what they match is the reader's question. Shared by the CLI's parse-time check and
    ``sharded.find_shards``, so a missing input is worded the same before and after torch loads."""
    if not glob.has_magic(str(spec)) and not Path(spec).exists():
        return f"{spec}: no such file or directory"
    return None


def remove_stale_temporaries(path: str | Path) -> list[Path]:
    """Delete the temporary files ``atomic_path`` left beside ``path`` when its writer was killed
    (its pid no longer runs on this machine); a live writer's temporary is left alone."""
    path = Path(path)
    return _remove_dead(path.parent.glob(f".{glob.escape(path.name)}.*.tmp"))


def remove_stale_temporaries_in(directory: str | Path) -> list[Path]:
    """``remove_stale_temporaries`` for every file of ``directory`` (a writer of many names, like the
    gateway's recorder)."""
    return _remove_dead(Path(directory).glob(".*.*.tmp"))


def _remove_dead(temporaries: Iterable[Path]) -> list[Path]:
    removed = []
    for tmp in temporaries:
        pid = tmp.name[:-len(".tmp")].rsplit(".", 1)[-1]
        if pid.isdigit() and not running(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
                removed.append(tmp)
    return removed


def running(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (someone else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def check_outputs(outputs: Iterable[str | Path | None], inputs: Iterable[str | Path | None]) -> None:
    """Refuse an output that is an input or another output (same file after resolving links)."""
    seen: dict[Path, str] = {}
    for role, paths in (("input", inputs), ("output", outputs)):
        for p in paths:
            if p is None:
                continue
            key = Path(p).expanduser().resolve()
            if key in seen:
                what = "an input" if seen[key] == "input" else "another output"
                raise OutputError(f"{p}: output would overwrite {what}; choose another path")
            seen[key] = role
