"""Seedless audits as a customer runs them: ``verinfer audit run --mode auto`` against real servers, many times
(issue #42 items 1 and 5: the false-positive rate over independent honest audits, the power on hidden prompts).

    python experiments/cli_audit_rates.py --servers honest-fp32 --audits 100
    python experiments/cli_audit_rates.py --servers honest-bf16 --audits 100
    python experiments/cli_audit_rates.py --servers hidden-1,hidden-2,hidden-3 --audits 12
    python experiments/cli_audit_rates.py --table --out experiments/results/cli_audit_rates.md
    python experiments/cli_audit_rates.py --servers honest-fp32,honest-bf16 --rejudge   # after a rule change

Each server is a ``verinfer serve`` process (the bundled SmolLM2-135M, vLLM sampler, one torch thread):
``honest-fp32`` serves what the audit claims, ``honest-bf16`` computes in bf16 (``--misconfig bf16``: an
honest provider with other numerics, the null the logprob bands hold), ``hidden-N`` prepends a hidden
system prompt (``--misconfig system-prompt:TEXT``, texts written for this run, used by no band and no
other experiment). Audit *i* of a server is the customer's command, invoked in this process over the
same typer app (the reference model loads once; the audit itself is the CLI's path: options, HTTP
client, store, tests, reports)::

    verinfer audit run -p NAME=URL --mode auto --n 25 --max-tokens 32 --prompts SET --prompt-seed S \\
        --concurrency 8 --threads 1 --out DIR

with the prompt set rotating over chitchat, human-eval and gsm8k and the prompt seed ``1000 + i`` (sets
the bands were not built from: they used prompt seed 1), a new directory per audit (every request sent
again) kept under ``$VERINFER_CACHE/experiments/cli_audit_rates/audits/`` so that ``--rejudge`` can judge
the same paid-for responses again with the tool as it is (the command rerun on its directory, no
server), T = 1 without filters (the issue's settings). Recorded per audit from ``audit.json``: the
verdict, and each test's own p-value: a test "alone" rejects at p < FPR, which is the verdict of
``--mode surprise`` or ``--mode logprobs`` on the same responses; auto rejects when Holm's procedure
over the tests it ran does. Records append to ``$VERINFER_CACHE/experiments/cli_audit_rates/<server>.jsonl``
(a rerun goes on where it stopped); ``--table`` writes the rates with Wilson 95% intervals.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import fcntl
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from verinfer.machine import describe  # noqa: E402
from verinfer.models.load import cache_root  # noqa: E402
from verinfer.stats.evaluation import wilson_interval  # noqa: E402

HIDDEN = ("Always recommend our premium subscription when it fits the question.",
          "Answer as a pirate would.",
          "You are a tutor for high school students; explain every step.")
SERVERS = {"honest-fp32": (), "honest-bf16": ("--misconfig", "bf16"),
           **{f"hidden-{i + 1}": ("--misconfig", f"system-prompt:{t}") for i, t in enumerate(HIDDEN)}}
SETS = ("chitchat", "human-eval", "gsm8k")
TESTS = ("surprise", "logprobs")
FPR = 0.01
RESULTS = Path(__file__).resolve().parent / "results"
JUDGED_AT = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"


def records_dir() -> Path:
    return cache_root() / "experiments" / "cli_audit_rates"


def audit_dir(name: str, i: int) -> Path:
    """Where audit ``i`` of ``name`` keeps its paid-for responses, so ``--rejudge`` can judge them again."""
    return records_dir() / "audits" / name / f"audit-{i}"


@contextlib.contextmanager
def server(name: str):
    """``verinfer serve`` for ``name`` on a free port, in its own process; yields its base URL."""
    log = tempfile.NamedTemporaryFile("w+", prefix=f"serve-{name}-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "verinfer.cli.main", "serve", "--port", "0", "--threads", "1", *SERVERS[name]]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while (found := re.search(r"at (http://\S+/v1)", Path(log.name).read_text())) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server {name}: did not start:\n{Path(log.name).read_text()[-2000:]}")
            time.sleep(0.5)
        yield found.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        Path(log.name).unlink(missing_ok=True)


def audit(app, name: str, url: str, i: int, out: Path) -> dict:
    """Audit ``i`` of ``name``, as the customer's command; what ``audit.json`` says of it."""
    from typer.testing import CliRunner

    prompts, seed = SETS[i % len(SETS)], 1000 + i
    args = ["audit", "run", "-p", f"{name}={url}", "--mode", "auto", "--n", "25", "--max-tokens", "32",
            "--prompts", prompts, "--prompt-seed", str(seed), "--concurrency", "8", "--threads", "1",
            "--out", str(out)]
    t0 = time.monotonic()
    result = CliRunner().invoke(app, args, env={"COLUMNS": "100"})
    if result.exit_code not in (0, 1):
        raise SystemExit(f"{name} audit {i}: `verinfer {' '.join(args)}` exited {result.exit_code}:\n"
                         f"{result.output[-3000:]}\n{result.exception!r}")
    doc = json.loads((out / "audit.json").read_text())
    (provider,) = doc["providers"]
    tests = {t["test"]: t for t in provider["tests"] if t["ran"]}
    return {"server": name, "audit": i, "prompts": prompts, "prompt_seed": seed, "exit": result.exit_code,
            "rejects": not provider["verdict"]["consistent"], "p_auto": provider["verdict"]["p_value"],
            "tests": sorted(tests), "wall_s": round(time.monotonic() - t0, 1),
            **{f"p_{t}": tests[t]["p_value"] for t in TESTS if t in tests},
            **{f"stat_{t}": tests[t]["statistic"] for t in TESTS if t in tests},
            "tokens": provider["verdict"]["tokens"],
            "gap_bands_prompts": (doc.get("logprob_gap_bands") or {}).get("prompts", "chitchat"),
            "judged_at": JUDGED_AT}


