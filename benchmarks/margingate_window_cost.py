"""What one verifier launch costs: a deterministic pass over a window of W positions vs one fast step.

Usage: python benchmarks/margingate_window_cost.py [--dtypes float32,bfloat16] [--windows 1,2,4,8,16,32]

MarginGate's window rule recomputes, in one pass (``Llama.forward_det``), every column since the
request's last verified one. Its price depends on the hardware: where a decode step is bound by
reading the weights, a W-row pass costs about one step and the rule's cost follows the number of
launches; where the matrix multiplies are compute-bound, it follows the number of recomputed rows
(like always-on verification). This script measures which regime this machine is in, per dtype:
the time of a W-row deterministic pass (one request, committed) over the time of one fast decode
step of a batch of 4, side by side in one process (medians of alternating rounds; ratios only).
Writes benchmarks/results/margingate_window_cost.md (or --out).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from verinfer.determinism.model import Llama  # noqa: E402
from verinfer.machine import describe  # noqa: E402

PROMPT = list(range(1000, 1040))  # 40 prompt positions; the token ids do not change the arithmetic cost


def measure(dtype: str, windows: list[int], rounds: int, batch: int) -> list[tuple[int, float, float]]:
    """Rows (W, median pass / fast step, per-row cost / one-row pass)."""
    from verinfer.models.backend import Backend

    model = Llama(Backend.load("smollm2-135m", dtype).model)
    max_len = len(PROMPT) + max(windows) + 2
    fast_pool = model.new_pool(batch, max_len)
    model.prefill_fast(fast_pool, list(range(batch)), [PROMPT] * batch)
    det_pool = model.new_pool(1, max_len)
    model.prefill_det(det_pool, 0, PROMPT)
    start = list(fast_pool.lengths)

    def fast_step() -> float:
        fast_pool.lengths[:] = start  # decode the same position every round
        t0 = time.perf_counter()
        model.decode_fast(fast_pool, torch.full((batch,), 1042))
        return time.perf_counter() - t0

    def window(w: int) -> float:
        t0 = time.perf_counter()
        model.forward_det(det_pool, [0], [[1042] * w], [len(PROMPT)], commit=True)
        return time.perf_counter() - t0

    fast_step(), window(1)  # warm-up
    fast_t: list[float] = []
    win_t: dict[int, list[float]] = {w: [] for w in windows}
    for _ in range(rounds):
        for w in windows:
            fast_t.append(fast_step())
            win_t[w].append(window(w))
    fast = statistics.median(fast_t)
    one = statistics.median(win_t[windows[0]]) / windows[0]
    return [(w, statistics.median(win_t[w]) / fast, statistics.median(win_t[w]) / w / one) for w in windows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--windows", default="1,2,4,8,16,32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4, help="batch of the fast step used as the unit")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/margingate_window_cost.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    windows = [int(w) for w in args.windows.split(",") if w]
    command = " ".join(["python benchmarks/margingate_window_cost.py"] + [shlex.quote(a) for a in sys.argv[1:]])
    lines = ["# Cost of one window verification pass (SmolLM2-135M, our decoder)", "",
             f"Command: `{command}`", "",
             f"Machine: {describe(args.threads)}; medians of {args.rounds} alternating rounds.", "",
             f"| dtype | window W | pass time / one fast step (batch {args.batch}) | per-row time / one-row pass |",
             "|---|---|---|---|"]
    for dt in args.dtypes.split(","):
        for w, vs_fast, per_row in measure(dt, windows, args.rounds, args.batch):
            lines.append(f"| {dt} | {w} | {vs_fast:.2f} | {per_row:.2f} |")
            print(lines[-1], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
