"""Generate verinfer traces with the real Hugging Face ``model.generate`` (profile ``transformers``).

Runs verinfer's bundled model (the same transformers ``LlamaForCausalLM`` verinfer verifies with,
fp32, CPU) on verinfer's rendered chat prompts in left-padded batches, exactly as a user would:
``torch.manual_seed(seed)`` then ``model.generate(do_sample=True, ...)`` with every sampling knob
passed explicitly (``top_k`` defaults to 50 otherwise). Each trace records the unpadded prompt
ids, the output up to and including the first stop token, the seed given to ``manual_seed`` and
``sampling.stream = {batch_size, row, vocab}``. Greedy runs use ``do_sample=False`` (profile
``greedy``). Then: ``verinfer verify OUT.jsonl``.

    python engines/transformers/generate.py --out /tmp/hf.jsonl --n 16 --batch-size 8 --max-tokens 64
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

from verinfer.api import load_model
from verinfer.prompts import load_prompts, render
from verinfer.sampling.params import SamplingParams
from verinfer.trace import Trace, write_traces

CONFIGS = {  # name -> (do_sample, temperature, top_k, top_p); top_k 0 disables HF's default of 50
    "greedy": (False, 1.0, 0, 1.0),
    "t1-k50-p095": (True, 1.0, 50, 0.95),
    "t1-nofilter": (True, 1.0, 0, 1.0),
}


def generate_batch(backend, prompts: list[list[int]], config: str, seed: int, max_tokens: int):
    """One real ``generate`` call on a left-padded batch; returns the outputs (stop token kept)."""
    do_sample, temperature, top_k, top_p = CONFIGS[config]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), backend.pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    stops = sorted(backend.stop_ids())
    torch.manual_seed(seed)
    kwargs = dict(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, min_p=None) if do_sample \
        else dict(do_sample=False)
    out = backend.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 pad_token_id=backend.pad_id, eos_token_id=stops, **kwargs)
    outputs = []
    for r in range(len(prompts)):
        toks = out[r, width:].tolist()
        cut = next((i + 1 for i, t in enumerate(toks) if t in stops), len(toks))
        outputs.append(toks[:cut])
    return outputs, out.shape[0]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", default="chitchat")
    ap.add_argument("--n", type=int, default=8, help="prompts per configuration")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1234, help="torch.manual_seed of the first batch (+1 per batch)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    backend = load_model("smollm2-135m", "float32")
    backend.model.eval()
    prompts = load_prompts(args.prompts, args.n)
    rendered = [render(backend.tokenizer, p) for p in prompts]
    traces = []
    for config in args.configs.split(","):
        do_sample, temperature, top_k, top_p = CONFIGS[config]
        for b, lo in enumerate(range(0, len(prompts), args.batch_size)):
            batch = rendered[lo: lo + args.batch_size]
            seed = args.seed + b
            t0 = time.time()
            outputs, rows = generate_batch(backend, batch, config, seed, args.max_tokens)
            print(f"{config} batch {b}: {len(batch)} rows, {sum(map(len, outputs))} tokens, {time.time() - t0:.1f}s",
                  flush=True)
            for r, (prompt, output) in enumerate(zip(batch, outputs)):
                if do_sample:
                    params = SamplingParams(profile="transformers", temperature=temperature, top_k=top_k or -1,
                                            top_p=top_p, seed=seed,
                                            stream={"batch_size": rows, "row": r, "vocab": backend.vocab_size})
                else:
                    params = SamplingParams(profile="greedy", temperature=0.0)
                p = prompts[lo + r]
                traces.append(Trace.of_output(
                    f"hf-{config}-{p.id}", "smollm2-135m", prompt, output, params, tokenizer=backend.tokenizer,
                    provider=f"transformers-{transformers.__version__}",
                    meta={"engine": "transformers", "transformers": transformers.__version__,
                          "torch": torch.__version__, "batch": b, "padded_width": max(map(len, batch)),
                          "left_pad": max(map(len, batch)) - len(prompt)},
                    messages=p.message_dicts() or None))
    write_traces(traces, args.out)
    print(f"wrote {len(traces)} traces, {sum(len(t.output_token_ids) for t in traces)} tokens to {args.out}")


if __name__ == "__main__":
    main()
