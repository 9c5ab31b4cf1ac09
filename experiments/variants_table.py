"""Exact match, margin and cross-entropy per configuration variant (a quick table, few tokens).

    python experiments/variants_table.py [VARIANTS]   (comma-separated; default: every one below)

16 chitchat prompts x 48 tokens, vLLM sampler (T=1, top-k 50, top-p 0.95, seeds 5000 + i), generation
batch 8, fp32 verifier on this machine. Single runs: a first look, not the AUC evaluation.
"""

from __future__ import annotations

import argparse

import torch

from verinfer.simulate import variants
from verinfer.studies.adversary import score_traces
from verinfer.models.backend import Backend
from verinfer.simulate.generate import build_requests
from verinfer.prompts import load_prompts
from verinfer.sampling.params import SamplingParams

DEFAULT = ("honest", "bf16", "w4", "w8", "fp8-kv", "temperature-1.1", "wrong-seed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="?", default=",".join(DEFAULT),
                        help="comma-separated variant names (default: %(default)s)")
    names = parser.parse_args().variants.split(",")
    try:
        chosen = [variants.get_variant(name) for name in names]
    except KeyError as exc:
        parser.error(exc.args[0])
    torch.set_num_threads(1)
    reference = Backend.load()
    requests = build_requests(reference, load_prompts("chitchat", 16, seed=0),
                              SamplingParams(profile="vllm", temperature=1.0, top_k=50, top_p=0.95, seed=5000))
    print("| variant | tokens | exact match | mean margin (clip 20) | mean cross-entropy | filtered |")
    print("|---|---|---|---|---|---|")
    for name, variant in zip(names, chosen):
        s = score_traces(reference, variant.generate(reference, requests, 48, 8))
        print(f"| {name} | {s.tokens} | {s.exact_match:.1%} | {s.mean_margin:.3f} | {s.mean_cross_entropy:.3f} | "
              f"{s.filtered:.1%} |", flush=True)


if __name__ == "__main__":
    main()
