"""What `verinfer diagnose` says about providers, and the deviation's class when no candidate names the cause.

    python experiments/deviation_class.py --out experiments/results/deviation_class.md

Each provider serves ``--prompts`` chitchat prompts (up to ``--max-tokens`` tokens) claiming T 1, top-k 50,
top-p 0.95 with seed 9100 + i on the bundled SmolLM2-135M, and runs something else: a catalogue variant
or family member (``simulate.variants``). Each set is diagnosed as a user runs it: ``verinfer.diagnose``
with the shipped calibration for the claim (so verify's verdict and its sampler-shape detectors are
beside the diagnosis) and no ``--variants``, so that model-side causes have no candidate and the class
has to carry the answer. The expected class is the kind of change the provider made; the table says
whether diagnose named the cause (a candidate), gave the right class, or neither.

``--profile vllm-v1`` runs the same cases on vLLM V1's step-keyed sampler, where a hidden system prompt
moves no noise (RESULTS.md section 34).
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
import time
from pathlib import Path

import torch

from verinfer import api
from verinfer.files import write_atomic
from verinfer.machine import describe
from verinfer.prompts import load_prompts
from verinfer.sampling.params import SamplingParams
from verinfer.simulate.generate import build_requests
from verinfer.simulate.variants import get_variant

# (variant, expected class, the candidate label that names it when the grid has one)
CASES = [
    ("honest", None, "claim"),
    ("bf16", None, "claim"),
    ("top-k-40", "sampler", "top-k 40"),
    ("temperature-1.1", "sampler", "temperature 1.1"),
    ("w8-channel", "numerics", None),
    ("w4-g128", "weights", None),
    ("w4-g32-asym", "weights", None),
    ("layers-28", "weights", None),
    ("layers-24", "weights", None),
    ("system-prompt:Be concise.", "context", None),
    ("system-prompt:You are a pirate. Answer in pirate speak.", "context", None),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--profile", default="vllm")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    ref = api.load_model()
    claim = SamplingParams(profile=args.profile, temperature=1.0, top_k=50, top_p=0.95, seed=9100)
    requests = build_requests(ref, load_prompts("chitchat", args.prompts), claim)
    rows, right, flagged, honest = [], 0, 0, 0
    start = time.time()
    for name, expected, label in CASES:
        traces = get_variant(name).generate(ref, requests, max_new_tokens=args.max_tokens, batch_size=8)
        d = api.diagnose(traces, backend=ref)
        shaped = d.shaped
        named = d.best.candidate.label if (d.claim_rejected and d.explained) or d.best.candidate.label == "claim" else None
        kind = shaped.kind if shaped is not None and shaped.kind and ("shaped" in d.text) else None
        if expected is None:
            ok = not d.deviates and named == "claim"
            honest += ok
        elif not d.deviates:
            ok = None  # not detected at this size: nothing to name or class
        else:
            flagged += 1
            ok = expected == "context" if d.context_led else (label is not None and named == label) or kind == expected
            right += ok
        v = d.verdict
        rows.append(f"| {name} | {expected or 'honest'} | {'CONSISTENT' if v and v.consistent else 'INCONSISTENT'} "
                    f"(p {v.p:.2g}, {v.decided_by}) | {named or '-'} | {kind or '-'} | {'not flagged' if ok is None else 'yes' if ok else '**no**'} | "
                    f"{d.claim.exact:.1%} | {d.text[:160].replace('|', '/')}... |")
        print(rows[-1], flush=True)
    text = [
        "# The deviation's class when no candidate names the cause", "",
        f"Command: `python experiments/deviation_class.py {shlex.join(sys.argv[1:])}`  ",
        f"Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC  ",
        f"Machine: {describe(torch.get_num_threads())}  ",
        f"Setup: SmolLM2-135M fp32 reference; {args.prompts} chitchat prompts x up to {args.max_tokens} tokens; "
        f"claims profile {args.profile}, T 1, top-k 50, top-p 0.95; `verinfer.diagnose` with the shipped "
        f"calibration, no --variants; {time.time() - start:.0f} s in all.", "",
        f"**Honest providers kept: {honest}/{sum(e is None for _, e, _ in CASES)}; misconfigured providers flagged: "
        f"{flagged}/{sum(e is not None for _, e, _ in CASES)}; of those flagged, the cause named or the right class: "
        f"{right}/{flagged}.**", "",
        "| provider | expected | verify | named | class | right | claim exact | conclusion (start) |",
        "|---|---|---|---|---|---|---:|---|", *rows, ""]
    write_atomic(args.out, "\n".join(text))


if __name__ == "__main__":
    main()
