"""This machine: the thread policy every command applies, and the machine line every benchmark and
experiment result records (ratios only mean something next to it).

The thread policy exists because torch's default (one intra-op thread per core of the machine) assumes
the machine is idle: on a shared 2-core machine, two OpenMP threads beside one other busy process wait
at every parallel region for the thread that lost its core (issue #31: the demo had not finished after
44 min with the default, and took 29 min with ``OMP_NUM_THREADS=1``; ``benchmarks/threads.py``).
"""

from __future__ import annotations

import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import verinfer

SYS_CPU = Path("/sys/devices/system/cpu")
PROC_STAT = Path("/proc/stat")
CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))
# Processes that run beside others of their kind, one per core: a pytest-xdist worker, or a process
# started with VERINFER_WORKER=1 (by whoever starts several). Ray sets OMP_NUM_THREADS for its workers.
WORKER_ENV = ("PYTEST_XDIST_WORKER", "VERINFER_WORKER")
SAMPLE_S = 0.2  # how long the other processes' CPU use is sampled (/proc/stat ticks are 10 ms)


@dataclass(frozen=True)
class Threads:
    """The torch intra-op thread count a process uses, and why (``benchmarks/threads.py`` records it)."""

    count: int
    reason: str


def describe(threads: int, extra: str = "") -> str:
    import torch

    return (f"{platform.processor() or platform.machine()} ({platform.machine()}), {os.cpu_count()} CPU cores "
            f"(shared with other processes), torch {torch.__version__} CPU, {threads} torch thread(s), "
            + (f"{extra}, " if extra else "") + f"Python {platform.python_version()}, verinfer {verinfer.__version__}")


# --- pure parts: text in, numbers out -------------------------------------------------------------

def physical_cores(topology: Iterable[tuple[int, int]]) -> int:
    """Distinct (package, core) pairs: SMT siblings share one core's execution units, so a second
    thread on a sibling adds little and contends for the same core."""
    return len(set(topology))


def quota_cpus(cpu_max: str | None = None, quota_us: str | None = None, period_us: str | None = None) -> int | None:
    """Whole CPUs a cgroup CPU quota allows (cgroup v2 ``cpu.max`` "QUOTA PERIOD" or "max PERIOD",
    or v1's ``cfs_quota_us`` / ``cfs_period_us``); None without a quota. A container may see every core
    in its affinity and still be throttled to fewer."""
    if cpu_max is not None:
        quota, _, period = cpu_max.strip().partition(" ")
        if quota == "max" or not period:
            return None
        q, p = int(quota), int(period)
    elif quota_us is not None and period_us is not None:
        q, p = int(quota_us), int(period_us)
        if q <= 0:
            return None
    else:
        return None
    return max(1, q // p)


def cpu_ticks(stat: str, cpus: Iterable[int]) -> dict[int, tuple[int, int]]:
    """(idle, total) ticks per logical CPU in ``cpus`` from the text of ``/proc/stat`` (idle counts
    iowait; guest time is already inside user time, so the total is the first eight fields)."""
    want, out = set(cpus), {}
    for line in stat.splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in want:
            continue
        v = [int(x) for x in fields[:8]]
        out[int(name[3:])] = (v[3] + v[4], sum(v))
    return out


def idle_cpus(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]) -> float:
    """CPUs' worth of idle time between two ``cpu_ticks`` samples (CPUs with no ticks count as idle)."""
    idle = 0.0
    for cpu, (i1, t1) in after.items():
        i0, t0 = before.get(cpu, (i1, t1))
        idle += (i1 - i0) / (t1 - t0) if t1 > t0 else 1.0
    return idle


def explicit(requested: int | None, env: dict[str, str]) -> Threads | None:
    """The policy's first steps, in order: an explicit ``--threads N`` (N >= 1; 0 or None: decide);
    ``OMP_NUM_THREADS`` (the standard knob, and what Ray sets for its workers); one thread in a worker
    process (``WORKER_ENV``). None when none of them decides."""
    if requested is not None and requested < 0:
        raise ValueError(f"--threads must be at least 1 (or 0: the default policy), got {requested}")
    if requested:
        return Threads(requested, "--threads")
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) >= 1:
        return Threads(int(omp), "OMP_NUM_THREADS")
    for name in WORKER_ENV:
        if env.get(name):
            return Threads(1, f"worker process ({name})")
    return None


