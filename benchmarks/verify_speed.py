"""Verification throughput against a bare forward pass, and against generating the same tokens.

Usage: python benchmarks/verify_speed.py [--model M] [--claims KIND] [--prompts N] [--new-tokens N] [--rounds N]
       [--no-cache]

``--model`` picks the reference (``gemma3-270m``: a 262,144-token vocabulary); ``--claims`` what the
traces claim (issue #40: scoring must cost about a prefill on off-policy claims too):
    honest      the settings the traces were generated with (default)
    wrong-seed  the same tokens claimed under another seed (about half of them mismatch)
    top-k-5     claimed as sampled with top-k 5 (sampled tokens beyond the top 5 are filtered out)

(a) For each sampler case, the same traces go through
      bare:   ``Backend.prefill`` (hidden + lm_head, same micro-batches and row blocks), blocks discarded
      verify: ``verify_traces`` (that same prefill, plus Token-DiFR scoring of every row)
    A and B alternate within each round (A/B in even rounds, B/A in odd ones); the table shows medians
    over rounds and the ratio verify/bare. The goal is that scoring adds under 10% to the forward pass.
    "scoring share" is the time spent inside ``score_block`` during the verify runs (median) divided by
    the median bare time: the same quantity measured from inside, less exposed to a noisy machine.
(b) The vLLM top-k 50 / top-p 0.95 traces are generated again in the middle of the rounds (batched
    KV-cache decoding with the batch size they were made with, and with batch 1), checked to be
    token-identical to the cached ones, and timed: the ratio of verify tokens/s to generate tokens/s.

The machine is shared: only ratios measured side by side in this run are claims, absolute times are not.
Times are process CPU time with one torch thread by default (``--threads``): on this shared 2-core
machine two OpenMP threads spin against other jobs and measured the same prefill 4x slower than one.
Traces are generated once and cached in the temp dir (``--no-cache`` regenerates them).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

import verinfer  # noqa: E402
import verinfer.scoring.token_difr as token_difr  # noqa: E402
from verinfer.machine import describe  # noqa: E402
from verinfer.simulate.generate import generate  # noqa: E402
from verinfer.models.backend import Backend  # noqa: E402
from verinfer.simulate.generate import build_requests  # noqa: E402
from verinfer.prompts import load_prompts  # noqa: E402
from verinfer.sampling.params import SamplingParams  # noqa: E402
from verinfer.trace import read_traces, write_traces  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GOAL = 0.10  # scoring may add at most 10% to the bare forward pass

CASES = [
    ("vllm, top-k 50, top-p 0.95", SamplingParams("vllm", 1.0, 50, 0.95)),
    ("vllm, top-p 0.95", SamplingParams("vllm", 1.0, -1, 0.95)),
    ("vllm, no filters (T=1, full vocab)", SamplingParams("vllm", 1.0, -1, 1.0)),
    ("vllm fp64, no filters", SamplingParams("vllm", 1.0, -1, 1.0, fp64_gumbel=True)),
    ("greedy", SamplingParams("greedy", 0.0)),
    ("vllm-v1, top-k 50, top-p 0.95", SamplingParams("vllm-v1", 1.0, 50, 0.95)),
    ("vllm-cpu, top-k 50, top-p 0.95", SamplingParams("vllm-cpu", 1.0, 50, 0.95)),
    ("vllm-cpu, no filters", SamplingParams("vllm-cpu", 1.0, -1, 1.0)),
    ("sglang, no filters", SamplingParams("sglang", 1.0, -1, 1.0)),
    ("vllm-v1, no filters", SamplingParams("vllm-v1", 1.0, -1, 1.0)),
    ("vllm-v1-cuda, no filters", SamplingParams("vllm-v1-cuda", 1.0, -1, 1.0)),
    # transformers: as `torch.manual_seed(seed); model.generate(batch)` samples, every request of a generation
    # batch has the one seed and its row of the batch's stream (the generator records the place; the vocab
    # is filled in from the model)
    ("transformers, top-k 50, top-p 0.95", SamplingParams("transformers", 1.0, 50, 0.95,
                                                          stream={"batch_size": 1, "row": 0})),
    ("transformers, no filters", SamplingParams("transformers", 1.0, -1, 1.0, stream={"batch_size": 1, "row": 0})),
    ("llama.cpp, top-k 50, top-p 0.95", SamplingParams("llama.cpp", 1.0, 50, 0.95)),
    ("llama.cpp, no filters", SamplingParams("llama.cpp", 1.0, -1, 1.0)),
]
GEN_CASE = 0  # the case whose generation is re-timed for (b)
CLAIMS = ("honest", "wrong-seed", "top-k-5")


def claimed(trace, kind: str):
    """The trace as ``--claims`` has it claim its sampling (greedy traces stay as they are)."""
    s = trace.sampling
    if kind == "honest" or s.is_greedy:
        return trace
    return dataclasses.replace(trace, sampling=s.with_(seed=s.seed + 1) if kind == "wrong-seed" else s.with_(top_k=5))


def machine() -> str:
    return describe(torch.get_num_threads())


def load_avg() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


class Clock:
    """Wall and process CPU seconds since creation."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


