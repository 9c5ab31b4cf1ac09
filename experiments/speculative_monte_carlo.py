"""Monte Carlo verification of speculative decoding without mode metadata (DiFR appendix B.1), against
the exact seeded replay (appendix F).

    HF_HUB_OFFLINE=1 nice python experiments/speculative_monte_carlo.py --out experiments/results/speculative_monte_carlo.md

On the bundled SmolLM2-135M (fp32 reference), the speculative provider simulator
(``simulate.speculative.generate_speculative``, vLLM 0.32 V2 rejection sampler, draft ``layers:28``,
k = 4, T = 1, no top-k/top-p) generates, for the same chitchat prompts, one trace per prompt for each
class, each claiming the honest configuration with its own seeds:

- ``honest``: rule ``vllm`` (the honest sampler);
- ``draft-only``: every proposal returned unchecked, the bonus from the draft too (cheap-model cheat);
- ``top1``: a draft is accepted iff it is the target's top-1 token (wrong acceptance rule);
- ``w4``: the honest rule with a 4-bit target (RTN, groups of 128) and the honest fp32 draft;
- ``wrong-seed``: the honest sampler run with seed s + 1 while the trace claims s.

Every trace is scored twice on the fp32 reference: (a) the exact seeded replay
(``scoring.token_difr.verify_traces``, column ``margin``, modes from ``spec_modes``; also with the
modes removed, so the replay reconstructs them) and (b) the seed-free Monte Carlo score of
``scoring.monte_carlo`` (the sampler run as a black box on noise-perturbed logits with fresh
randomness, N draws per token). The noise model is fitted here on honest data: per-token logit
differences between a bf16 copy of the target/draft and the fp32 models, over the honest traces.

Detection power follows ``stats.power`` (the repo's DiFR section 5.2 protocol): per-token scores split
50/50 by sequence, percentiles and orientation from honest training tokens, random batches of n test
tokens, AUC at 1% FPR with a bootstrap interval; TPR at 1% FPR is the share of bad test batches above
the 99th percentile of honest test batches of the same size. With a few dozen sequences per class the
large batch sizes resample a small pool (an extrapolation that treats tokens as independent).

Generated traces are cached under ``$VERINFER_CACHE/experiments/speculative_monte_carlo/<settings>/``
(one file per class and chunk of prompts), so a rerun only scores; ``--workers`` generates chunks in
parallel processes (one torch thread each).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

CLASSES = ("honest", "draft-only", "top1", "w4", "wrong-seed")
SPEC = {"draft": "layers:28", "k": 4}
TEMPERATURE = 1.0
POOL = 24  # prompts drawn once (chitchat, prompt seed 17); a class uses the first n of them
SEED_BASE = 1000
CLASS_SEED_STRIDE = 100_000  # class c claims seeds SEED_BASE + c * stride + prompt index


def _requests(backend, cls: str):
    from verinfer.prompts import load_prompts
    from verinfer.sampling.params import SamplingParams
    from verinfer.simulate.generate import build_requests

    params = SamplingParams(profile="vllm", temperature=TEMPERATURE,
                            seed=SEED_BASE + CLASSES.index(cls) * CLASS_SEED_STRIDE, speculative=dict(SPEC))
    return build_requests(backend, load_prompts("chitchat", POOL, seed=17), params)


def _generate_chunk(task: tuple) -> str:
    """Generate one class's traces for prompts [lo, hi) into ``path`` (runs in a worker process)."""
    cls, lo, hi, max_tokens, path, threads = task
    torch.set_num_threads(threads)
    from verinfer.models.backend import Backend
    from verinfer.models.derived import draft_backend, with_quantized_weights
    from verinfer.simulate.speculative import generate_speculative
    from verinfer.trace import write_traces

    backend = Backend.load()
    reqs = _requests(backend, cls)[lo:hi]
    rule = {"draft-only": "draft-only", "top1": "top1"}.get(cls, "vllm")
    target, draft = backend, None
    if cls == "w4":
        target = with_quantized_weights(backend, 4, 128)
        draft = draft_backend(backend, SPEC["draft"])  # only the target is quantized
    run = [dataclasses.replace(r, params=r.params.with_(seed=r.params.seed + 1)) for r in reqs] \
        if cls == "wrong-seed" else reqs
    t0 = time.time()
    traces = generate_speculative(target, run, max_tokens, draft=draft, rule=rule)
    out = [dataclasses.replace(t, model=backend.model_id, sampling=req.params, meta={**(t.meta or {}), "class": cls})
           for req, t in zip(reqs, traces)]  # every trace claims the honest model, sampler and its own seed
    tmp = Path(str(path) + ".tmp")
    write_traces(out, tmp)
    tmp.replace(path)
    n = sum(len(t.output_token_ids) for t in out)
    return f"{cls} [{lo}, {hi}): {n} tokens in {time.time() - t0:.0f} s"