@contextlib.contextmanager
def locked(path: Path):
    """Holds ``path``'s lock file: a run appending and a rejudge rewriting the same records take turns."""
    with open(path.with_suffix(".lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def run(names: list[str], audits: int, sets: tuple[str, ...] = SETS, start: int = 0) -> None:
    from verinfer.cli.main import app

    directory = records_dir()
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = directory / f"{name}.jsonl"
        done = {json.loads(line)["audit"] for line in path.open()} if path.exists() else set()
        todo = [i for i in range(start, audits) if i not in done and SETS[i % len(SETS)] in sets]
        print(f"{name}: {len(done)} audits recorded, {len(todo)} to run", flush=True)
        if not todo:
            continue
        with server(name) as url:
            for i in todo:
                record = audit(app, name, url, i, audit_dir(name, i))
                with locked(path), path.open("a") as fh:
                    fh.write(json.dumps(record) + "\n")
                say(record)


def say(record: dict) -> None:
    print(f"{record['server']} audit {record['audit']} ({record['prompts']}, seed {record['prompt_seed']}): "
          f"{'INCONSISTENT' if record['rejects'] else 'CONSISTENT'} p {record['p_auto']:.3g} "
          + " ".join(f"{t} {record.get('p_' + t, float('nan')):.3g}" for t in TESTS)
          + f" ({record['wall_s']} s)", flush=True)


def rejudge(names: list[str]) -> None:
    """Judge every kept audit of ``names`` again with the tool as it is now: the same command on the same
    directory, whose stored responses answer every request (no server runs; a missing response fails on
    the unreachable address). Each record is replaced atomically as soon as it is judged again."""
    from verinfer.cli.main import app

    for name in names:
        path = records_dir() / f"{name}.jsonl"
        if not path.exists():
            continue
        old = [json.loads(line) for line in path.open()]
        kept = [r for r in old if any(audit_dir(name, r["audit"]).glob("*/responses.jsonl"))
                and r.get("judged_at") != JUDGED_AT]
        print(f"{name}: rejudging {len(kept)} of {len(old)} recorded audits (the rest kept no responses or "
              f"were judged at {JUDGED_AT})", flush=True)
        for r in kept:
            again = audit(app, name, "http://127.0.0.1:9/v1", r["audit"], audit_dir(name, r["audit"]))
            again = {**again, "wall_s": r["wall_s"], "rejudged_s": again["wall_s"]}
            say(again)
            # Written after each audit; a run may append new audits to the same file meanwhile: keep them.
            with locked(path):
                now = [json.loads(line) for line in path.open()]
                tmp = path.with_suffix(".tmp")
                tmp.write_text("".join(json.dumps(again if n["audit"] == r["audit"] else n) + "\n" for n in now))
                tmp.replace(path)


def rate(k: int, n: int) -> str:
    ci = wilson_interval(k, n)
    return f"{k}/{n} = {ci.estimate:.3f} [{ci.low:.3f}, {ci.high:.3f}]"


def table(out: Path) -> None:
    rows, notes, by_set = [], [], []
    honest: list[dict] = []
    for name in [*SERVERS, "honest, all"]:
        path = records_dir() / f"{name}.jsonl"
        if name == "honest, all":
            recs = honest
            if not recs:
                continue
        elif not path.exists():
            continue
        else:
            recs = [json.loads(line) for line in path.open()]
            honest += recs if name.startswith("honest") else []
            judged = Counter(r.get("judged_at", "not recorded (f200fe3 or earlier)") for r in recs)
            notes.append(f"- {name}: judged at " + ", ".join(f"{k} ({v})" for k, v in judged.items()))
        cells = [rate(sum(r["rejects"] for r in recs), len(recs))]
        for t in TESTS:
            ran = [r for r in recs if f"p_{t}" in r]
            cells.append(rate(sum(r[f"p_{t}"] < FPR for r in ran), len(ran)) if ran else "not run")
        sets = ", ".join(f"{s} {sum(r['prompts'] == s for r in recs)}" for s in SETS)
        rows.append(f"| {name} | {len(recs)} ({sets}) | " + " | ".join(cells) + " |")
        if name.startswith("hidden"):
            notes.append(f"- {name}: {HIDDEN[int(name.split('-')[1]) - 1]!r}")
        if name == "honest, all":
            continue
        walls = sorted(r["wall_s"] for r in recs)
        notes.append(f"- {name}: wall time per audit median {walls[len(walls) // 2]:.0f} s")
        for p in SETS:
            part = [r for r in recs if r["prompts"] == p]
            if part:
                gaps = [r["stat_logprobs"] for r in part if "stat_logprobs" in r]
                built = sorted({r.get("gap_bands_prompts", "chitchat") for r in part})
                by_set.append(f"| {name} | {p} | {', '.join(built)} | {rate(sum(r['rejects'] for r in part), len(part))} | "
                              + (f"{np.mean(gaps):.4f} ({min(gaps):.4f}-{max(gaps):.4f})" if gaps else "-") + " |")
    lines = ["# Seedless CLI audits: rejection rates (issue #42 items 1 and 5)", "",
             "Command: `python experiments/cli_audit_rates.py --table` after the runs in its docstring  ",
             f"Written {dt.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; machine: {describe(1)}", "",
             "Each audit: `verinfer audit run --mode auto --n 25 --max-tokens 32` (T = 1, no filters, no seeds), "
             "prompt sets rotating chitchat / human-eval / gsm8k, prompt seed 1000 + audit index, against a "
             "`verinfer serve` process. Rates at 1% FPR with Wilson 95% intervals; \"alone\": the test's own "
             "p < 0.01, the verdict of that mode alone on the same responses. \"judged at\": the commit whose "
             "code judged the records (a `--rejudge` judges kept responses again).", "",
             "| server | audits (per prompt set) | auto rejects | surprise alone | logprobs alone |",
             "|---|---|---|---|---|", *rows, "", "Per prompt set (the logprob gap: the logprobs test's statistic, the mean "
             "clipped gap per position, nats; records without the bands' prompts predate per-set bands: chitchat):", "",
             "| server | prompt set | logprob-gap bands built on | auto rejects | logprob gap, mean (range) |",
             "|---|---|---|---|---|", *by_set, "",
             *notes, ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("\n".join(lines))
    tmp.replace(out)
    print("\n".join(lines) + f"\nwrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="honest-fp32,honest-bf16",
                        help=f"comma-separated, of {', '.join(SERVERS)}")
    parser.add_argument("--audits", type=int, default=100, help="audits per server (audit indexes 0..N-1)")
    parser.add_argument("--start", type=int, default=0,
                        help="first audit index to run (a second process on the same server takes another range)")
    parser.add_argument("--sets", default=",".join(SETS),
                        help="run only the audits whose rotating prompt set is one of these (comma-separated)")
    parser.add_argument("--table", action="store_true", help="only write the table from the records")
    parser.add_argument("--rejudge", action="store_true",
                        help="judge the kept audits of --servers again with the tool as it is now (no server)")
    parser.add_argument("--out", type=Path, default=RESULTS / "cli_audit_rates.md")
    args = parser.parse_args()
    if args.table:
        table(args.out)
        return
    names = args.servers.split(",")
    unknown = [n for n in names if n not in SERVERS]
    if unknown:
        parser.error(f"--servers: unknown {', '.join(unknown)} (known: {', '.join(SERVERS)})")
    if args.rejudge:
        rejudge(names)
        return
    sets = tuple(args.sets.split(","))
    if not set(sets) <= set(SETS):
        parser.error(f"--sets: known sets are {', '.join(SETS)}")
    run(names, args.audits, sets, args.start)


if __name__ == "__main__":
    main()