def free_cores(cores: int, quota: int | None, idle: float | None) -> Threads:
    """The policy's last step: the physical cores this process may run on (affinity, cgroup quota)
    that other processes leave idle, to the nearest whole core, at least one."""
    usable = max(1, min(cores, quota) if quota else cores)
    if idle is None:
        return Threads(usable, f"{usable} physical core(s) usable")
    return Threads(min(usable, max(1, math.floor(idle + 0.5))), f"{usable} physical core(s) usable, {idle:.1f} idle")


# --- the machine: reads /sys and /proc ------------------------------------------------------------

def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def allowed_cpus() -> set[int]:
    """Logical CPUs this process may run on (its affinity; every CPU where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def usable_cores(cpus: set[int]) -> int:
    """Physical cores behind ``cpus`` (sysfs topology); the logical count where topology is unreadable."""
    pairs = []
    for cpu in cpus:
        package = _read(SYS_CPU / f"cpu{cpu}/topology/physical_package_id")
        core = _read(SYS_CPU / f"cpu{cpu}/topology/core_id")
        if package is None or core is None:
            return len(cpus)
        pairs.append((int(package), int(core)))
    return physical_cores(pairs)


def cgroup_quota() -> int | None:
    return quota_cpus(_read(CGROUP_V2), _read(CGROUP_V1[0]), _read(CGROUP_V1[1]))


def sample_idle(cpus: set[int], seconds: float = SAMPLE_S) -> float | None:
    """CPUs' worth of idle time among ``cpus`` over ``seconds`` (None where /proc/stat is unreadable)."""
    first = _read(PROC_STAT)
    if first is None:
        return None
    time.sleep(seconds)
    second = _read(PROC_STAT)
    return None if second is None else idle_cpus(cpu_ticks(first, cpus), cpu_ticks(second, cpus))


def default_threads(requested: int | None = None) -> Threads:
    """The policy on this machine now: ``explicit``, else ``free_cores`` (which samples the other
    processes' CPU use for ``SAMPLE_S``)."""
    decided = explicit(requested, dict(os.environ))
    if decided is not None:
        return decided
    cpus = allowed_cpus()
    return free_cores(usable_cores(cpus), cgroup_quota(), sample_idle(cpus))


def use_threads(requested: int | None = None) -> int:
    """Apply the policy to torch in this process (every command's ``--threads``); returns the count.

    Where torch is not imported yet (a command line being parsed) the count goes to
    ``OMP_NUM_THREADS``, which torch reads when it starts: parsing never pays for importing torch,
    so bad input is answered in well under a second. Processes this one starts inherit the count,
    as Ray's workers inherit theirs."""
    import sys

    global _applied
    threads = default_threads(requested)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads.count)
    else:
        os.environ["OMP_NUM_THREADS"] = str(threads.count)
    _applied = threads.count
    return threads.count


_applied: int | None = None  # the count use_threads set in this process, if it ran


def user_chose(env: dict[str, str], current: int, machine_cores: int) -> bool:
    """Whether the user already chose torch's thread count: ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS``
    set (torch starts with that count), or a count other than the one torch starts with otherwise,
    every physical core of the machine (ATen's ``intraop_default_num_threads``, cores counted as
    cpuinfo counts them), which only ``torch.set_num_threads`` changes. A user who wants exactly
    that count sets ``OMP_NUM_THREADS``."""
    return any(env.get(name, "").strip() for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")) \
        or current != machine_cores


def ensure_threads() -> int:
    """The Python API's step before it runs a model: apply the policy once per process, unless it ran
    already (a command's ``--threads``, an earlier call) or the user chose (``user_chose``); returns
    torch's count. Same policy as the command line, so a notebook on a shared machine does not
    oversubscribe it either (issue #31, item 4)."""
    import torch

    global _applied
    current = torch.get_num_threads()
    if _applied is not None:
        return current
    if user_chose(dict(os.environ), current, usable_cores(set(range(os.cpu_count() or 1)))):
        _applied = current
        return current
    return use_threads()


def check_device(device: str) -> None:
    """Refuse a device torch cannot name or this machine does not have, before anything is loaded
    (torch's own errors are a traceback listing every backend it was built for). ``cpu`` is answered
    without importing torch, so a command's input checks stay fast."""
    if device == "cpu":
        return
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r}: not a torch device (cpu, cuda, cuda:1, mps)") from None
    if parsed.type == "cpu":
        return
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count and (parsed.index or 0) < count:
            return
        have = f"{count} CUDA device(s)" if count else "no CUDA device"
    elif parsed.type == "mps":
        if torch.backends.mps.is_available():
            return
        have = "no MPS device"
    else:
        have = "only cpu, cuda and mps are supported"
    raise ValueError(f"--device {device!r}: not available ({have})")