class ScoringTimer:
    """Wraps ``token_difr.score_block`` (the module global ``verify_traces`` calls) to time it."""

    def __init__(self):
        self.wall = self.cpu = 0.0
        self._orig = token_difr.score_block

    def __enter__(self):
        def timed(*args, **kwargs):
            clock = Clock()
            try:
                return self._orig(*args, **kwargs)
            finally:
                w, c = clock.read()
                self.wall += w
                self.cpu += c

        token_difr.score_block = timed
        return self

    def __exit__(self, *_):
        token_difr.score_block = self._orig


def cached_traces(be, prompts, params, args, cache_dir: Path | None):
    """Traces for one case: from the cache when present, else generated (timed) and cached."""
    reqs = build_requests(be, prompts, params.with_(seed=None if params.is_greedy else args.seed),
                          seed_stride=0 if params.profile == "transformers" else 1)  # one seed a generate call
    key_src = json.dumps({"model": be.model_id, "prompts": [r.prompt_token_ids for r in reqs],
                          "params": [r.params.to_dict() for r in reqs], "new": args.new_tokens,
                          "batch": args.batch_size, "verinfer": verinfer.__version__,
                          "torch": torch.__version__}, sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    if cache_dir is not None:
        path = cache_dir / f"{key}.traces.jsonl"
        meta = cache_dir / f"{key}.json"
        if path.exists() and meta.exists():
            return reqs, read_traces(path), json.loads(meta.read_text())["generate_s"], True
    t0 = time.perf_counter()
    traces = generate(be, reqs, args.new_tokens, args.batch_size)
    seconds = time.perf_counter() - t0
    if cache_dir is not None:
        write_traces(traces, path)
        meta.write_text(json.dumps({"generate_s": seconds}))
        traces = read_traces(path)
    return reqs, traces, seconds, False


def bare_pass(be, seqs, starts, args) -> tuple[float, float]:
    """(wall, CPU) seconds of the forward pass alone."""
    clock = Clock()
    for _ in be.prefill(seqs, starts, token_budget=args.token_budget, row_block=args.row_block):
        pass
    return clock.read()


def verify_pass(be, traces, args):
    """(wall, CPU) seconds, (wall, CPU) seconds inside score_block, exact-match rate."""
    match = total = 0
    with ScoringTimer() as timer:
        clock = Clock()
        for block in token_difr.verify_traces(be, traces, token_budget=args.token_budget, row_block=args.row_block):
            match += int(block.columns["exact_match"].sum())
            total += len(block.items)
        spent = clock.read()
    return spent, (timer.wall, timer.cpu), match / max(total, 1)


def med(xs, i):
    return statistics.median(x[i] for x in xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="chitchat prompts per case (default 8)")
    parser.add_argument("--new-tokens", type=int, default=48, help="max new tokens per trace (default 48)")
    parser.add_argument("--batch-size", type=int, default=8, help="generation batch size (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="A/B rounds per case (default 3)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared machine 2 OpenMP threads mostly measure contention)")
    parser.add_argument("--token-budget", type=int, default=4096, help="prefill micro-batch budget (library default)")
    parser.add_argument("--row-block", type=int, default=512, help="lm_head row block (library default)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--prompt-seed", type=int, default=0)
    parser.add_argument("--no-cache", action="store_true", help="generate traces afresh instead of the temp-dir cache")
    parser.add_argument("--cases", default=None,
                        help="case names to run, separated by ';' (default: all), e.g. 'vllm, top-k 50, top-p 0.95'")
    parser.add_argument("--model", default="smollm2-135m", help="reference model (default smollm2-135m)")
    parser.add_argument("--claims", choices=CLAIMS, default="honest", help="what the traces claim (docstring)")
    parser.add_argument("--out", type=Path, default=RESULTS / "verify_speed.md")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    cases = CASES
    if args.cases:
        wanted = [c.strip() for c in args.cases.split(";")]
        unknown = sorted(set(wanted) - {name for name, _ in CASES})
        if unknown:
            parser.error(f"unknown case(s) {unknown}; known: {[name for name, _ in CASES]}")
        cases = [(name, params) for name, params in CASES if name in wanted]
    torch.set_num_threads(args.threads)
    command = " ".join(["python benchmarks/verify_speed.py", *sys.argv[1:]])
    started = dt.datetime.now().astimezone()
    load_before = load_avg()
    print(f"# {machine()}\n# load average at start {load_before}", flush=True)

    be = Backend.load(args.model)
    prompts = load_prompts("chitchat", args.prompts, seed=args.prompt_seed)
    cache_dir = None if args.no_cache else Path(tempfile.gettempdir()) / "verinfer-bench-cache"
    if cache_dir:
        cache_dir.mkdir(parents=True, exist_ok=True)

    data = []
    for name, params in cases:
        if params.stream is not None and "vocab" not in params.stream and params.profile == "transformers":
            params = params.with_(stream={**params.stream, "vocab": be.vocab_size})
        reqs, traces, gen_s, cached = cached_traces(be, prompts, params, args, cache_dir)
        traces = [claimed(t, args.claims) for t in traces]
        seqs = [t.prompt_token_ids + t.output_token_ids for t in traces]
        starts = [len(t.prompt_token_ids) for t in traces]
        n_out = sum(len(t.output_token_ids) for t in traces)
        print(f"{name}: {len(traces)} traces, {sum(starts)} prompt + {n_out} output tokens "
              f"({'cached' if cached else f'generated in {gen_s:.1f} s'})", flush=True)
        data.append(dict(name=name, reqs=reqs, traces=traces, seqs=seqs, starts=starts, n_out=n_out,
                         n_prompt=sum(starts), gen_s=gen_s, cached=cached, bare=[], verify=[], scoring=[], match=None))

    bare_pass(be, data[0]["seqs"], data[0]["starts"], args)  # warm-up
    regen = []
    for r in range(args.rounds):
        for d in data:
            for what in (("bare", "verify") if r % 2 == 0 else ("verify", "bare")):
                if what == "bare":
                    d["bare"].append(bare_pass(be, d["seqs"], d["starts"], args))
                else:
                    spent, scoring, d["match"] = verify_pass(be, d["traces"], args)
                    d["verify"].append(spent)
                    d["scoring"].append(scoring)
            print(f"round {r + 1}: {d['name']}: bare {d['bare'][-1][0]:.2f} s, verify {d['verify'][-1][0]:.2f} s "
                  f"(scoring {d['scoring'][-1][0]:.2f} s) wall", flush=True)
        if r == (args.rounds - 1) // 2:  # (b): generation timed in the middle of the rounds
            g = data[GEN_CASE]
            for bs in dict.fromkeys((args.batch_size, 1)):
                clock = Clock()
                fresh = generate(be, g["reqs"], args.new_tokens, bs)
                spent = clock.read()
                same = [t.output_token_ids for t in fresh] == [t.output_token_ids for t in g["traces"]]
                regen.append((bs, spent, same))
                print(f"generation of the {g['name']} traces, batch {bs}: {spent[0]:.2f} s wall, {spent[1]:.2f} s "
                      f"CPU; identical to the cached traces (made with batch {args.batch_size}): {same}", flush=True)

    rows_a, verdicts = [], []
    for d in data:
        bw, bc, vw, vc = med(d["bare"], 0), med(d["bare"], 1), med(d["verify"], 0), med(d["verify"], 1)
        sc = med(d["scoring"], 1)
        rest = [(v[1] - s[1],) for v, s in zip(d["verify"], d["scoring"])]  # verify's CPU time outside scoring
        per_round = ", ".join(f"{v[1] / b[1]:.2f}" for v, b in zip(d["verify"], d["bare"]))
        ok = vc / bc - 1 < GOAL and sc / bc < GOAL
        verdicts.append((d["name"], vc / bc, sc / bc, vw / bw, ok))
        rows_a.append(f"| {d['name']} | {d['n_prompt']} + {d['n_out']} | {bc:.2f} | {vc:.2f} | **{vc / bc:.2f}** "
                      f"({per_round}) | {sc / bc:.1%} | {sc / d['n_out'] * 1e3:.2f} | {med(rest, 0) / bc:.2f} | "
                      f"{vw / bw:.2f} | {d['n_out'] / vw:.0f} | {d['match']:.1%} | "
                      f"{'met' if ok else '**missed**'} |")
    g = data[GEN_CASE]
    gw, gc = med(g["verify"], 0), med(g["verify"], 1)
    rows_b = [f"| {g['name']} | {len(g['traces'])} x up to {args.new_tokens} | {bs} | {g['n_out']} | {spent[1]:.2f} | "
              f"{gc:.2f} | **{spent[1] / gc:.1f}x** | {spent[0] / gw:.1f}x | {g['n_out'] / spent[0]:.1f} / "
              f"{g['n_out'] / gw:.1f} | {'yes' if same else '**no**'} |" for bs, spent, same in regen]
    cold = [d for d in data if not d["cached"]]
    rows_cold = [f"| {d['name']} | {d['n_out']} | {d['gen_s']:.1f} | {d['n_out'] / d['gen_s']:.1f} |" for d in cold]

    table_a = "\n".join([
        "| case | prompt + output tokens | bare CPU s | verify CPU s | verify / bare, CPU (per round) | scoring share "
        "(CPU) | scoring CPU ms / token | verify minus scoring / bare, CPU | verify / bare, wall | verify output tok/s (wall) | exact match | goal < 10% |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|", *rows_a])
    table_b = "\n".join([
        "| traces | shape | generation batch | output tokens | generate CPU s | verify CPU s | verify speed-up, CPU | "
        "verify speed-up, wall | tok/s (wall) generate / verify | regenerated = cached |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|", *rows_b])
    print("\n(a) verification vs a bare forward pass (medians over rounds)\n" + table_a)
    print("\n(b) verification vs generation\n" + table_b)
    if rows_cold:
        print("\ngeneration when the traces were first made (this run, wall, not interleaved)\n"
              "| case | output tokens | generate s | tok/s |\n|---|---:|---:|---:|\n" + "\n".join(rows_cold))

    missed = [v for v in verdicts if not v[4]]
    traces_note = ("read from the temp-dir cache" if not cold else
                   "generated in this run" if len(cold) == len(data) else "partly read from the temp-dir cache")
    lines = [
        "# Verification speed",
        "",
        f"Command: `{command}`  ",
        f"Date: {started:%Y-%m-%d %H:%M %Z}  ",
        f"Machine: {machine()}  ",
        f"Load average (1/5/15 min) at start {load_before}, at end {load_avg()}  ",
        f"Setup: {be.model_id} fp32, vocab {be.vocab_size}; claims: {args.claims}; {len(prompts)} chitchat prompts (sample seed "
        f"{args.prompt_seed}), up to {args.new_tokens} new tokens each, request seeds from {args.seed}; prefill "
        f"token budget {args.token_budget}, row block {args.row_block}; {args.rounds} rounds, A/B order alternating "
        f"by round; traces {traces_note}.",
        "",
        "Absolute times are not claims (the 2-core machine is shared with other jobs); the ratios are, because",
        "both sides run in the same process, alternating, on the same traces. CPU time (process time, one torch",
        "thread) is the primary measure: it counts the work done and is far less disturbed by other processes",
        "than wall time; wall-time ratios are shown beside it.",
        "",
        "## (a) Verification vs a bare forward pass (hidden + lm_head, same batching)",
        "",
        table_a,
        "",
        "- *verify / bare*: time of `verify_traces` over time of `Backend.prefill` alone on the same traces "
        "(medians over rounds); 1.00 means scoring is free, 1.10 means it adds 10%. Per-round CPU ratios in "
        "brackets show the noise.",
        "- *scoring share*: median CPU time inside `score_block` during the verify runs over the median bare "
        "CPU time: the scoring overhead measured from inside the verify run; *scoring CPU ms / token* is the same "
        "time per scored output token.",
        "- *verify minus scoring / bare*: the verify runs' CPU time outside `score_block` (their own prefill and "
        "bookkeeping) over the bare time: the same prefill timed in two passes, so its distance from 1.00 is the "
        "machine's noise in the ratio above.",
        "- *exact match*: share of claimed tokens the verifier's sampler reproduces (honest traces; fp32 prefill "
        "vs KV-cache decode).",
        "",
        "Goal (scoring adds under 10%, both by the ratio and by the scoring share): " + (
            "met for every case." if not missed else "**missed** for " + "; ".join(
                f"{n} (verify/bare {r:.2f} CPU, {w:.2f} wall; scoring share {s:.0%})" for n, r, s, w, _ in missed)
            + "; met for the others."),
        "",
        "## (b) Verification vs generating the same tokens",
        "",
        table_b,
        "",
        "Generation is the provider simulator (`verinfer.simulate.generate.generate`: batched KV-cache decoding with the "
        "same sampler), re-run in the middle of the rounds on the same requests, with the batch size the traces "
        "were made with and with batch 1 (the tokens must come out the same); verification is one prefill per "
        "trace plus scoring (median over rounds). *verify speed-up* is generate time / verify time for the same "
        "output tokens, i.e. the ratio of tokens per second. It grows with the output length (decoding is "
        f"sequential, the prefill is not; here outputs are at most {args.new_tokens} tokens after prompts of about "
        f"{g['n_prompt'] // len(g['traces'])}) and shrinks as the generation batch grows.",
    ]
    if rows_cold:
        lines += ["", "Generation times when the traces were first made in this run (wall, once each, not "
                  "interleaved; for orientation only):", "",
                  "| case | output tokens | generate s | tok/s |", "|---|---:|---:|---:|", *rows_cold]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
