"""Where a hidden system prompt's greedy traffic falls against the shipped greedy bands (issue #39 item 8:
its monitor window read "resembles fp8-KV-like").

Usage: python experiments/hidden_prompt_bands.py [--n 24] [--max-tokens 32] [--variants honest,...] [--out FILE]

Each variant (``verinfer.simulate.variants``: ``honest``, ``system-prompt:TEXT``, ...) answers ``--n``
chitchat prompts greedily (the provider saw TEXT as a system message; the traces claim the prompt
without it, as the gateway records the client's request), the bundled model in fp32 scores them, and
``pooled_verdict`` judges them against the shipped greedy bands, as the monitor does. Printed per
variant: the statistic, the verdict, the band whose 95% range holds it (``resembles``; none when no
range does) and the nearest band, and each band's range at this size.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from verinfer.api import load_model
from verinfer.auditing.bands import DATA_DIR, Bands, bands_filename
from verinfer.prompts import load_prompts
from verinfer.sampling.params import SamplingParams
from verinfer.scoring.traces import score_traces
from verinfer.simulate.generate import build_requests
from verinfer.simulate.variants import get_variant
from verinfer.stats.pooling import sequence_stats
from verinfer.stats.verdict import pooled_verdict

DEFAULT = "honest,bf16,system-prompt:Answer briefly and formally.,system-prompt:You are a pirate."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=7, help="which chitchat prompts (load_prompts' seed)")
    parser.add_argument("--variants", default=DEFAULT)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    backend = load_model("smollm2-135m")
    bands = Bands.load(DATA_DIR / bands_filename(backend.model_id, {"profile": "greedy"}))
    requests = build_requests(backend, load_prompts("chitchat", n=args.n, seed=args.seed),
                              SamplingParams(profile="greedy", seed=None), id_prefix="hidden-")
    lines = [f"`python experiments/hidden_prompt_bands.py --n {args.n} --max-tokens {args.max_tokens}` against "
             f"{Path(bands.source).name} (clip {bands.clip:.4f})\n",
             "| variant | mean clipped margin | verdict | resembles | nearest band | 95% ranges at this size |",
             "|---|---|---|---|---|---|"]
    for name in args.variants.split(","):
        traces = get_variant(name).generate(backend, requests, args.max_tokens, 8)
        seq = sequence_stats(score_traces(backend, traces).columns, bands.clip)
        v = pooled_verdict(seq, bands.honest_bands(), 0.01, all_bands=bands.labelled(), clip=bands.clip)
        ranges = "; ".join(f"{k} {r[0]:.4f}-{r[2]:.4f}" for k, r in v.band_ranges.items())
        lines.append(f"| {name} | {v.statistic:.4f} | {v.label} | {v.resembles or 'none'} | {v.nearest} | {ranges} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
