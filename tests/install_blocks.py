"""The README's two install lines, the quick start and the test command, read from README.md (never a
copy), and the check of what the quick start prints (issue #37). Standard library only: ``.ci/run``
runs it outside the venvs it builds.

    python tests/install_blocks.py installs quick-start|tests   # the line's pip installs, verbatim
    python tests/install_blocks.py job quick-start|tests        # what the line runs after them
    python tests/install_blocks.py check OUTPUT DIR             # OUTPUT: what the quick start printed in DIR

``.ci/run`` runs each line's installs then its job in a fresh venv of its own (the quick start's with
an empty ``VERINFER_CACHE`` and ``HOME``); ``check`` exits 1 naming each verdict line the README shows
that the quick start did not print, or the report it did not write. tests/test_readme.py tests the
parsing and the check.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
VERDICT = re.compile(r"(honest|wrong seed): (CONSISTENT|INCONSISTENT) with the claimed configuration at 1% FPR: \d+/")
REPORT = Path("verinfer-demo") / "audit" / "audit.html"  # the demo's HTTP audit report, rendered from templates


def install_blocks(text: str) -> list[str]:
    """The README's ```bash blocks that install with pip, in order (the quick start, then the tests)."""
    found = re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
    return [b.strip() for b in found if re.search(r"\bpip install\b", b)]


LINES = ("quick-start", "tests")  # the README's first two install blocks (later ones repeat their installs)


def command(name: str = "quick-start", text: str | None = None) -> str:
    """The install line ``name``: one line of pip installs followed by one command."""
    text = README.read_text() if text is None else text
    found = install_blocks(text)
    if len(found) < len(LINES):
        raise ValueError(f"README.md has {len(found)} install blocks, not {len(LINES)} ({', '.join(LINES)}) first")
    line = found[LINES.index(name)]
    if "\n" in line:
        raise ValueError(f"the {name} block must be one line, not {line!r}")
    return line


def _parts(name: str, text: str | None) -> list[str]:
    parts = [p.strip() for p in command(name, text).split("&&")]
    if not parts[-1] or "pip install" in parts[-1] or any("pip install" not in p for p in parts[:-1]):
        raise ValueError(f"the {name} line must install with pip, then run one command: {parts}")
    return parts


def installs(name: str = "quick-start", text: str | None = None) -> str:
    """The line's pip installs, as the README chains them."""
    return " && ".join(_parts(name, text)[:-1])


def job(name: str = "quick-start", text: str | None = None) -> str:
    """What the line runs after its installs."""
    return _parts(name, text)[-1]


def verdict_lines(text: str | None = None) -> list[str]:
    """The two verdict lines the README shows for the demo, to the digit."""
    text = README.read_text() if text is None else text
    return [line for line in text.splitlines() if VERDICT.match(line)]


def missing(printed: str, ran_in: Path, text: str | None = None) -> list[str]:
    """What the README promises that a run of the quick start did not deliver (empty: all of it)."""
    shown = verdict_lines(text)
    out = [] if len(shown) == 2 else [f"README.md shows {len(shown)} demo verdict lines, not 2"]
    lines = printed.splitlines()
    out += [f"not printed: {line}" for line in shown if line not in lines]
    if not (ran_in / REPORT).is_file():
        out.append(f"not written: {ran_in / REPORT}")
    return out


def main(argv: list[str]) -> int:
    if argv[:1] in (["installs"], ["job"]) and len(argv) == 2 and argv[1] in LINES:
        print(installs(argv[1]) if argv[0] == "installs" else job(argv[1]))
        return 0
    if argv[:1] == ["check"] and len(argv) == 3:
        problems = missing(Path(argv[1]).read_text(errors="replace"), Path(argv[2]))
        for p in problems:
            print(f"quick start: {p}", file=sys.stderr)
        if not problems:
            print(f"quick start: both README verdict lines printed and {REPORT} written")
        return 1 if problems else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
