"""The thread policy (verinfer.machine) and ``--threads`` on every command that runs a model (issue #31, item 1)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import typer
from typer.testing import CliRunner

from verinfer import machine
from verinfer.cli.main import app

# Commands that load a model (and so get --threads), and the ones that do not; a new command must be
# put in one of them (test_every_command_is_classified).
MODEL_COMMANDS = {"generate", "verify", "demo", "serve", "experiment", "monitor", "diagnose", "audit run",
                  "audit bands", "margingate measure", "margingate sweep", "margingate decode"}
NO_MODEL_COMMANDS = {"calibrate", "gateway", "dashboard"}
POLICY_ENV = ("OMP_NUM_THREADS", *machine.WORKER_ENV)


def _commands(group, prefix: str = "") -> dict:
    """Every command of the typer app by its full name ("audit run"); typer ships its own click."""
    if hasattr(group, "commands"):
        out = {}
        for name, cmd in group.commands.items():
            out.update(_commands(cmd, f"{prefix} {name}".strip()))
        return out
    return {prefix: group}


COMMANDS = _commands(typer.main.get_command(app))


def _stat(rows: dict[int, tuple[int, int]]) -> str:
    """A /proc/stat text with (busy, idle) ticks per CPU."""
    lines = ["cpu  1 2 3 4 5 6 7 8 9 10"]
    lines += [f"cpu{c} {busy} 0 0 {idle} 0 0 0 0 0 0" for c, (busy, idle) in rows.items()]
    return "\n".join(lines + ["intr 1 2 3", "ctxt 5"])


# --- the pure policy --------------------------------------------------------------------------------

def test_physical_cores_count_smt_siblings_once():
    assert machine.physical_cores([(0, 0), (0, 0), (0, 1), (0, 1)]) == 2
    assert machine.physical_cores([(0, 0), (1, 0)]) == 2  # same core id on two packages: two cores
    assert machine.physical_cores([(0, 3)]) == 1


def test_cgroup_quota():
    assert machine.quota_cpus("max 100000\n") is None
    assert machine.quota_cpus("150000 100000\n") == 1
    assert machine.quota_cpus("400000 100000") == 4
    assert machine.quota_cpus("50000 100000") == 1  # half a CPU still runs one thread
    assert machine.quota_cpus(None, "-1\n", "100000\n") is None
    assert machine.quota_cpus(None, "300000\n", "100000\n") == 3
    assert machine.quota_cpus() is None


def test_idle_cpus_from_proc_stat_counts_only_allowed_cpus():
    before = _stat({0: (100, 100), 1: (100, 100), 2: (100, 100)})
    after = _stat({0: (200, 100), 1: (100, 200), 2: (150, 150)})  # cpu0 busy, cpu1 idle, cpu2 half
    assert machine.idle_cpus(machine.cpu_ticks(before, {0, 1, 2}), machine.cpu_ticks(after, {0, 1, 2})) == 1.5
    assert machine.idle_cpus(machine.cpu_ticks(before, {0, 1}), machine.cpu_ticks(after, {0, 1})) == 1.0
    assert set(machine.cpu_ticks(after, {1})) == {1}


def test_explicit_choices_in_order():
    assert machine.explicit(3, {"OMP_NUM_THREADS": "4"}) == machine.Threads(3, "--threads")
    assert machine.explicit(None, {"OMP_NUM_THREADS": "4", "PYTEST_XDIST_WORKER": "gw0"}).count == 4
    assert machine.explicit(0, {"PYTEST_XDIST_WORKER": "gw1"}).count == 1
    assert machine.explicit(None, {"VERINFER_WORKER": "1"}).count == 1
    assert machine.explicit(None, {"OMP_NUM_THREADS": "", "VERINFER_WORKER": ""}) is None
    assert machine.explicit(None, {"OMP_NUM_THREADS": "zero"}) is None  # not a count: the policy decides
    with pytest.raises(ValueError, match="--threads must be at least 1"):
        machine.explicit(-1, {})


def test_free_cores_leaves_busy_cores_to_their_processes():
    assert machine.free_cores(2, None, 2.0).count == 2  # an idle 2-core machine: both
    assert machine.free_cores(2, None, 1.0).count == 1  # one CPU-bound process beside: one
    assert machine.free_cores(2, None, 0.1).count == 1  # everything busy: still one
    assert machine.free_cores(2, None, 1.6).count == 2  # to the nearest whole core
    assert machine.free_cores(8, 2, 8.0).count == 2  # a cgroup quota of 2 CPUs
    assert machine.free_cores(4, None, None).count == 4  # no /proc/stat: the usable cores


@pytest.fixture
def no_policy_env(monkeypatch):
    for name in POLICY_ENV:
        monkeypatch.delenv(name, raising=False)


def _topology(root, pairs: dict[int, tuple[int, int]]):
    for cpu, (package, core) in pairs.items():
        d = root / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{package}\n")
        (d / "core_id").write_text(f"{core}\n")


def test_default_uses_affinity_and_physical_cores_not_logical(tmp_path, monkeypatch, no_policy_env):
    # 4 logical CPUs on 2 SMT cores, all idle: 2 threads, not 4.
    _topology(tmp_path, {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1)})
    monkeypatch.setattr(machine, "SYS_CPU", tmp_path)
    monkeypatch.setattr(machine, "cgroup_quota", lambda: None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(machine, "sample_idle", lambda cpus: float(len(cpus)))
    assert machine.default_threads().count == 2
    # Pinned to two siblings of one core: 1 thread.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2})
    assert machine.default_threads().count == 1
    # Two cores allowed, one taken by another process: 1 thread.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(machine, "sample_idle", lambda cpus: 1.0)
    assert machine.default_threads().count == 1


def test_sample_idle_reads_proc_stat(tmp_path, monkeypatch):
    first, second = _stat({0: (10, 10), 1: (10, 10)}), _stat({0: (20, 10), 1: (10, 20)})
    stats = iter([first, second, first, None])
    monkeypatch.setattr(machine, "_read", lambda path: next(stats) if path == machine.PROC_STAT else None)
    assert machine.sample_idle({0, 1}, seconds=0) == 1.0
    assert machine.sample_idle({0, 1}, seconds=0) is None  # unreadable: unknown, not zero
    assert machine.free_cores(2, None, None).count == 2  # and unknown leaves the usable cores


@pytest.mark.parametrize("env", [{"PYTEST_XDIST_WORKER": "gw3"}, {"VERINFER_WORKER": "1"}, {"OMP_NUM_THREADS": "1"}])
def test_worker_processes_get_one_thread(env):
    """An xdist worker, a process started as a worker, a Ray worker (Ray sets OMP_NUM_THREADS=1 for a
    one-CPU actor): one torch thread after the policy runs, in a fresh process."""
    base = {k: v for k, v in os.environ.items() if k not in POLICY_ENV}
    code = "import torch; from verinfer.machine import use_threads; use_threads(); print(torch.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                         timeout=600, check=True)
    assert out.stdout.strip() == "1"


# --- --threads on every command ----------------------------------------------------------------------

def test_every_command_is_classified():
    unknown = set(COMMANDS) - MODEL_COMMANDS - NO_MODEL_COMMANDS
    assert not unknown, f"classify as running a model or not: {unknown}"


@pytest.mark.parametrize("name", sorted(MODEL_COMMANDS & set(COMMANDS)))  # diagnose once it is registered
def test_model_commands_take_threads(name):
    opts = {o for p in COMMANDS[name].params for o in p.opts}
    assert "--threads" in opts, f"verinfer {name} runs a model but has no --threads"


@pytest.mark.parametrize("name", sorted(NO_MODEL_COMMANDS))
def test_commands_without_a_model_have_no_threads(name):
    assert "--threads" not in {o for p in COMMANDS[name].params for o in p.opts}


class Applied(Exception):
    pass


@pytest.mark.parametrize("name", sorted(MODEL_COMMANDS & set(COMMANDS)))
def test_threads_option_goes_through_the_policy(name, monkeypatch):
    """Every command's --threads reaches verinfer.machine.use_threads as it is parsed (before the
    command's arguments are checked or a model loads)."""
    seen = []

    def record(requested=None):
        seen.append(requested)
        raise Applied

    monkeypatch.setattr(machine, "use_threads", record)
    result = CliRunner().invoke(app, [*name.split(), "--threads", "3"])
    assert seen == [3], result.output
    assert isinstance(result.exception, Applied)


