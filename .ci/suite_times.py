"""Where the test suite's time goes (issue #37, item 4): per test and per file, from pytest's own
``--durations=0`` lines (setup, call and teardown of one test summed; a report that xdist relays more
than once is counted once, by test id and phase).

    PYTEST_ADDOPTS=--durations=0 bash .ci/run > ci.log 2>&1; python3 .ci/suite_times.py ci.log [--top 40]

Standard library only. Prints the heaviest tests, the heaviest files and the total (the sum of the
workers' seconds, so about twice the wall time of ``-n 2``).
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(\S+.*)$")


def per_test(lines: list[str]) -> dict[str, float]:
    """Seconds per test id: its phases summed, each (id, phase) counted once."""
    seen: dict[tuple[str, str], float] = {}
    for line in lines:
        m = LINE.match(line)
        if m:
            seen.setdefault((m.group(3).strip(), m.group(2)), float(m.group(1)))
    out: dict[str, float] = defaultdict(float)
    for (test, _), seconds in seen.items():
        out[test] += seconds
    return dict(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    tests = per_test(args.log.read_text(errors="replace").splitlines())
    files: dict[str, float] = defaultdict(float)
    for test, seconds in tests.items():
        files[test.split("::")[0]] += seconds
    print(f"{len(tests)} tests, {sum(tests.values()):.0f} s of worker time")
    print("\nheaviest files:")
    for name, seconds in sorted(files.items(), key=lambda kv: -kv[1])[:args.top // 2]:
        print(f"{seconds:8.1f}  {name}")
    print("\nheaviest tests:")
    for name, seconds in sorted(tests.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{seconds:8.1f}  {name}")


if __name__ == "__main__":
    main()