def _chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + chunk, n)) for lo in range(0, n, chunk)]


def generate_all(cache: Path, sizes: dict[str, int], max_tokens: int, chunk: int, workers: int,
                 threads: int) -> dict[str, list]:
    """Every class's traces (the first ``sizes[cls]`` prompts), generating only missing chunks."""
    from verinfer.trace import read_traces

    cache.mkdir(parents=True, exist_ok=True)
    path = lambda cls, lo, hi: cache / f"{cls}.{lo:03d}-{hi:03d}.jsonl"  # noqa: E731
    tasks = [(cls, lo, hi, max_tokens, path(cls, lo, hi), threads)
             for cls, n in sizes.items() for lo, hi in _chunks(n, chunk) if not path(cls, lo, hi).exists()]
    if tasks:
        print(f"generating {len(tasks)} chunk(s) of up to {chunk} prompts with {workers} worker(s)", flush=True)
        if workers > 1:
            import multiprocessing as mp

            with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
                for msg in pool.map(_generate_chunk, tasks):
                    print("  " + msg, flush=True)
        else:
            for t in tasks:
                print("  " + _generate_chunk(t), flush=True)
    return {cls: [t for lo, hi in _chunks(n, chunk) for t in read_traces(path(cls, lo, hi))]
            for cls, n in sizes.items()}


@torch.inference_mode()
def rows_of(model, trace) -> torch.Tensor:
    """Raw fp32 logits [n, V] of the rows predicting each output token (one prefill)."""
    seq = [list(trace.prompt_token_ids) + list(trace.output_token_ids)]
    return torch.cat([b.logits.float() for b in model.prefill(seq, [len(trace.prompt_token_ids)])])


def fit_noise_models(backend, draft, traces, top: int) -> dict:
    """The honest noise model per model: logit differences bf16 - fp32 on the rows of ``traces``."""
    from verinfer.models.derived import draft_backend, with_dtype
    from verinfer.scoring import monte_carlo as mc

    bf16 = with_dtype(backend, torch.bfloat16)
    pairs = {"target": (backend, bf16), "draft": (draft, draft_backend(bf16, SPEC["draft"]))}
    out = {}
    for name, (ref, other) in pairs.items():
        diffs = np.concatenate([mc.logit_differences(rows_of(ref, t), rows_of(other, t), top) for t in traces])
        out[name] = mc.fit_noise(diffs)
    return out


def score_class(backend, draft, traces, noise: dict, args, check_exact: bool = False) -> dict[str, np.ndarray]:
    """Per-token columns: exact replay (with and without recorded modes) and Monte Carlo scores."""
    from verinfer.scoring import monte_carlo as mc
    from verinfer.scoring import speculative
    from verinfer.scoring.token_difr import verify_traces

    sampler = mc.speculative_sampler(TEMPERATURE)
    cols: dict[str, list] = {k: [] for k in ("trace_id", "margin", "margin_nomodes", "cross_entropy", "mc_nll",
                                             "mc_excess", "mc_count", "spec_mode")}
    for j, t in enumerate(traces):
        tl, dl = rows_of(backend, t), rows_of(draft, t)
        exact = speculative.score_columns(t, tl, dl)  # what verify_traces computes for a speculative trace
        if check_exact and j == 0:
            ref = np.concatenate([b.columns["margin"] for b in verify_traces(backend, [t])])
            if not np.array_equal(ref, exact["margin"]):
                raise SystemExit("exact margins differ from verify_traces")
        blind = speculative.score_columns(dataclasses.replace(t, spec_modes=None), tl, dl)
        claimed = torch.tensor(t.output_token_ids)
        seed = int.from_bytes(t.id.encode()[-6:], "little") ^ args.mc_seed
        m = mc.score_rows(sampler, [tl, dl], claimed, [noise["target"].model, noise["draft"].model], TEMPERATURE,
                          n_draws=args.draws, top=args.top, seed=seed)
        n = len(claimed)
        cols["trace_id"].append(np.array([t.id] * n, dtype=object))
        cols["margin"].append(exact["margin"])
        cols["margin_nomodes"].append(blind["margin"])
        cols["cross_entropy"].append(exact["cross_entropy"])
        cols["spec_mode"].append(exact["spec_mode"])
        for k in ("mc_nll", "mc_excess", "mc_count"):
            cols[k].append(m[k])
    return {k: np.concatenate(v) for k, v in cols.items()}


