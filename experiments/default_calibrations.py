"""Build the calibrations shipped in ``src/verinfer/stats/data`` (``verinfer.stats.shipped``).

    python experiments/default_calibrations.py

For each profile named (default: vllm, the profile ``verinfer generate`` uses) it generates honest
traces of the bundled model with ``verinfer generate``'s default sampling (T=1, top-k 50, top-p
0.95) from an fp32 and a bf16 provider on calibration prompts (those of
``experiments/sampler_deviation.py``, whose trace cache it shares), verifies them with the fp32
reference and writes the pooled fp32 + bf16 calibration at 1% FPR, recording both precisions
as its coverage. Batch sizes are the largest the honest tokens support as disjoint batches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from sampler_deviation import CLAIM, POOL, traces_for  # noqa: E402

from verinfer.models.backend import Backend  # noqa: E402
from verinfer.models.load import cache_root  # noqa: E402
from verinfer.prompts import load_prompts  # noqa: E402
from verinfer.scoring.traces import score_traces  # noqa: E402
from verinfer.stats.calibration import min_batches  # noqa: E402
from verinfer.stats.shipped import DATA_DIR, calibration_filename  # noqa: E402
from verinfer.stats.summary import fit_calibrator  # noqa: E402
from verinfer.files import write_atomic  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", default="vllm")
    ap.add_argument("--prompts", type=int, default=32, help="calibration prompts per precision")
    ap.add_argument("--max-tokens", type=int, default=40)
    args = ap.parse_args(argv)
    cache = cache_root() / "experiments" / "sampler_deviation"
    cache.mkdir(parents=True, exist_ok=True)
    backend = Backend.load("smollm2-135m", "float32")
    prompts = load_prompts("chitchat", POOL, seed=28)[:args.prompts]
    for profile in args.profiles.split(","):
        claim = CLAIM.with_(profile=profile)
        split = f"cal{args.prompts}" + ("" if profile == "vllm" else f"-{profile}")
        traces = {v: traces_for(backend, v, prompts, split, args.max_tokens, cache, claim) for v in ("honest", "bf16")}
        cols = [score_traces(backend, t).columns for t in traces.values()]
        pooled = {k: np.concatenate([c[k] for c in cols]) for k in cols[0]}
        n = pooled["margin"].size
        sizes = tuple(s for s in (10, 20, 50, 100, 1000) if s * min_batches(0.01) <= n)
        sig = score_traces(backend, traces["honest"][:1]).signature
        calibrator = fit_calibrator(pooled, sizes, 0.01, signature=sig,
                                    coverage={"precisions": ["bfloat16", "float32"], "profiles": [profile]})
        path = DATA_DIR / calibration_filename(backend.model_id, sig["sampling"][0])
        write_atomic(path, json.dumps(calibrator.to_dict(), indent=1))
        print(f"{path}: {n} honest tokens (fp32 + bf16), batch sizes {sizes}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())
