"""Peak memory of verification: about 20,000 tokens against about 2,000 tokens.

Usage: python benchmarks/verify_memory.py [--small N] [--large N] [--profile NAME] [--seq-len N] [--model M]

Each size runs in a fresh subprocess that loads the model, builds its traces, then verifies them as
``verinfer.scoring.traces.score_traces`` does (the path of ``verinfer verify``: streaming prefill, scoring,
the Parquet score writer, compact columns kept for the summary), with the token budget made explicit. It reports, in MiB:

    after load   resident set (VmRSS) once the model is loaded and the traces are built
    peak growth  the high-water mark of the resident set during verification (VmHWM, reset just before
                 verifying through /proc/self/clear_refs) minus "after load"
    ru_maxrss    ``getrusage(RUSAGE_SELF).ru_maxrss`` after the run minus "after load": the same peak,
                 but over the whole process life, so loading the model can hide it (shown for comparison)

Streaming means the peak growth must not grow with the number of tokens: the ratio large/small should
be about 1. Traces are synthetic: real chitchat prompts through the model's chat template, then output
token ids drawn uniformly from the vocabulary (fixed seed); every sequence is ``--seq-len`` tokens long,
so both sizes fill the same micro-batches and only the number of tokens differs. The scores of random
tokens are meaningless; the work done per token is the same as for real traces. ``--token-budget``
defaults to 2048 (not the library's 4096) so that the small run already fills one whole micro-batch:
with 4096 the small run would fill half a batch and the comparison would measure the batch size.

``--model`` picks the reference (an alias or a local model directory, such as the random-weight models
of published shapes that ``experiments/served_shapes.py`` builds); ``experiments/served_shapes.py``
also runs one child of this script per point of its cost curves (``--whole``: one trace of exactly
``--seq-len`` tokens, its output running to the end of the sequence).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

RESULTS = Path(__file__).resolve().parent / "results"
PROFILES = {
    "vllm-topk": dict(profile="vllm", temperature=1.0, top_k=50, top_p=0.95),
    "vllm-topp": dict(profile="vllm", temperature=1.0, top_k=-1, top_p=0.95),
    "vllm-nofilter": dict(profile="vllm", temperature=1.0, top_k=-1, top_p=1.0),
    "greedy": dict(profile="greedy", temperature=0.0),
    "torch-exponential": dict(profile="torch-exponential", temperature=1.0, top_k=50, top_p=0.95),
}
MIB = 1024 * 1024


def status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def build_traces(backend, n_tokens: int, seq_len: int, params: dict, seed: int, whole: bool = False):
    """Traces of ``seq_len`` tokens each (real prompt + random outputs) until ``n_tokens`` outputs;
    with ``whole`` the last trace is not cut short, so every trace is exactly ``seq_len`` tokens."""
    import numpy as np

    from verinfer.simulate.generate import build_requests
    from verinfer.prompts import load_prompts
    from verinfer.sampling.params import SamplingParams
    from verinfer.trace import Trace

    rng = np.random.default_rng(seed)
    prompts = load_prompts("chitchat", max(8, 2 * n_tokens // max(seq_len // 2, 1)), seed=seed)
    sp = SamplingParams(**params, seed=None if params["profile"] == "greedy" else seed)
    traces, total = [], 0
    for req in build_requests(backend, prompts, sp):
        if total >= n_tokens:
            break
        prompt = list(req.prompt_token_ids)[: seq_len // 2]
        n_out = seq_len - len(prompt) if whole else min(seq_len - len(prompt), n_tokens - total)
        out = rng.integers(0, backend.vocab_size, size=n_out).tolist()
        traces.append(Trace(req.id, backend.model_id, prompt, out, req.params))
        total += n_out
    if total < n_tokens:
        raise SystemExit(f"not enough prompts for {n_tokens} tokens")
    return traces


def child(args) -> None:
    import torch

    import numpy as np

    from verinfer.models.backend import Backend
    from verinfer.scoring.scores import ScoreWriter
    from verinfer.scoring.token_difr import verify_traces

    torch.set_num_threads(args.threads)
    backend = Backend.load(args.model)
    traces = build_traces(backend, args.child, args.seq_len, PROFILES[args.profile], args.seed, args.whole)
    gc.collect()
    after_load = status_kib("VmRSS")
    # The weights are memory-mapped and only become resident when a forward pass first touches them
    # (about 540 MiB here): one 16-token forward and lm_head first, so that the peak below is verification's.
    h, _ = backend.hidden(torch.tensor([traces[0].prompt_token_ids[:16]]), None)
    backend.logits(h[:, -1])
    del h
    gc.collect()
    after_warm = status_kib("VmRSS")
    peak_reset = reset_peak()
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0, cpu0 = time.perf_counter(), time.process_time()
    trajectory = []  # (rows verified so far, peak RSS so far) after each block
    if args.bare:  # the forward pass alone: hidden + lm_head blocks, discarded
        seqs = [t.prompt_token_ids + t.output_token_ids for t in traces]
        starts = [len(t.prompt_token_ids) for t in traces]
        rows = 0
        for block in backend.prefill(seqs, starts, token_budget=args.token_budget):
            rows += len(block.items)
            trajectory.append((rows, status_kib("VmHWM")))
        cols, parquet_bytes = {"margin": np.empty(rows), "exact_match": np.zeros(1)}, 0
    else:
        with tempfile.TemporaryDirectory() as tmp:
            # what verinfer.scoring.traces.score_traces does, with the token budget made explicit
            keep = {k: [] for k in ("trace_id", "exact_match", "margin", "cross_entropy")}
            with ScoreWriter(Path(tmp) / "scores.parquet") as writer:
                for block in verify_traces(backend, traces, token_budget=args.token_budget):
                    writer.write(block.columns)
                    for k in keep:
                        keep[k].append(block.columns[k])
                    trajectory.append((trajectory[-1][0] if trajectory else 0) + len(block.items))
                    trajectory[-1] = (trajectory[-1], status_kib("VmHWM"))
            cols = {k: np.concatenate(v) for k, v in keep.items()}
            parquet_bytes = (Path(tmp) / "scores.parquet").stat().st_size
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    result = {
        "trajectory": trajectory,
        "tokens": int(sum(len(t.output_token_ids) for t in traces)),
        "prompt_tokens": int(sum(len(t.prompt_token_ids) for t in traces)),
        "traces": len(traces),
        "scored_rows": int(cols["margin"].size),
        "exact_match": float(cols["exact_match"].mean()),
        "after_load_kib": after_load,
        "after_warm_kib": after_warm,
        "hwm_kib": status_kib("VmHWM"),
        "hwm_reset": peak_reset,
        "maxrss_before_kib": maxrss_before,
        "maxrss_after_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "rss_end_kib": status_kib("VmRSS"),
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "vocab_size": backend.vocab_size,
        "parquet_bytes": parquet_bytes,
    }
    print("RESULT " + json.dumps(result))


def run_size(n_tokens: int, args, bare: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--child", str(n_tokens), "--seq-len", str(args.seq_len),
           "--profile", args.profile, "--seed", str(args.seed), "--threads", str(args.threads),
           "--token-budget", str(args.token_budget), "--model", args.model, *(["--bare"] if bare else []), *(["--whole"] if args.whole else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"child for {n_tokens} tokens failed:\n{proc.stderr[-3000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=2000, help="output tokens of the small run (default 2000)")
    parser.add_argument("--large", type=int, default=20000, help="output tokens of the large run (default 20000)")
    parser.add_argument("--seq-len", type=int, default=512, help="prompt + output tokens per trace (default 512)")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="vllm-topk",
                        help="sampling of the traces (default vllm-topk: vLLM, T=1, top-k 50, top-p 0.95)")
    parser.add_argument("--token-budget", type=int, default=2048, help="prefill micro-batch budget (default 2048)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--model", default="smollm2-135m",
                        help="reference model: an alias or a local model directory (default smollm2-135m)")
    parser.add_argument("--whole", action="store_true",
                        help="every trace exactly --seq-len tokens (the last one not cut to the token count)")
    parser.add_argument("--out", type=Path, default=None,
                        help="result file (default benchmarks/results/verify_memory.md, or "
                             "verify_memory_<profile>.md for another profile)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args)
        return

    from verinfer.machine import describe

    out = args.out or RESULTS / ("verify_memory.md" if args.profile == "vllm-topk"
                                 else f"verify_memory_{args.profile}.md")
    command = " ".join(["python benchmarks/verify_memory.py", *sys.argv[1:]])
    started = dt.datetime.now().astimezone()
    load_before = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    mach = describe(args.threads)
    print(f"# {mach}", flush=True)
    res = {}
    runs = (("small", args.small, False), ("large", args.large, False), ("small, forward pass only", args.small, True))
    for label, n, bare in runs:
        what = "running the bare forward pass over" if bare else "verifying"
        print(f"{what} {n} tokens in a fresh process ...", flush=True)
        res[label] = r = run_size(n, args, bare)
        r["growth_mib"] = (r["hwm_kib"] - r["after_warm_kib"]) / 1024
        r["maxrss_growth_mib"] = (r["maxrss_after_kib"] - r["after_warm_kib"]) / 1024
        print(f"  {r['tokens']} tokens in {r['traces']} traces: after load {r['after_load_kib'] / 1024:.0f} MiB, "
              f"after warm-up {r['after_warm_kib'] / 1024:.0f} MiB, peak growth {r['growth_mib']:.0f} MiB, "
              f"ru_maxrss growth {r['maxrss_growth_mib']:.0f} MiB, {r['seconds']:.0f} s", flush=True)
    s, l_, b = res["small"], res["large"], res["small, forward pass only"]
    ratio = l_["growth_mib"] / s["growth_mib"] if s["growth_mib"] > 0 else float("nan")
    ratio_ru = l_["maxrss_growth_mib"] / s["maxrss_growth_mib"] if s["maxrss_growth_mib"] > 0 else float("nan")
    # the large run's peak once it has verified as many tokens as the small run, and at the end
    early = next(kib for rows, kib in l_["trajectory"] if rows >= s["tokens"])
    early_mib = (early - l_["after_warm_kib"]) / 1024
    rows = []
    for label, r in res.items():
        rows.append(f"| {label} | {r['tokens']} | {r['traces']} | {r['prompt_tokens']} | "
                    f"{r['after_load_kib'] / 1024:.0f} | {r['after_warm_kib'] / 1024:.0f} | {r['hwm_kib'] / 1024:.0f} | "
                    f"**{r['growth_mib']:.0f}** | {r['maxrss_after_kib'] / 1024:.0f} | {r['maxrss_growth_mib']:.0f} | "
                    f"{r['rss_end_kib'] / 1024:.0f} | {r['seconds']:.0f} |")
    table = "\n".join([
        "| run | output tokens | traces | prompt tokens | RSS after load MiB | RSS after warm-up MiB | peak RSS MiB | "
        "peak growth MiB | ru_maxrss MiB | ru_maxrss - after warm-up MiB | RSS at end MiB | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *rows])
    bounded = ratio <= 1.15 or (l_["growth_mib"] - s["growth_mib"]) < 32
    linear = s["growth_mib"] * l_["tokens"] / s["tokens"]
    verdict = (f"Peak growth large / small = **{ratio:.2f}** ({l_['growth_mib']:.0f} MiB vs {s['growth_mib']:.0f} MiB "
               f"for {l_['tokens'] / s['tokens']:.3g}x the tokens; growth in proportion to the tokens would be "
               f"{linear:.0f} MiB): " + ("memory does not grow with the number of tokens." if bounded else
                                         "**memory grows with the number of tokens** (goal missed)."))
    trail = (f"In the large run the peak growth had reached {early_mib:.0f} MiB once it had verified "
             f"{s['tokens']} tokens, and {l_['growth_mib']:.0f} MiB at the end ({len(l_['trajectory'])} score blocks).")
    split = (f"The forward pass alone (hidden + lm_head blocks, no scoring) over the small set peaks at "
             f"{b['growth_mib']:.0f} MiB: scoring a block adds about {s['growth_mib'] - b['growth_mib']:.0f} MiB on top "
             f"(the lm_head block itself is 512 x {l_['vocab_size']:,} fp32 = {512 * l_['vocab_size'] * 4 / MIB:.0f} MiB).")
    print("\n" + table + "\n\n" + verdict + "\n" + trail + "\n" + split + f"\nru_maxrss-based ratio: {ratio_ru:.2f}")
    hwm_note = ("VmHWM was reset just before verification, so the peak is the verification's own." if
                all(r["hwm_reset"] for r in res.values()) else
                "**the kernel refused to reset VmHWM**: the peak includes the model load.")
    lines = [
        "# Verification memory",
        "",
        f"Command: `{command}`  ",
        f"Date: {started:%Y-%m-%d %H:%M %Z}  ",
        f"Machine: {mach}  ",
        f"Load average (1/5/15 min) at start {load_before}  ",
        f"Setup: {args.model} fp32 (vocab {l_['vocab_size']:,}); sampling `{args.profile}` = {PROFILES[args.profile]}; "
        f"synthetic traces of {args.seq_len} tokens (a real chitchat prompt through the chat template, then "
        f"output token ids drawn uniformly from the vocabulary with seed {args.seed}: the scores are "
        f"meaningless, the work per token is real); prefill token budget {args.token_budget}, row block 512; "
        "each size in a fresh subprocess, verified as `verinfer.scoring.traces.score_traces` does (`verify_traces` "
        "streaming the scores to Parquet through `ScoreWriter`, compact columns kept).",
        "",
        table,
        "",
        verdict,
        "",
        trail,
        "",
        split,
        "",
        f"- *peak growth* = VmHWM during verification - VmRSS after warm-up (MiB). {hwm_note}",
        "- *RSS after warm-up*: the weights are memory-mapped from the safetensors cache and become resident "
        "only when a forward pass first touches them, so one 16-token forward (and lm_head) runs before the "
        "baseline is read; without it the first micro-batch's page-in of the weights (about "
        f"{(s['after_warm_kib'] - s['after_load_kib']) / 1024:.0f} MiB) would count as verification memory.",
        f"- *ru_maxrss - after warm-up*: the method of `getrusage` alone (peak over the whole process life, the "
        f"load included); ratio large / small {ratio_ru:.2f}. Where the load's own peak is higher than "
        "verification's, this figure shows the load, not verification.",
        "- What stays resident per token is only the compact score columns that `score_traces` returns "
        "(a few bytes per token) and the traces themselves.",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