def detectors():
    from verinfer.stats.power import Detector

    return (
        Detector("margin", "bound:20", "exact replay, recorded modes: margin (bound 20)"),
        Detector("margin_nomodes", "bound:20", "exact replay, modes reconstructed: margin (bound 20)"),
        Detector("mc_nll", "bound:20", "Monte Carlo, seed-free: -log P_hat"),
        Detector("mc_excess", "bound:20", "Monte Carlo, seed-free: -log P_hat - entropy_hat"),
        Detector("cross_entropy", "bound:20", "analytic, seed-free: -log p_target (reference)"),
    )


TWO_SIDED = "Monte Carlo, seed-free: |mean excess - honest mean| (two-sided)"


def analyse(columns: dict[str, dict], args) -> dict:
    """AUC at FPR (stats.power protocol) and TPR at FPR per class, detector and batch size."""
    from verinfer.stats.evaluation import auc_at_fpr, train_test_split_by_sequence
    from verinfer.stats.power import fit_transforms, power_curves, random_batch_means

    dets = detectors()
    halves = {}
    for cls, c in columns.items():
        train, test = train_test_split_by_sequence(c["trace_id"], 0.5, rng=args.split_seed)
        halves[cls] = ({k: v[train] for k, v in c.items()}, {k: v[test] for k, v in c.items()})
    h_train, h_test = halves["honest"]
    cal = fit_transforms(h_train, dets, args.fpr)
    centre = float(np.mean(h_train["mc_excess"]))
    sizes = [n for n in args.batch_sizes]
    out = {"tokens": {cls: {"train": int(h[0]["margin"].size), "test": int(h[1]["margin"].size),
                            "sequences": int(np.unique(columns[cls]["trace_id"]).size)} for cls, h in halves.items()},
           "honest_train_mean_excess": centre, "classes": {}}
    for cls in columns:
        if cls == "honest":
            continue
        b_train, b_test = halves[cls]
        curves = power_curves(cal, h_train, h_test, b_train, b_test, dets, sizes, args.n_batches, args.n_boot,
                              args.fpr, seed=args.split_seed, combined=False)
        res = {}
        for d in dets:
            pts = curves[d.label]
            res[d.label] = [{"tokens": p.tokens, "auc": p.auc.estimate, "low": p.auc.low, "high": p.auc.high,
                             "oriented": p.oriented} for p in pts]
        # TPR at FPR on separately drawn batches (same protocol; 0 where the detector is not oriented)
        ht, bt = (np.stack([cal.transform(c[d.metric], metric=d.metric, rule=d.rule) for d in dets])
                  for c in (h_test, b_test))
        for i, n in enumerate(sizes):
            rng = np.random.default_rng([args.split_seed, 7, i])
            h, b = random_batch_means(ht, n, args.n_batches, rng), random_batch_means(bt, n, args.n_batches, rng)
            thr = np.quantile(h, 1 - args.fpr, axis=1, method="higher")
            for j, d in enumerate(dets):
                ok = res[d.label][i]["oriented"]
                res[d.label][i]["tpr"] = float((b[j] > thr[j]).mean()) if ok else 0.0
            # two-sided Monte Carlo: |batch mean of the excess score - its honest training mean|
            k = [d.metric for d in dets].index("mc_excess")
            ha, ba = np.abs(h[k] - centre), np.abs(b[k] - centre)
            res.setdefault(TWO_SIDED, []).append({
                "tokens": n, "auc": auc_at_fpr(ha, ba, args.fpr), "low": None, "high": None, "oriented": True,
                "tpr": float((ba > np.quantile(ha, 1 - args.fpr, method="higher")).mean())})
        means = {d.label: [float(np.mean(halves[x][0][d.metric][np.isfinite(halves[x][0][d.metric])]))
                           for x in ("honest", cls)] for d in dets}
        out["classes"][cls] = {"curves": res, "train_means": means}
    return out