def test_threads_applied_to_torch_before_the_command_runs(one_torch_thread):
    """Really applied: a command that stops on bad input after parsing has set torch's threads."""
    torch.set_num_threads(2)
    result = CliRunner().invoke(app, ["margingate", "decode", "-o", "x.jsonl", "--policy", "none", "--threads", "1"])
    assert result.exit_code == 2 and "--policy" in result.output
    assert torch.get_num_threads() == 1


def test_bad_threads_is_a_usage_error():
    result = CliRunner().invoke(app, ["generate", "-o", "x.jsonl", "--threads", "-2"])
    assert result.exit_code == 2


# --- the Python API applies the same policy (issue #31, item 4) --------------------------------------

def test_user_chose_reads_the_environment_and_torch_count():
    assert not machine.user_chose({}, current=4, machine_cores=4)  # torch's own start: the policy decides
    assert machine.user_chose({}, current=3, machine_cores=4)  # torch.set_num_threads(3) was called
    assert machine.user_chose({"OMP_NUM_THREADS": "4"}, current=4, machine_cores=4)
    assert machine.user_chose({"MKL_NUM_THREADS": "2"}, current=2, machine_cores=4)
    assert not machine.user_chose({"OMP_NUM_THREADS": ""}, current=4, machine_cores=4)


