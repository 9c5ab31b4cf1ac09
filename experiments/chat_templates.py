"""Another chat template than the claimed model's: named by diagnose's template search (issue #41 item 1).

    python experiments/chat_templates.py --out experiments/results/chat_templates.md

Every template of ``verinfer.chat_templates`` (all of them, not drawn: the family has seven members) serves
``--prompts`` chitchat prompts (prompt seed 4107) of up to ``--max-tokens`` tokens on the bundled SmolLM2-135M
in fp32 (the ``chat-template:NAME`` variant), seeds 7100 + i, claiming SmolLM2's own template and the
profile's sampler at T 1, top-k 50, top-p 0.95, on two engines: vLLM's model runner V2 (``vllm``, noise keyed
by absolute position, where a prompt of another length also moves every draw) and V1 (``vllm-v1``, keyed by
the step). An honest provider on each is diagnosed the same way. Each set is diagnosed as a user runs it:
``verinfer.diagnose`` with the shipped calibration for the claim where one exists and no ``--variants``.

Columns: *verify* the calibrated verdict (none where no calibration ships for the claim); *named* whether the
best candidate is the served template and beats the claim; *class* the kind of cause stated (``context`` for
a template or a prompt offset).
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
from verinfer.chat_templates import TEMPLATES
from verinfer.files import write_atomic
from verinfer.machine import describe
from verinfer.prompts import load_prompts
from verinfer.sampling.params import SamplingParams
from verinfer.simulate.generate import build_requests
from verinfer.simulate.variants import get_variant

PROFILES = ("vllm", "vllm-v1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    ref = api.load_model()
    prompts = load_prompts("chitchat", args.prompts, seed=4107)
    rows, named, flagged, cases, honest_ok, start = [], 0, 0, 0, 0, time.time()
    for profile in PROFILES:
        claim = SamplingParams(profile=profile, temperature=1.0, top_k=50, top_p=0.95, seed=7100)
        requests = build_requests(ref, prompts, claim)  # request i: seed 7100 + i
        for name in (*TEMPLATES, None):
            variant = get_variant(f"chat-template:{name}" if name else "honest")
            traces = variant.generate(ref, requests, max_new_tokens=args.max_tokens, batch_size=8)
            t0 = time.time()
            d = api.diagnose(traces, backend=ref)
            v, b = d.verdict, d.best.candidate
            is_flagged = v is not None and not v.consistent
            right = d.claim_rejected and b.template == name
            kind = ("context" if b.axis == "prompt" else b.axis) if d.claim_rejected and d.explained else (
                d.shaped.kind if d.shaped is not None and "shaped" in d.text else None)
            if name is None:
                honest_ok += not d.claim_rejected and not is_flagged
            else:
                cases, named, flagged = cases + 1, named + right, flagged + is_flagged
            verdict = "-" if v is None else f"{'INCONSISTENT' if is_flagged else 'CONSISTENT'} (p {v.p:.2g})"
            rows.append(f"| {profile} | {name or 'honest (own template)'} | {verdict} | {b.named} | "
                        f"{d.best.exact:.1%} | {d.claim.exact:.1%} | {'-' if name is None else 'yes' if right else 'no'}"
                        f" | {kind or '-'} | {time.time() - t0:.0f} |")
            print(rows[-1], flush=True)
    text = [
        "# Another chat template, named by diagnose's template search (issue #41 item 1)", "",
        f"Command: `python experiments/chat_templates.py {shlex.join(sys.argv[1:])}`  ",
        f"Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC  ",
        f"Machine: {describe(torch.get_num_threads())}  ",
        f"Setup: SmolLM2-135M fp32; {args.prompts} chitchat prompts (seed 4107) x up to {args.max_tokens} tokens; "
        f"claims SmolLM2's own template, T 1, top-k 50, top-p 0.95; `verinfer.diagnose` with the shipped "
        f"calibration where one exists, no --variants; {time.time() - start:.0f} s in all.", "",
        f"- Providers with another template: {cases}; flagged by verify: **{flagged}/{cases}**; the served template "
        f"named: **{named}/{cases}**.",
        f"- Honest providers neither flagged nor named: **{honest_ok}/{len(PROFILES)}**.", "",
        "| engine | served template | verify | best candidate | its exact | claim's exact | named | class | s |",
        "|---|---|---|---|---:|---:|---|---|---:|", *rows, ""]
    write_atomic(args.out, "\n".join(text))


if __name__ == "__main__":
    main()
