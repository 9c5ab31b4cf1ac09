"""How often the alignment's count repair finds the tokens a provider sampled (issue #41 item 5).

A text-only provider's sampled tokens are often not the canonical tokenization of their text. With
the claimed seed the replay shows where (a tokenization break); with another seed (a seed-rewriting
proxy) it shows nothing, and the alignment repairs the count the provider reported by the likeliest
split or merge that keeps the text (``verinfer.scoring.alignment.likeliest_edit``). This script
samples outputs with the bundled model (vLLM sampler, T = 1, top-k 50, top-p 0.95, 32 tokens, seed
``--seed``), keeps those whose text re-tokenizes to another count, aligns each against replays with
another seed (``--seed + 1``) given the sampled count, and prints how many came back as the sampled
ids exactly, how many with the right count, and how many tokens were left unscored (a re-split at a
break the wrong seed's replay allows, when it brings the count to usage's, leaves one position; an
edit two)::

    python experiments/alignment_edits.py --prompts 128
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from verinfer.api import generate  # noqa: E402
from verinfer.machine import describe  # noqa: E402
from verinfer.models.backend import Backend  # noqa: E402
from verinfer.prompts import load_prompts  # noqa: E402
from verinfer.scoring.alignment import align  # noqa: E402
from verinfer.scoring.traces import replayer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--set", default="chitchat")
    parser.add_argument("--seed", type=int, default=100)
    args = parser.parse_args()
    backend = Backend.load("smollm2-135m")
    tok = backend.tokenizer
    stops = {backend.tokenizer.eos_token_id}
    sampled = generate(load_prompts(args.set, args.prompts, seed=7), n=args.prompts, backend=backend, seed=args.seed,
                       top_k=50, top_p=0.95, max_tokens=32)
    cases = []
    for t in sampled:
        body = [i for i in t.output_token_ids if i not in stops]
        text = tok.decode(body, skip_special_tokens=True)
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) != len(body) and "\ufffd" not in text:
            cases.append((t, body, text, ids))
    print(f"{len(cases)} of {len(sampled)} outputs re-tokenize to another count ({describe(torch.get_num_threads())})", flush=True)
    if not cases:
        return
    wrong = [replace(t, output_token_ids=ids, sampling=replace(t.sampling, seed=t.sampling.seed + 1))
             for t, _, _, ids in cases]

    aligned = align([(ids, text) for _, _, text, ids in cases], replayer(backend, wrong), tok,
                    counts=[(len(body),) for _, body, _, _ in cases])
    exact = sum(a.ids == body for a, (_, body, _, _) in zip(aligned, cases))
    counted = sum(len(a.ids) == len(body) for a, (_, body, _, _) in zip(aligned, cases))
    left = sum(len(a.realigned) for a in aligned)
    tokens = sum(len(body) for _, body, _, _ in cases)
    for a, (t, body, text, ids) in zip(aligned, cases):
        print(f"  {t.id}: {len(ids)} -> {len(a.ids)} tokens (sampled {len(body)}), "
              f"{'the sampled ids' if a.ids == body else 'other ids'}, unscored {a.realigned}")
    print(f"wrong-seed replays: {exact}/{len(cases)} outputs repaired to the sampled ids exactly, "
          f"{counted}/{len(cases)} to the sampled count; {left} of {tokens} of their tokens unscored "
          f"({left / tokens:.1%}); a count still off would cut its output at its first mismatch")


if __name__ == "__main__":
    main()