API_THREADS = """
import os, torch
from verinfer import machine
before = torch.get_num_threads()
{setup}
chosen = torch.get_num_threads()
first = machine.ensure_threads()
torch.set_num_threads(first + 1)  # a later choice of the user's is never undone
second = machine.ensure_threads()
print(before, chosen, first, second, torch.get_num_threads())
"""


@pytest.mark.parametrize("setup, env, chosen", [
    ("", {"VERINFER_WORKER": "1"}, False),  # nobody chose: the policy (a worker: one thread)
    ("torch.set_num_threads(3)", {"VERINFER_WORKER": "1"}, True),  # the user called torch.set_num_threads
    ("", {"OMP_NUM_THREADS": "2", "VERINFER_WORKER": "1"}, True),  # the user set OMP_NUM_THREADS
])
def test_api_applies_the_policy_once_unless_the_user_chose(setup, env, chosen):
    cores = machine.usable_cores(set(range(os.cpu_count() or 1)))
    if cores < 2 and not chosen:
        pytest.skip("one core: the policy's one thread is torch's default, nothing to tell apart")
    base = {k: v for k, v in os.environ.items() if k not in (*POLICY_ENV, "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", API_THREADS.format(setup=setup)], env={**base, **env},
                         capture_output=True, text=True, timeout=600, check=True)
    before, chosen_count, first, second, final = map(int, out.stdout.split())
    assert first == (chosen_count if chosen else 1), out.stdout
    assert (second, final) == (first + 1, first + 1), out.stdout  # applied once: the second call changes nothing
    if not chosen:
        assert before == cores  # torch started with its own default, which the policy replaced


class PolicyApplied(Exception):
    pass


def test_api_functions_apply_the_policy_before_running_a_model(monkeypatch, tmp_path):
    from verinfer import api
    from verinfer.sampling.params import SamplingParams
    from verinfer.trace import Trace

    def stop():
        raise PolicyApplied

    monkeypatch.setattr(api, "ensure_threads", stop)
    monkeypatch.setattr(api, "_load", lambda *a: pytest.fail("a model loaded before the thread policy"))
    trace = Trace(id="t0", model="smollm2-135m", prompt_token_ids=[1, 2], output_token_ids=[3],
                  sampling=SamplingParams(seed=3))
    calls = {"load_model": lambda: api.load_model(),
             "generate": lambda: api.generate("chitchat", n=1),
             "verify": lambda: api.verify([trace], scores=tmp_path / "s.parquet"),
             "diagnose": lambda: api.diagnose([trace]),
             "audit": lambda: api.audit({"a": "http://127.0.0.1:1/v1"}, out=tmp_path / "a")}
    for name, call in calls.items():
        with pytest.raises(PolicyApplied):
            call()
