"""How fast the command line answers help and bad input, against importing torch (issue #31, item 4).

Usage: python benchmarks/cli_startup.py [--rounds 7] [--before DIR] [--out PATH]

Each measurement is the wall time of a fresh process, as a user starts it:
  verify-missing:  ``python -m verinfer.cli verify missing.jsonl`` (a missing file: one line, exit 2)
  help:            ``python -m verinfer.cli --help``
  import-torch:    ``python -c "import torch"`` (what every command paid before it could say either)
With ``--before DIR`` (a source tree of an earlier commit: ``mkdir DIR && git archive REV src | tar
-x -C DIR``) the two verinfer commands are also timed with that tree's code (``PYTHONPATH=DIR/src``).
The commands alternate within each round (the order rotates), and the table shows medians over
rounds and each command's ratio to importing torch. The machine is shared with other jobs, so its load
average is recorded beside the numbers. Results: ``benchmarks/results/cli_startup.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
HANG_GUARD_S = 600  # a run this long is killed and reported, never waited for
CASES = {  # name: (argv, expected exit code, how the table shows it)
    "verify-missing": ([sys.executable, "-m", "verinfer.cli", "verify", "missing.jsonl"], 2,
                       "verinfer verify missing.jsonl"),
    "help": ([sys.executable, "-m", "verinfer.cli", "--help"], 0, "verinfer --help"),
    "import-torch": ([sys.executable, "-c", "import torch"], 0, 'python -c "import torch"'),
}


def timed(argv: list[str], expected: int, shown: str, cwd: str, src: Path | None = None) -> float:
    """Wall seconds of one fresh process (verinfer from ``src`` when given); its exit code must be the
    expected one."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           **({"PYTHONPATH": str(src)} if src else {})}
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=cwd, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != expected:
        raise SystemExit(f"{' '.join(argv)}: exit {proc.returncode}, expected {expected}: {proc.stderr[-300:]}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--before", type=Path, help="source tree of an earlier commit, timed beside this one")
    parser.add_argument("--out", type=Path, default=RESULTS / "cli_startup.md")
    args = parser.parse_args()
    if args.before is not None:
        if not (args.before / "src" / "verinfer" / "cli").is_dir():
            raise SystemExit(f"--before {args.before}: no src/verinfer/cli below it")
        for name in ("verify-missing", "help"):
            argv, code, shown = CASES[name]
            CASES[f"{name} (before)"] = (argv, code, f"{shown} (before)")
    names = list(CASES)
    walls: dict[str, list[float]] = {name: [] for name in names}
    loads = [os.getloadavg()[0]]
    start = dt.datetime.now(dt.timezone.utc)
    with tempfile.TemporaryDirectory() as cwd:
        timed(*CASES["import-torch"], cwd)  # warm the page cache once: every round then reads the same files
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                src = args.before.resolve() / "src" if name.endswith("(before)") else None
                walls[name].append(timed(*CASES[name], cwd, src))
            loads.append(os.getloadavg()[0])
    end = dt.datetime.now(dt.timezone.utc)
    torch_s = statistics.median(walls["import-torch"])

    from verinfer.files import write_atomic
    from verinfer.machine import describe

    rows = [f"| `{CASES[n][2]}` | {statistics.median(walls[n]):.2f} | {min(walls[n]):.2f} - {max(walls[n]):.2f} "
            f"| {statistics.median(walls[n]) / torch_s:.2f} |" for n in names]
    text = "\n".join([
        "# Command-line startup: help and bad input against importing torch",
        "",
        f"Command: `python benchmarks/cli_startup.py --rounds {args.rounds}"
        + (f" --before {args.before}`  " if args.before else "`  "),
        *([f"Before: the code of `{args.before}` (`PYTHONPATH={args.before}/src`)  "] if args.before else []),
        f"Machine: {describe(1)}  ",
        f"When: {start:%Y-%m-%d %H:%M}-{end:%H:%M} UTC; load average (1 min) {min(loads):.1f} to {max(loads):.1f} "
        "(the machine is shared with other jobs)",
        "",
        f"Each row: wall time of a fresh process, median of {args.rounds} rounds (the commands alternate, "
        "order rotating), its range, and its ratio to `import torch`.",
        "",
        "| command | median wall s | range s | / import torch |",
        "|---|---|---|---|",
        *rows,
        "",
    ])
    write_atomic(args.out, text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
