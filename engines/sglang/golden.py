"""Golden vectors from SGLang's own sampler functions, run on CPU (``engines/sglang/setup.sh``).

SGLang's hash is a Triton kernel (``sglang/kernels/ops/sampling/murmur_hash.py``) whose CPU branch
needs ``sgl_kernel`` (CUDA builds only); the seeded sampling functions are plain torch in
``sglang/srt/layers/sampler.py``, but that module imports the whole server. So this script, run
in a venv holding the sglang wheel (no dependencies) and ``triton``:

- imports the installed ``murmur_hash.py`` by path and launches ``murmur_hash32_kernel`` itself
  in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors;
- reads the installed ``sampler.py``, takes the source of ``multinomial_with_seed``,
  ``sampling_from_probs_torch`` and ``top_k_top_p_min_p_sampling_from_probs_torch`` unchanged
  except for their decorators (``@torch.compile``: no C++ compiler needed on CPU) and executes it
  with the kernel above as ``murmur_hash32``;
- applies ``Sampler.forward``'s standard path around them: ``logits / T`` then ``softmax`` (fp32).

Nothing of SGLang is copied into verinfer: the engine's code is read from the installed wheel at
run time. The output (JSON) holds logits, per-row parameters and SGLang's sampled tokens, plus raw
hashes for a few (seed, pos, col) triples.

    $VENV/bin/python engines/sglang/golden.py --out tests/fixtures/engines/sglang/golden.json
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402


def sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")
    return Path(next(iter(spec.submodule_search_locations)))


def load_kernel():
    path = sglang_root() / "kernels" / "ops" / "sampling" / "murmur_hash.py"
    spec = importlib.util.spec_from_file_location("sglang_murmur_hash", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_murmur_hash32(mod):
    import triton

    def murmur_hash32(seed, positions, col_indices):  # the kernel launch of mod.murmur_hash32, on CPU
        n, m = seed.shape[0], col_indices.shape[0]
        out = torch.empty((n, m), dtype=torch.uint32)
        mod.murmur_hash32_kernel[(n, triton.cdiv(m, 1024))](seed, positions, col_indices, out, n, m, BLOCK_SIZE=1024)
        return out
    return murmur_hash32


def load_functions(murmur_hash32):
    path = sglang_root() / "srt" / "layers" / "sampler.py"
    tree = ast.parse(path.read_text())
    wanted = ("multinomial_with_seed", "sampling_from_probs_torch", "top_k_top_p_min_p_sampling_from_probs_torch")
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    for n in nodes:
        n.decorator_list = []
    module = ast.Module(body=nodes, type_ignores=[])

    class _Flag:
        def get(self):
            return False

    class _Envs:
        SGLANG_OPT_USE_GUMBEL_SAMPLE = _Flag()

    ns = {"torch": torch, "murmur_hash32": murmur_hash32, "envs": _Envs(), "Optional": __import__("typing").Optional}
    exec(compile(module, str(path), "exec"), ns)
    return ns


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=1000)
    args = ap.parse_args(argv)
    mod = load_kernel()
    mh = make_murmur_hash32(mod)
    fns = load_functions(mh)
    g = torch.Generator().manual_seed(7)
    cases = []
    # (temperature, top_k, top_p, batch_sorted); top_k -1 = all. Rows of a case share the batch path.
    configs = [(1.0, -1, 1.0), (0.7, -1, 1.0), (1.0, 50, 1.0), (1.0, -1, 0.9), (1.0, 50, 0.95), (0.8, 20, 0.8)]
    seeds = [42, 0, 1, 2**32 + 5, -3, 2**62 + 12345, 987654321, -(2**63)]
    TOP_K_ALL = 1 << 30
    for ci, (temp, top_k, top_p) in enumerate(configs):
        n = len(seeds)
        logits = torch.randn(n, args.vocab, generator=g) * 2.5
        positions = torch.randint(0, 4000, (n,), generator=g, dtype=torch.int64)
        seed_t = torch.tensor(seeds, dtype=torch.int64)
        x = logits / torch.full((n, 1), temp, dtype=torch.float32)  # Sampler.forward: logits.div_(temperatures)
        probs = torch.softmax(x, dim=-1)
        if top_k == -1 and top_p == 1.0:  # simple_sampling_case
            tokens = fns["sampling_from_probs_torch"](probs.clone(), seed_t, positions)
        else:
            ks = torch.full((n,), top_k if top_k > 0 else TOP_K_ALL, dtype=torch.int64)
            ps = torch.full((n,), top_p, dtype=torch.float32)
            tokens = fns["top_k_top_p_min_p_sampling_from_probs_torch"](
                probs.clone(), ks, ps, torch.zeros(n), False, seed_t, positions)
        cases.append({"temperature": temp, "top_k": top_k, "top_p": top_p, "sorted": not (top_k == -1 and top_p == 1.0),
                      "seeds": seeds, "positions": positions.tolist(),
                      "logits": logits.numpy().astype(np.float32).tolist(), "tokens": tokens.long().tolist()})
    # Raw hashes of a few triples, to pin the message layout.
    hs = [(s, p, c) for s in (42, -3, 2**40 + 7) for p in (0, 17, 2**31 + 3) for c in (0, 1, 49151)]
    seed_t = torch.tensor([h[0] if h[0] < 2**63 else h[0] - 2**64 for h in hs], dtype=torch.int64)
    pos_t = torch.tensor([h[1] for h in hs], dtype=torch.int64)
    hashes = []
    for i, (s, p, c) in enumerate(hs):
        hashes.append(int(mh(seed_t[i:i + 1], pos_t[i:i + 1], torch.tensor([c], dtype=torch.int64))[0, 0].item()))
    out = {"source": "sglang " + __import__("importlib.metadata").metadata.version("sglang")
           + ": murmur_hash32_kernel (Triton interpreter) + sampler.py functions",
           "torch": torch.__version__, "cases": cases,
           "hashes": [{"seed": s, "pos": p, "col": c, "hash": h} for (s, p, c), h in zip(hs, hashes)]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out))
    print(f"wrote {len(cases)} cases, {sum(len(c['tokens']) for c in cases)} tokens, {len(hashes)} hashes to {args.out}")


if __name__ == "__main__":
    main()
