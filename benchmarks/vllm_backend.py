"""``--backend vllm`` against the transformers reference, side by side in one run (issue #40 item 4).

Usage: python benchmarks/vllm_backend.py [--prompts 32] [--max-tokens 64] [--rounds 3] [--out FILE.md]

1. The real vLLM CPU engine (``engines/vllm_cpu``, its own venv) generates seeded traces (T 1, top-k 50,
   top-p 0.95) in fp32 and in bf16: an honest provider of each precision.
2. Four references score every trace set: transformers fp32 and bf16 (the model here), and vLLM fp32 and
   bf16 (``--backend vllm``: hidden states from vLLM itself, the head applied here). Shown per pair:
   exact-match rate, share of margin 0, mean margin, and for the vLLM references the agreement with the
   transformers reference of the same dtype (tokens whose exact match and finiteness agree, largest margin gap).
3. The claims again under a wrong seed (each trace's seed + 1): the rate the reference still matches.
4. Cost: wall time of ``verify`` on the fp32 traces with each fp32 reference, alternating A/B over
   ``--rounds`` (vLLM runs in its own process, so process CPU time would miss it); medians and the ratio.
   Load times are shown apart. Only ratios measured side by side here are claims.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from verinfer import api  # noqa: E402
from verinfer.machine import describe  # noqa: E402
from verinfer.models import vllm_backend  # noqa: E402
from verinfer.trace import read_traces  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _engine():
    spec = importlib.util.spec_from_file_location("vllm_cpu_run", ROOT / "engines" / "vllm_cpu" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rates(result) -> dict:
    cols = result.columns
    exact = np.asarray(cols["exact_match"], bool)
    margin = np.asarray(cols["margin"], float)
    return {"tokens": exact.size, "exact": exact.mean(), "margin0": (margin == 0).mean(),
            "mean_margin": float(np.nanmean(np.where(np.isfinite(margin), margin, np.nan))), "cols": cols}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    run = _engine()
    python = run.engine_python()
    os.environ[vllm_backend.PYTHON_ENV] = str(python)
    directory = run.model_dir("smollm2-135m")
    prompts = run.rendered_prompts(directory, "chitchat", args.prompts, seed=23)
    work = Path(tempfile.mkdtemp(prefix="vllm-backend-bench-"))
    served = {}
    for dtype in ("float32", "bfloat16"):
        files, _ = run.generate(python, directory, prompts, ("seeded",), dtype, args.max_tokens, 5000, work)
        served[dtype] = read_traces(files["seeded"])
    claims = {f"{d} engine": ts for d, ts in served.items()}
    claims.update({f"{d} engine, wrong seed": [replace(t, sampling=t.sampling.with_(seed=t.sampling.seed + 1))
                                               for t in ts] for d, ts in served.items()})

    refs, load_s = {}, {}
    for dtype in ("float32", "bfloat16"):
        for kind in ("transformers", "vllm"):
            t0 = time.perf_counter()
            refs[(kind, dtype)] = api.load_model("smollm2-135m", dtype, "cpu", kind)
            load_s[(kind, dtype)] = time.perf_counter() - t0

    rows = []
    for name, traces in claims.items():
        for dtype in ("float32", "bfloat16"):
            base = _rates(api.verify(traces, backend=refs[("transformers", dtype)], default_calibration=False))
            other = _rates(api.verify(traces, backend=refs[("vllm", dtype)], default_calibration=False))
            agree = (np.asarray(base["cols"]["exact_match"], bool) == np.asarray(other["cols"]["exact_match"], bool))
            ma, mb = np.asarray(base["cols"]["margin"], float), np.asarray(other["cols"]["margin"], float)
            both = np.isfinite(ma) & np.isfinite(mb)  # an infinite margin (a filtered token) on one side only
            agree &= np.isfinite(ma) == np.isfinite(mb)  # counts as a disagreement
            rows.append((name, dtype, base, other, agree.mean(), float(np.abs(ma - mb)[both].max(initial=0.0))))

    fp32 = served["float32"]
    times: dict[str, list[float]] = {"transformers": [], "vllm": []}
    for r in range(args.rounds):
        for kind in (("transformers", "vllm") if r % 2 == 0 else ("vllm", "transformers")):
            t0 = time.perf_counter()
            api.verify(fp32, backend=refs[(kind, "float32")], default_calibration=False)
            times[kind].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = sum(len(t.output_token_ids) for t in fp32)
    for ref in refs.values():
        if isinstance(ref, vllm_backend.VllmBackend):
            ref.worker.close()

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    lines = ["# `--backend vllm` against the transformers reference", "",
             f"Command: `python benchmarks/vllm_backend.py --prompts {args.prompts} --max-tokens {args.max_tokens} "
             f"--rounds {args.rounds}`  ",
             f"Date: {dt.date.today()}, commit {commit}  ",
             f"Machine: {describe(torch.get_num_threads())}; vLLM CPU 0.32.0 in its own venv; model smollm2-135m; "
             f"{args.prompts} chitchat prompts x {args.max_tokens} tokens, seeded (T 1, top-k 50, top-p 0.95).", "",
             "## Scores: each trace set under the transformers and the vLLM reference of one dtype", "",
             "| traces | reference dtype | tokens | exact (transformers) | exact (vLLM) | margin 0 (transformers) "
             "| margin 0 (vLLM) | exact match and finiteness agree | largest margin gap |", "|---|---|---|---|---|---|---|---|---|"]
    for name, dtype, base, other, agree, gap in rows:
        lines.append(f"| {name} | {dtype} | {base['tokens']} | {100 * base['exact']:.2f}% | "
                     f"{100 * other['exact']:.2f}% | {100 * base['margin0']:.2f}% | {100 * other['margin0']:.2f}% | "
                     f"{100 * agree:.2f}% | {gap:.3g} |")
    lines += ["", "## Cost: `verify` of the fp32 engine's traces with each fp32 reference (wall time)", "",
              "| reference | load (s) | verify, median of rounds (s) | tokens/s |", "|---|---|---|---|"]
    for kind in ("transformers", "vllm"):
        lines.append(f"| {kind} | {load_s[(kind, 'float32')]:.1f} | {med[kind]:.2f} | {tokens / med[kind]:.0f} |")
    lines += ["", f"vLLM / transformers verify time: **{med['vllm'] / med['transformers']:.2f}x** "
              f"({tokens} tokens, {args.rounds} rounds alternating; per round: "
              + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(times['vllm'], times['transformers'])) + ")."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