def markdown(result: dict, args, header: list[str]) -> str:
    sizes = list(args.batch_sizes)
    lines = header + [""]
    for cls, r in result["classes"].items():
        lines += [f"### {cls}", "", "AUC at 1% FPR (TPR at 1% FPR) vs tokens per batch:", "",
                  "| detector | " + " | ".join(str(n) for n in sizes) + " |", "|---|" + "---|" * len(sizes)]
        for label, pts in r["curves"].items():
            cells = [f"{p['auc']:.3f} ({p['tpr']:.2f})" + ("" if p["oriented"] else " n/o") for p in pts]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines += ["", "Mean per-token score on the training halves (honest / " + cls + "): " + "; ".join(
            f"{label.split(':')[0] if 'exact' in label else label}: {h:.3f} / {b:.3f}"
            for label, (h, b) in r["train_means"].items()) + ".", ""]
    lines += ["n/o: the class's mean training score is not above the honest one, so the one-sided "
              "detector is not oriented and scores 0.5 (stats.power's rule). The two-sided detector centres "
              f"batch means of the excess score at its honest training mean ({result['honest_train_mean_excess']:.3f}); "
              "its AUC has no bootstrap interval.", ""]
    return "\n".join(lines)


def _settings_key(args) -> str:
    import verinfer

    return f"pool{POOL}-t{args.max_tokens}-{SPEC['draft'].replace(':', '')}-k{SPEC['k']}-v{verinfer.__version__}"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=24, help="honest prompts (one trace per prompt)")
    ap.add_argument("--bad-prompts", type=int, default=12, help="prompts per cheating class")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--chunk", type=int, default=6, help="prompts per cached generation chunk")
    ap.add_argument("--workers", type=int, default=2, help="generation processes")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--draws", type=int, default=1023, help="Monte Carlo draws per token")
    ap.add_argument("--top", type=int, default=64, help="perturbed top logits per model (the rest is one bucket)")
    ap.add_argument("--n-batches", type=int, default=1000)
    ap.add_argument("--n-boot", type=int, default=100)
    ap.add_argument("--fpr", type=float, default=0.01)
    ap.add_argument("--batch-sizes", type=lambda v: [int(x) for x in v.split(",")],
                    default=[1, 2, 5, 10, 20, 50, 100, 200, 500])
    ap.add_argument("--split-seed", type=int, default=0)
    ap.add_argument("--mc-seed", type=int, default=0)
    ap.add_argument("--noise-traces", type=int, default=8, help="honest traces the noise model is fitted on")
    ap.add_argument("--generate-only", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/speculative_monte_carlo.md"))
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from verinfer.models.load import cache_root

    started, load = dt.datetime.now(dt.timezone.utc), os.getloadavg()[0]
    cache = cache_root() / "experiments" / "speculative_monte_carlo" / _settings_key(args)
    t0 = time.time()
    sizes = {c: args.prompts if c == "honest" else args.bad_prompts for c in CLASSES}
    if max(sizes.values()) > POOL:
        raise SystemExit(f"at most {POOL} prompts per class")
    data = generate_all(cache, sizes, args.max_tokens, args.chunk, args.workers, args.threads)
    gen_s = time.time() - t0
    print(f"traces ready in {gen_s:.0f} s: " + ", ".join(
        f"{c} {sum(len(t.output_token_ids) for t in ts)} tokens" for c, ts in data.items()), flush=True)
    if args.generate_only:
        return
    from verinfer.machine import describe
    from verinfer.models.backend import Backend
    from verinfer.models.derived import draft_backend

    from verinfer.scoring.monte_carlo import NoiseFit, NoiseModel

    backend = Backend.load()
    draft = draft_backend(backend, SPEC["draft"])
    t1 = time.time()
    scored = cache / (f"scores-h{args.prompts}-b{args.bad_prompts}-d{args.draws}-top{args.top}-seed{args.mc_seed}"
                      f"-noise{args.noise_traces}")  # scores are cached too: a rerun only analyses
    scored.mkdir(exist_ok=True)
    if (scored / "noise.json").exists():
        fits = {k: NoiseFit(NoiseModel.from_dict(v["model"]), v["fits"], v["n"])
                for k, v in json.loads((scored / "noise.json").read_text()).items()}
    else:
        fits = fit_noise_models(backend, draft, data["honest"][: args.noise_traces], args.top)
        (scored / "noise.json").write_text(json.dumps({k: f.to_dict() for k, f in fits.items()}))
    for name, f in fits.items():
        print(f"noise {name}: {f.model.to_dict()} (std {f.model.std:.4g}; AIC " +
              ", ".join(f"{k} {v['aic']:.0f}" for k, v in f.fits.items()) + ")", flush=True)
    columns = {}
    for cls, traces in data.items():
        t2, path = time.time(), scored / f"{cls}.npz"
        if path.exists():
            with np.load(path, allow_pickle=True) as z:
                columns[cls] = {k: z[k] for k in z.files}
            continue
        columns[cls] = score_class(backend, draft, traces, fits, args, check_exact=cls == "honest")
        np.savez(path, **columns[cls])
        print(f"scored {cls}: {columns[cls]['margin'].size} tokens in {time.time() - t2:.0f} s", flush=True)
    scoring_s = time.time() - t1
    result = analyse(columns, args)
    command = "python experiments/speculative_monte_carlo.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    modes = {cls: "".join(c["spec_mode"].tolist()) for cls, c in columns.items()}
    header = [
        "# Monte Carlo verification of speculative decoding without mode metadata (DiFR appendix B.1)", "",
        f"Command: `HF_HUB_OFFLINE=1 nice {command}`", "",
        f"Date: {started:%Y-%m-%d %H:%M} UTC; machine: {describe(args.threads)}; load average at start {load:.1f}; "
        f"generation {gen_s:.0f} s (cached chunks cost nothing), noise fit and scoring {scoring_s:.0f} s.", "",
        f"Model smollm2-135m (fp32 reference); speculative claim: draft {SPEC['draft']}, k = {SPEC['k']}, vLLM "
        f"profile, T = {TEMPERATURE}, no top-k/top-p; chitchat prompts (prompt seed 17), up to {args.max_tokens} "
        f"new tokens; honest: the first {args.prompts} prompts, each cheat the first {args.bad_prompts}. "
        "Tokens: " + ", ".join(f"{c} {t['train'] + t['test']} ({t['sequences']} sequences)"
                               for c, t in result["tokens"].items()) + ".", "",
        f"Monte Carlo: {args.draws} draws per token of the seed-free speculative step (fresh Gumbels and "
        f"uniforms), candidates = top {args.top} of target and of draft + the claim + one tail bucket, add-one "
        "smoothing. Noise model fitted on the first "
        f"{args.noise_traces} honest traces (bf16 copy minus fp32, top {args.top} logits per row, centred per row): "
        + "; ".join(f"{name} {f.model.family} scale {f.model.scale:.4g}" + (f" df {f.model.df:.3g}" if f.model.df else "")
                    + f" (std {f.model.std:.4g}, {f.n} differences)" for name, f in fits.items()) + ".", "",
        f"Evaluation: stats.power protocol, split 50/50 by sequence (split seed {args.split_seed}), "
        f"{args.n_batches} random batches per size drawn with replacement, AUC at {args.fpr:.0%} FPR "
        f"(McClish-standardized) with {args.n_boot} bootstrap resamples; TPR at {args.fpr:.0%} FPR against the "
        "honest test batches of the same size.", "",
    ]
    md = markdown(result, args, header)
    payload = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "noise": {k: f.to_dict() for k, f in fits.items()},
               "mode_counts": {c: {m: m_.count(m) for m in "arb"} for c, m_ in modes.items()},
               **result}
    md += "\n```json\n" + json.dumps(payload, indent=1) + "\n```\n"
    from verinfer.files import write_atomic

    write_atomic(args.out, md)
    print(md.split("```json")[0])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
