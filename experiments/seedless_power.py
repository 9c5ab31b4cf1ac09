"""Power of every seedless audit mode at 10 / 25 / 50 / 100 queries, beside Model Equality Testing.

    python experiments/seedless_power.py --met-python /tmp/metvenv/bin/python --out experiments/results/seedless_power.md

(``--permutations-only STEP`` grows the cached mmd / MET counts, every variant in turn, in a run that
can be stopped; each group's outcome is cached, so the table then uses any count all variants reached.)

Pools, generated once with the in-process provider simulator and cached under
``$VERINFER_CACHE/studies/seedless_power`` (``--prompts`` chitchat prompts, prompt seed 21,
``--per-prompt`` completions each at T = 1, up to ``--max-tokens`` tokens, no top-k / top-p):

- one pool of provider completions per variant (honest fp32, honest bf16, w4, w8, fp8 KV cache,
  temperature 1.1 claimed as 1.0, a hidden system prompt); the greedy-only cheat's sampled traffic
  *is* the 4-bit pool (``verinfer serve --misconfig greedy-honest:w4``), so its row is w4's;
- ``--samples`` reference draws for each (prompt, completion) unit, never shared between units
  (``verinfer.auditing.draws.reference_draws``);
- the reference's scores of every completion and draw (``completion_scores``) and the returned
  top-5 logprobs a provider would send (``returned_logprobs``).

A budget of B queries is B completions (an ``n`` > 1 request counts n). Each cell resamples B
units without replacement from the pool (``--resamplings`` times; fewer for the permutation tests,
``--mmd-resamplings``) and applies the verdict the audit uses at 1% FPR (doubling looks,
Bonferroni): ``surprise`` (test martingale of the centred log-probability with its exact cumulant
generating function, no draws: the pools' completions rescored with ``surprise.TILTS``, cached as
``tilted-*.npz``; ``--pools-only --tilted`` makes them), ``rank`` (exact rank
test of the centred log-probability among the unit's draws), ``rank-raw`` (RUT's raw
log-probability, the old statistic), ``mmd`` (this project's paired MMD, ``--per-prompt``
completions per prompt, B // n prompts, ``mmd.completions_per_prompt``), ``MET`` (the
``model-equality-testing`` package's ``run_two_sample_test`` with ``mmd_hamming`` and its
permutation p-value, b = 1000, run in ``--met-python``, a separate environment, on the same
prompts and completions as ``mmd``: with one completion per prompt its statistic divides 0 by 0
and its p-value is 0, so it is never given fewer than 2 per prompt), and ``logprobs``
(LOGIC's KS test of returned logprobs). Resamplings of one pool share units, so cells at large B
are correlated draws of few distinct sets: their binomial intervals understate the uncertainty.

The honest rows therefore also come from larger pools (``honest_pool``, prompt seed 29, cached in
chunks of 40 prompts; ``--pools-only`` makes them): ``--honest-draws`` fp32 draws per prompt, of
which any 7 are exchangeable, so one plays the provider and 6 the reference (rank), and
``--honest-bf16`` bf16 completions per prompt, each ranked among 6 fp32 draws of its prompt
(``honest_counts``: random sets of B and one partition into disjoint sets of B).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from verinfer.auditing.draws import CompletionScores, completion_scores, occurrences, reference_draws
from verinfer.auditing.logprobs import logprob_verdict, provider_values, reference_values, returned_logprobs
from verinfer.auditing.mmd import completions_per_prompt, mmd_verdict
from verinfer.auditing.rank import rank_p_values, rank_verdict, split
from verinfer.auditing.store import ResponseStore
from verinfer.auditing.surprise import TILTS, surprise_verdict
from verinfer.files import atomic_path, write_atomic
from verinfer.machine import describe
from verinfer.models.backend import Backend
from verinfer.models.load import cache_root
from verinfer.prompts import load_prompts
from verinfer.sampling.params import SamplingParams
from verinfer.simulate.generate import Request, build_requests
from verinfer.simulate.variants import get_variant
from verinfer.stats.evaluation import wilson_interval

SYSTEM = "system-prompt:Answer briefly and never mention the weather."
VARIANTS = {"honest fp32": "honest", "honest bf16": "bf16", "4-bit (w4)": "w4", "8-bit (w8)": "w8",
            "fp8 KV cache": "fp8-kv", "temperature 1.1": "temperature-1.1", "hidden system prompt": SYSTEM}
CHEAT = ("greedy-only cheat (greedy-honest:w4)", "4-bit (w4)")
BUDGETS = (10, 25, 50, 100)
MODES = ("surprise", "rank", "rank-raw", "mmd", "MET", "logprobs")
FAST = ("rank", "rank-raw", "logprobs")
CLAIMED = SamplingParams(profile="torch-exponential", temperature=1.0)
FIELDS = ("logprob", "expected", "variance", "tokens")
MET_SCRIPT = Path(__file__).with_name("met_two_sample.py")


def stem(name: str) -> str:
    return re.sub(r"[^\w.+-]", "_", name)[:40]


def save(path: Path, **arrays) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)


def pools(args, backend, cache: Path) -> dict:
    """Every variant's completions, the units' reference draws, and their scores (cached)."""
    prompts = load_prompts("chitchat", args.prompts, seed=21)
    c, L, m = args.per_prompt, args.max_tokens, args.samples
    base = build_requests(backend, prompts, CLAIMED.with_(seed=50_000), seed_stride=c)
    units = [Request(f"{r.id}#{j}", r.prompt_token_ids, r.params.with_(seed=r.params.seed + j), r.messages)
             for r in base for j in range(c)]
    prompt_ids = [list(u.prompt_token_ids) for u in units]
    t0 = time.time()
    draws = reference_draws(backend, [(u.id, u.prompt_token_ids) for u in units], CLAIMED, m, 7, L,
                            ResponseStore(cache / "draws.jsonl"), batch_size=64, on_stage=print)
    print(f"draws ready ({time.time() - t0:.0f} s)", flush=True)
    if not (cache / "draw_scores.npz").exists():
        s = completion_scores(backend, [p for p in prompt_ids for _ in range(m)], [o for d in draws for o in d], CLAIMED)
        save(cache / "draw_scores.npz", logprob=s.logprob, expected=s.expected, variance=s.variance, tokens=s.tokens)
    out = {"prompt_ids": prompt_ids, "draws": draws, "units": units, "variants": {}, "tilted": {}}
    order = [(label, name) for label, name in VARIANTS.items() if label in args.variants]
    for label, name in order[::-1] if args.reverse else order:
        f = cache / f"{stem(name)}.json"
        if not f.exists():
            t0 = time.time()
            variant = get_variant(name)
            built = variant.build(backend)
            traces = variant.generate(backend, units, L, args.batch, backend=built)
            outputs = [list(t.output_token_ids) for t in traces]
            seen = [list(variant.prompt(built, u).prompt_token_ids) for u in units] if variant.prompt else prompt_ids
            ret = returned_logprobs(built, prompt_ids, outputs, seen)
            theirs, ours = provider_values(ret), reference_values(backend, ret)
            s = completion_scores(backend, prompt_ids, outputs, CLAIMED)
            write_atomic(f, json.dumps({"outputs": outputs, "returned": [a.tolist() for a in theirs],
                                        "reference": [b.tolist() for b in ours],
                                        "scores": [s.logprob.tolist(), s.expected.tolist(), s.variance.tolist(),
                                                   s.tokens.tolist()]}))
            print(f"{label}: generated and scored in {time.time() - t0:.0f} s", flush=True)
    for label, name in order:
        out["variants"][label] = json.loads((cache / f"{stem(name)}.json").read_text())
    if args.rescore:  # the surprise test's scores, rescored with its tilts (in --variants order)
        for label in args.variants:
            out["tilted"][label] = tilted(backend, cache / f"tilted-{stem(VARIANTS[label])}.npz", prompt_ids,
                                          out["variants"][label]["outputs"], out["variants"][label]["scores"][0])
    d = np.load(cache / "draw_scores.npz")
    out["draw_scores"] = CompletionScores(d["logprob"], d["expected"], d["variance"], d["tokens"])
    return out


def tilted(backend, path: Path, prompt_ids: list, outputs: list, logprob) -> CompletionScores:
    """The reference's scores of ``outputs`` with the surprise test's cumulant generating function at
    ``TILTS`` (one more prefill of completions scored before the surprise test used it; cached), checked
    against their earlier scores ``logprob`` (the same completions in the same order)."""
    if not path.exists():
        t0 = time.time()
        s = completion_scores(backend, prompt_ids, outputs, CLAIMED, tilts=TILTS)
        save(path, logprob=s.logprob, expected=s.expected, variance=s.variance, tokens=s.tokens, cgf=s.cgf,
             tilts=np.asarray(TILTS))
        print(f"rescored {len(outputs)} completions with tilts in {time.time() - t0:.0f} s -> {path.name}", flush=True)
    d = np.load(path)
    if tuple(d["tilts"]) != TILTS:
        raise SystemExit(f"{path}: scored at other tilts than surprise.TILTS; delete it to rescore")
    if not np.allclose(d["logprob"], np.ravel(logprob), atol=1e-3):
        raise SystemExit(f"{path}: its completions' log-probabilities differ from the pool's: not the same completions")
    return CompletionScores(d["logprob"], d["expected"], d["variance"], d["tokens"], d["cgf"], TILTS)


def stored_draws(path: Path, requests: list, chunk: list, m: int, seed: int) -> list[list[list[int]]]:
    """The draws ``reference_draws`` returned for each request of ``chunk`` (``m`` per prompt, drawn with
    ``seed``), read back from its store without the drawing model: records are keyed by prompt content
    and occurrence within the call, so a prompt whose content an earlier chunk asked got that one's draws."""
    content = {r.id: tuple(r.prompt_token_ids) for r in requests}
    found: dict[tuple, list] = {}
    for r in ResponseStore(path).records():
        if r["request"].get("m") == m and r["request"].get("seed") == seed:
            found.setdefault(content[r["request"]["prompt_id"]], []).append(r["response"])
    return [found[tuple(r.prompt_token_ids)][k] for r, k in zip(chunk, occurrences([r.prompt_token_ids for r in chunk]))]


def honest_pool(args, backend, cache: Path) -> dict:
    """Large honest pools for the false-positive rows, made in chunks of 40 prompts (each cached, so a
    run can stop and resume): ``--honest-draws`` fp32 draws per prompt (shared prefill; by
    exchangeability any one of m + 1 of them plays the provider, the others the reference) and
    ``--honest-bf16`` bf16 completions per prompt (the honest bf16 provider, judged against the same
    prompt's fp32 draws), every one scored by the fp32 reference; bf16's returned top-5 logprobs too.
    Chunks are made by ``--pools-only`` runs only; the table uses those present."""
    prompts = load_prompts("chitchat", args.honest_prompts, seed=29)
    L, D, k = args.max_tokens, args.honest_draws, args.honest_bf16
    base = build_requests(backend, prompts, CLAIMED.with_(seed=60_000))
    root = cache / f"honest-p{args.honest_prompts}-d{D}-b{k}-t{L}"
    root.mkdir(parents=True, exist_ok=True)
    bf16 = None
    out: dict = {"fp32": [], "bf16": [], "bf16_logprobs": []}
    for lo in range(0, len(base), 40):
        chunk = base[lo: lo + 40]
        entries = [(r.id, r.prompt_token_ids) for r in chunk]
        ids = [list(r.prompt_token_ids) for r in chunk]
        parts = {"fp32": (backend, D, 2029), "bf16": (None, k, 4029)}
        for part in args.honest_parts:
            f = root / f"{part}-{lo // 40:03d}.npz"
            if not f.exists() and args.pools_only and not args.tilted:  # else: the chunks made so far
                t0 = time.time()
                if part == "bf16" and bf16 is None:
                    bf16 = get_variant("bf16").build(backend)
                model, n, seed = parts[part]
                model = model or bf16
                draws = reference_draws(model, entries, CLAIMED, n, seed, L, ResponseStore(root / f"{part}-draws.jsonl"),
                                        batch_size=8 * n)
                s = completion_scores(backend, [p for p in ids for _ in range(n)], [o for d in draws for o in d], CLAIMED)
                arrays = {name: getattr(s, name).reshape(len(chunk), n) for name in ("logprob", "expected", "variance",
                                                                                     "tokens")}
                if part == "bf16":
                    ret = returned_logprobs(bf16, [p for p in ids for _ in range(n)], [o for d in draws for o in d],
                                            [p for p in ids for _ in range(n)])
                    theirs, ours = provider_values(ret), reference_values(backend, ret)
                    write_atomic(root / f"bf16-logprobs-{lo // 40:03d}.json",
                                 json.dumps([[a.tolist() for a in theirs], [b.tolist() for b in ours]]))
                save(f, **arrays)
                print(f"honest {part} prompts {lo}-{lo + len(chunk)}: {time.time() - t0:.0f} s", flush=True)
    for part in ("fp32", "bf16"):
        for f in sorted(root.glob(f"{part}-[0-9]*.npz")):
            d = np.load(f)
            out[part].append(CompletionScores(d["logprob"], d["expected"], d["variance"], d["tokens"]))
    if args.rescore:  # the same completions rescored with the surprise test's tilts (--honest-parts)
        out["tilted"] = {}
        for part, (n, seed) in {"bf16": (k, 4029), "fp32": (D, 2029)}.items():
            if part not in args.honest_parts:
                continue
            chunks = []
            for c in range(len(out[part])):
                chunk = base[40 * c: 40 * (c + 1)]
                ids = [list(r.prompt_token_ids) for r in chunk]
                draws = stored_draws(root / f"{part}-draws.jsonl", base, chunk, n, seed)
                s = tilted(backend, root / f"tilted-{part}-{c:03d}.npz", [p for p in ids for _ in range(n)],
                           [o for d in draws for o in d], out[part][c].logprob)
                chunks.append(CompletionScores(*(getattr(s, f).reshape(len(chunk), n, -1)[..., 0] for f in FIELDS),
                                               s.cgf.reshape(len(chunk), n, -1), TILTS))
            out["tilted"][part] = chunks
    for f in sorted(root.glob("bf16-logprobs-*.json")):
        out["bf16_logprobs"].append(json.loads(f.read_text()))
    return out


def met_p_values(python: str, cases: list[dict]) -> list[float]:
    """Model Equality Testing's own two-sample test on each case, run in its environment."""
    proc = subprocess.run([python, str(MET_SCRIPT)], input=json.dumps(cases), capture_output=True, text=True,
                          env={**os.environ, "TQDM_DISABLE": "1"}, check=False)
    if proc.returncode:
        raise SystemExit(f"{MET_SCRIPT.name} failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout)


def counts(args, data: dict, label: str, cache: Path) -> dict[str, list]:
    """(rejected, resamplings) per mode and budget for one provider pool of 120 units, cached beside
    the pools: ``--resamplings`` for surprise / rank / logprobs, the first ``--raw-resamplings`` of the
    same picks for rank-raw (the old statistic, kept for comparison), and the permutation tests'
    counts (``permutation_counts``)."""
    path = cache / f"counts-{stem(label)}-r{args.resamplings}-raw{args.raw_resamplings}-fpr{args.fpr}.json"
    if not path.exists():
        t0 = time.time()
        m, fpr = args.samples, args.fpr
        U = len(data["units"])
        draw_s, pool = data["draw_scores"], data["variants"][label]
        s = CompletionScores(*(np.asarray(a, dtype=np.float64) for a in pool["scores"]))
        tokens = s.tokens.astype(int)
        rng = np.random.default_rng(11)
        u = {"rank": rank_p_values(s.centred, split(draw_s.centred, [m] * U), rng),
             "rank-raw": rank_p_values(s.logprob, split(draw_s.logprob, [m] * U), rng)}
        theirs = [np.asarray(a) for a in pool["returned"]]
        ours = [np.asarray(b) for b in pool["reference"]]
        row: dict[str, list] = {mode: [] for mode in FAST}
        for B in BUDGETS:
            if B > U:
                raise SystemExit(f"budget {B} exceeds the pool's {U} units: raise --prompts or --per-prompt")
            rng = np.random.default_rng([B, 1])
            picks = [rng.choice(U, B, replace=False) for _ in range(args.resamplings)]
            rej = {mode: 0 for mode in FAST}
            for r, pick in enumerate(picks):
                rej["rank"] += not rank_verdict(u["rank"][pick], tokens[pick], m, fpr).consistent
                if r < args.raw_resamplings:
                    rej["rank-raw"] += not rank_verdict(u["rank-raw"][pick], tokens[pick], m, fpr).consistent
                rej["logprobs"] += not logprob_verdict([theirs[i] for i in pick], [ours[i] for i in pick],
                                                       tokens[pick], fpr).consistent
            for mode in FAST:
                row[mode].append([rej[mode], min(args.raw_resamplings, len(picks)) if mode == "rank-raw" else len(picks)])
            print(label, B, {k: f"{v}" for k, v in rej.items()}, f"{time.time() - t0:.0f} s", flush=True)
        write_atomic(path, json.dumps(row))
    return (json.loads(path.read_text()) | surprise_counts(args, data["tilted"][label], f"surprise-{stem(label)}", cache)
            | permutation_counts(args, data, label, cache))


def surprise_counts(args, s: CompletionScores, name: str, cache: Path, seed: int = 1) -> dict[str, list]:
    """(rejected, resamplings) of the surprise test (test martingale, ``surprise.TILTS``) per budget on
    ``s`` (completions rescored with the tilts): ``--resamplings`` random sets of B completions, drawn as
    the other modes' are (``default_rng([B, seed])``), and, for the large honest pools (``seed`` 3), one
    partition into disjoint sets (``disjoint``)."""
    path = cache / f"{name}-r{args.resamplings}-fpr{args.fpr}.json"
    if not path.exists():
        t0, row = time.time(), {"surprise": [], "disjoint": []}
        for B in BUDGETS:
            N = len(s.tokens)
            if B > N:
                row["surprise"].append(None)
                row["disjoint"].append(None)
                continue
            rng = np.random.default_rng([B, seed])
            picks = [rng.choice(N, B, replace=False) for _ in range(args.resamplings)]
            row["surprise"].append([sum(not surprise_verdict(s[p], args.fpr).consistent for p in picks), len(picks)])
            parts = rng.permutation(N)[: N // B * B].reshape(-1, B)
            row["disjoint"].append([sum(not surprise_verdict(s[p], args.fpr).consistent for p in parts), len(parts)])
            print(name, B, row["surprise"][-1], row["disjoint"][-1], f"{time.time() - t0:.0f} s", flush=True)
        write_atomic(path, json.dumps(row))
    return json.loads(path.read_text())


def permutation_counts(args, data: dict, label: str, cache: Path, mmd: int | None = None,
                       met: int | None = None) -> dict[str, list]:
    """(rejected, resamplings) of the two MMDs (``--mmd-resamplings``, ``--met-resamplings``, or ``mmd`` /
    ``met``): slower permutation tests, on the same B // n prompts of n completions from each side.
    Each group's outcome is cached in order, so a larger count extends a smaller one (group k is the same
    whatever the count; the first 20 are those of the table's first run)."""
    mmd = args.mmd_resamplings if mmd is None else mmd
    met = (args.met_resamplings if met is None else met) if args.met_python else 0
    path = cache / f"permutations-{stem(label)}-fpr{args.fpr}.json"
    done = json.loads(path.read_text()) if path.exists() else {"mmd": {}, "MET": {}}
    t0 = time.time()
    c, L, fpr = args.per_prompt, args.max_tokens, args.fpr
    prompts = len(data["units"]) // c
    outputs = data["variants"][label]["outputs"]
    for B in BUDGETS:
        n = completions_per_prompt(B, c)
        rng = np.random.default_rng([B, 1])  # the groups follow the table's first run's 500 resampled sets,
        for _ in range(500):  # so the counts cached by that run (the same groups and seeds) stand
            rng.choice(len(data["units"]), B, replace=False)
        groups = [rng.choice(prompts, B // n, replace=False) for _ in range(max(mmd, met))]
        ours, theirs = done["mmd"].setdefault(str(B), []), done["MET"].setdefault(str(B), [])
        for k in range(len(ours), mmd):
            prov = [[outputs[i * c + j] for j in range(n)] for i in groups[k]]
            ref = [[data["draws"][i * c + j][0] for j in range(n)] for i in groups[k]]
            ours.append(int(not mmd_verdict(prov, ref, L, fpr, seed=k).consistent))
        write_atomic(path, json.dumps(done))
        for lo in range(len(theirs), met, args.met_batch):  # one environment start per batch of cases
            cases = [{"m": prompts, "L": L, "seed": k, "prompts": [int(i) for i in groups[k] for _ in range(n)],
                      "x": [outputs[i * c + j] for i in groups[k] for j in range(n)],
                      "y": [data["draws"][i * c + j][0] for i in groups[k] for j in range(n)]}
                     for k in range(lo, min(met, lo + args.met_batch))]
            theirs.extend(int(p < fpr) for p in met_p_values(args.met_python, cases))
            write_atomic(path, json.dumps(done))
        print(label, B, "mmd / MET", sum(ours[:mmd]), "/", mmd, ",", sum(theirs[:met]), "/", met,
              f"{time.time() - t0:.0f} s", flush=True)
    return {"mmd": [[sum(done["mmd"][str(B)][:mmd]), mmd] for B in BUDGETS],
            "MET": [[sum(done["MET"][str(B)][:met]), met] if met else None for B in BUDGETS]}


def stacked(pool: list) -> CompletionScores:
    """The honest pool's chunks as one [prompts, completions] ``CompletionScores`` (with their ``cgf``
    when every chunk has one)."""
    cgf = np.concatenate([c.cgf for c in pool]) if all(c.cgf is not None for c in pool) else None
    return CompletionScores(*(np.concatenate([getattr(c, f) for c in pool]).astype(np.float64) for f in FIELDS),
                            cgf, pool[0].tilts)


def honest_counts(args, honest: dict, extra: CompletionScores, extra_tilted: CompletionScores,
                  cache: Path) -> dict[str, dict]:
    """Honest rejections on the large pools, per mode and budget: ``--resamplings`` random sets of B
    completions (``resampled``) and one partition of the pool into disjoint sets of B (``disjoint``:
    independent sets, fewer of them). fp32: by exchangeability one of 7 fp32 draws of a prompt,
    chosen at random in each resampling, plays the provider and the other 6 the reference (rank);
    surprise judges any fp32 draws. bf16: each bf16 completion ranked among 6 fp32 draws of its
    prompt, never shared with the prompt's other bf16 completion; logprobs: its returned top-5
    against the fp32 reference's values. ``extra``: the 120-unit pool's honest fp32 groups
    ([units, 1 + m]: the provider's completion and its m draws, all fp32 samples of the unit's
    prompt), added to the fp32 pool the same way; surprise judges the same completions rescored with its
    tilts (``honest["tilted"]``, ``extra_tilted``: ``surprise_counts``)."""
    if not honest["fp32"] or not honest["bf16"]:
        raise SystemExit("the large honest pools are not made yet: run with --pools-only first")
    F, H = stacked(honest["fp32"]), stacked(honest["bf16"])
    P, D = F.tokens.shape
    Pb, k = H.tokens.shape
    X = len(extra.tokens)
    key = f"honest-{P}x{D}+{X}-{Pb}x{k}-r{args.resamplings}-fpr{args.fpr}"
    path = cache / f"{key}.json"
    if path.exists():
        return with_surprise(args, json.loads(path.read_text()), honest["tilted"], extra_tilted, key, cache)
    theirs = [np.asarray(a) for ch in honest["bf16_logprobs"] for a in ch[0]]
    ours = [np.asarray(b) for ch in honest["bf16_logprobs"] for b in ch[1]]
    m, g, fpr = args.samples, D // (args.samples + 1), args.fpr
    common = min(P, Pb)  # bf16 units with fp32 draws of their prompt (rank)
    sizes = {"fp32": {"rank": P * g + X}, "bf16": {"rank": common * k, "logprobs": len(theirs)}}

    def rank_sets(rng, picks, bf16: bool):
        """Rank quantiles and tokens of each picked unit, every prompt's draws shuffled afresh for each set
        (so each set's roles are new: with one shuffle for all sets, they would judge one fixed pool of ranks)."""
        c = F.centred
        out = []
        for pick in picks:
            order = np.argsort(rng.uniform(size=(P, D)), axis=1)
            roles = np.argsort(rng.uniform(size=(X, m + 1)), axis=1)  # the extra groups' provider: column 0
            if bf16:
                p, j = np.divmod(pick, k)
                ref = [c[pi, order[pi, m * ji: m * (ji + 1)]] for pi, ji in zip(p, j)]
                obs, tok = H.centred[p, j], H.tokens[p, j]
            else:
                rows = [(F, pi, order[pi, (m + 1) * ji: (m + 1) * (ji + 1)]) for pi, ji in
                        (divmod(int(i), g) for i in pick if i < P * g)]
                rows += [(extra, int(i) - P * g, roles[int(i) - P * g]) for i in pick if i >= P * g]
                obs = np.array([S.centred[pi, cs[0]] for S, pi, cs in rows])
                ref = [S.centred[pi, cs[1:]] for S, pi, cs in rows]
                tok = np.array([S.tokens[pi, cs[0]] for S, pi, cs in rows])
            out.append((rank_p_values(obs, ref, rng), tok.astype(int)))
        return out

    def rejected(row: str, mode: str, rng, picks) -> int:
        if mode == "logprobs":
            tokens = H.tokens.reshape(-1).astype(int)
            return sum(not logprob_verdict([theirs[i] for i in pick], [ours[i] for i in pick], tokens[pick],
                                           fpr).consistent for pick in picks)
        return sum(not rank_verdict(u, tok, m, fpr).consistent for u, tok in rank_sets(rng, picks, row == "bf16"))

    t0, out = time.time(), {}
    for row, modes in sizes.items():
        for mode, N in modes.items():
            cells = {"resampled": [], "disjoint": [], "units": N}
            for B in BUDGETS:
                if B > N:  # a pool smaller than the budget: no cell (the table shows "-")
                    cells["resampled"].append(None)
                    cells["disjoint"].append(None)
                    continue
                rng = np.random.default_rng([B, 3])
                picks = [rng.choice(N, B, replace=False) for _ in range(args.resamplings)]
                cells["resampled"].append([rejected(row, mode, rng, picks), len(picks)])
                parts = rng.permutation(N)[: N // B * B].reshape(-1, B)
                cells["disjoint"].append([rejected(row, mode, rng, list(parts)), len(parts)])
                print("honest", row, mode, B, cells["resampled"][-1], cells["disjoint"][-1],
                      f"{time.time() - t0:.0f} s", flush=True)
            out.setdefault(row, {})[mode] = cells
    out["pools"] = {"fp32 prompts": P, "fp32 draws per prompt": D, "extra fp32 groups": X, "bf16 prompts": Pb,
                    "bf16 per prompt": k}
    write_atomic(path, json.dumps(out))
    return with_surprise(args, out, honest["tilted"], extra_tilted, key, cache)


def with_surprise(args, out: dict, tilted: dict, extra: CompletionScores, key: str, cache: Path) -> dict:
    """``out`` with the surprise rows of the large honest pools: every fp32 completion (the pool's draws,
    then the 120-unit pool's groups, or only their provider completions without ``--surprise-draws``) and
    every bf16 completion, in the order the other modes index them; only the pools ``--honest-parts`` names."""
    flat = {}
    if "fp32" in tilted:
        F = stacked(tilted["fp32"])
        flat["fp32"] = CompletionScores(*(np.concatenate([getattr(F, f).ravel(), getattr(extra, f).ravel()])
                                          for f in FIELDS), np.concatenate([F.cgf.reshape(-1, len(TILTS)),
                                                                            extra.cgf.reshape(-1, len(TILTS))]), TILTS)
    if "bf16" in tilted:
        H = stacked(tilted["bf16"])
        flat["bf16"] = CompletionScores(*(getattr(H, f).ravel() for f in FIELDS), H.cgf.reshape(-1, len(TILTS)), TILTS)
    for row in ("fp32", "bf16"):  # a pool not rescored (--honest-parts) has no surprise row
        out[row].pop("surprise", None)
    for row, s in flat.items():
        c = surprise_counts(args, s, f"surprise-{key}-{row}{len(s.tokens)}", cache, seed=3)
        out[row] = {"surprise": {"resampled": c["surprise"], "disjoint": c["disjoint"], "units": len(s.tokens)},
                    **{mode: cells for mode, cells in out[row].items() if mode != "surprise"}}
    return out


def cell(counts: list, honest: bool) -> str:
    """Rejection rates per budget; honest rows in % with the Wilson 95% interval."""
    parts = []
    for x in counts:
        if x is None:
            parts.append("-")
        elif honest:
            ci = wilson_interval(x[0], x[1])
            parts.append(f"{100 * x[0] / x[1]:.1f}% [{100 * ci.low:.1f}, {100 * ci.high:.1f}]")
        else:
            parts.append(f"{x[0] / x[1]:.2f}")
    return " / ".join(parts)


def table(args, data: dict, cache: Path) -> None:
    """Rejection rates per variant, mode and budget (resampled from the pools), written as Markdown."""
    started, t0, load = dt.datetime.now(dt.timezone.utc), time.time(), os.getloadavg()[0]
    c, m, L = args.per_prompt, args.samples, args.max_tokens
    U = len(data["units"])
    results = {label: counts(args, data, label, cache) for label in data["variants"]}
    if "honest fp32" in results:
        old = data["variants"]["honest fp32"]["scores"]
        draws = data["draw_scores"]
        extra = CompletionScores(*(np.column_stack([np.asarray(a, dtype=np.float64), np.reshape(b, (U, m))])
                                   for a, b in zip(old, (draws.logprob, draws.expected, draws.variance, draws.tokens))))
        one = data["tilted"]["honest fp32"]
        if args.surprise_draws and "fp32" in args.honest_parts:  # the groups' reference draws too: every fp32
            # sample of the 120-unit pool
            more = data["tilted draws"]
            extra_tilted = CompletionScores(*(np.column_stack([getattr(one, f), getattr(more, f).reshape(U, m)])
                                              for f in FIELDS),
                                            np.concatenate([one.cgf[:, None], more.cgf.reshape(U, m, -1)], axis=1),
                                            TILTS)
        else:
            extra_tilted = CompletionScores(*(getattr(one, f)[:, None] for f in FIELDS), one.cgf[:, None], TILTS)
        honest = honest_counts(args, data["honest"], extra, extra_tilted, cache)
    if set(results) != set(VARIANTS):
        print("counts cached for " + ", ".join(results) + "; the table needs every variant")
        return
    pools = honest.pop("pools")
    results[CHEAT[0]] = results[CHEAT[1]]
    none = [None] * len(BUDGETS)
    large = {row: {mode: honest[row][mode]["resampled"] if mode in honest[row] else none for mode in MODES}
             for row in ("fp32", "bf16")}
    results = {"honest fp32 (large pool)": large["fp32"], "honest fp32 (120-unit pool)": results.pop("honest fp32"),
               "honest bf16 (large pool)": large["bf16"], "honest bf16 (120-unit pool)": results.pop("honest bf16"),
               **results}

    command = "python experiments/seedless_power.py " + shlex.join(sys.argv[1:])
    lines = [
        "# Power of the seedless audit modes at 10 / 25 / 50 / 100 queries (1% FPR)", "",
        f"Command: `{command}`", "",
        f"Date: {started:%Y-%m-%d %H:%M} UTC; machine: {describe(args.threads)}; load average at start {load:.1f}; "
        f"this run {time.time() - t0:.0f} s (pools and counts cached in {cache}; counts may come from "
        "earlier runs of the same command, as each cache key holds its settings).", "",
        f"smollm2-135m, fp32 reference, T = 1 claimed, up to {L} tokens. Provider pools: {U // c} chitchat prompts "
        f"(prompt seed 21) x {c} completions = {U} units per provider, {m} reference draws per unit (rank). "
        f"Large honest pools (prompt seed 29): {pools['fp32 prompts']} prompts x {pools['fp32 draws per prompt']} fp32 "
        f"draws (+ the 120-unit pool's honest fp32 completions with their draws: {pools['extra fp32 groups']} groups of "
        f"{m + 1}), {pools['bf16 prompts']} prompts x {pools['bf16 per prompt']} bf16 completions (honest_counts). "
        f"Resamplings: {args.resamplings} (surprise, rank, logprobs), {args.raw_resamplings} (rank-raw), "
        f"{args.mmd_resamplings} (mmd), {args.met_resamplings if args.met_python else 0} (MET). "
        f"mmd and MET: the same n = completions_per_prompt(B, {c}) completions of B // n prompts from each side, "
        "on the 120-unit pools; MET: the package's mmd_hamming with its permutation p-value, b = 1000.", "",
        "Cells: rejection rate at B = 10 / 25 / 50 / 100 queries (completions). Honest rows: % rejected with "
        "the Wilson 95% interval (resamplings of one pool share units: on the 120-unit pools the interval is "
        "optimistic; the large pools' disjoint sets below are independent).", "",
        "| provider | " + " | ".join(MODES) + " |",
        "|---|" + "---|" * len(MODES),
    ]
    for label, row in results.items():
        lines.append(f"| {label} | " + " | ".join(cell(row[mode], label.startswith("honest")) for mode in MODES) + " |")
    lines += ["", "## Honest false-positive rates on the large pools", "",
              "Resampled: random sets of B completions; disjoint: one partition of the pool into independent sets "
              "of B (fewer sets, no shared units). Units: completions in the pool (rank fp32: groups of 7 draws).", "",
              "| provider | mode | units | resampled, B = 10 / 25 / 50 / 100 | disjoint sets, B = 10 / 25 / 50 / 100 |",
              "|---|---|---|---|---|"]
    for row in ("fp32", "bf16"):
        for mode, cells in honest[row].items():
            lines.append(f"| honest {row} | {mode} | {cells['units']} | {cell(cells['resampled'], True)} | "
                         f"{cell(cells['disjoint'], True)} |")
    raw = {label: {mode: row[mode] for mode in MODES} for label, row in results.items()}
    lines += ["", "Counts (rejected, resamplings) per budget:", "", "```json", json.dumps(raw),
              json.dumps(honest), "```", ""]
    write_atomic(args.out, "\n".join(lines))
    print(f"wrote {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--per-prompt", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--samples", type=int, default=6, help="reference draws per unit (rank)")
    ap.add_argument("--batch", type=int, default=40)
    ap.add_argument("--resamplings", type=int, default=2000)
    ap.add_argument("--raw-resamplings", type=int, default=500, help="resamplings for rank-raw (comparison only)")
    ap.add_argument("--mmd-resamplings", type=int, default=100)
    ap.add_argument("--met-resamplings", type=int, default=10)
    ap.add_argument("--met-python", default="", help="python of an environment with model-equality-testing")
    ap.add_argument("--met-batch", type=int, default=10, help="MET cases per start of its environment")
    ap.add_argument("--permutations-only", type=int, default=0, metavar="STEP",
                    help="only extend the mmd / MET counts, every variant in turn by STEP groups (MET: STEP // 4), "
                         "up to --mmd-resamplings / --met-resamplings (a long run that can be stopped)")
    ap.add_argument("--surprise-draws", action=argparse.BooleanOptionalAction, default=True,
                    help="surprise's honest fp32 pool includes the 120-unit pool's reference draws (rescored last)")
    ap.add_argument("--tilted", action="store_true", help="with --pools-only: also rescore every pool with the "
                    "surprise test's tilts (in --variants order, then the draws and the large honest pools)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated labels to generate / count "
                    "(the table is written once every variant's counts are cached)")
    ap.add_argument("--fpr", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pools-only", action="store_true", help="generate and score the pools, no table")
    ap.add_argument("--reverse", action="store_true", help="generate the variants' pools in reverse order (a "
                    "second process filling the same cache)")
    ap.add_argument("--honest-prompts", type=int, default=400, help="prompts of the large honest pools")
    ap.add_argument("--honest-draws", type=int, default=14, help="fp32 draws per prompt of the honest pool")
    ap.add_argument("--honest-bf16", type=int, default=2, help="bf16 completions per prompt of the honest pool")
    ap.add_argument("--honest-parts", default="fp32,bf16", help="which honest pools to generate (fp32, bf16) and, "
                    "for surprise, rescore and judge")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/seedless_power.md"))
    args = ap.parse_args()
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.honest_parts = [v.strip() for v in args.honest_parts.split(",") if v.strip()]
    args.rescore = args.tilted or not (args.pools_only or args.permutations_only)
    if unknown := set(args.variants) - set(VARIANTS):
        ap.error(f"--variants: unknown {sorted(unknown)}; choose among {list(VARIANTS)}")
    torch.set_num_threads(args.threads)
    backend = Backend.load("smollm2-135m")
    cache = cache_root() / "studies" / "seedless_power" / (f"p{args.prompts}-c{args.per_prompt}-t{args.max_tokens}"
                                                           f"-m{args.samples}")
    cache.mkdir(parents=True, exist_ok=True)
    data = pools(args, backend, cache)
    if args.permutations_only:
        step = args.permutations_only
        for target in range(step, max(args.mmd_resamplings, 4 * args.met_resamplings) + step, step):
            for label in args.variants:
                permutation_counts(args, data, label, cache, min(target, args.mmd_resamplings),
                                   min(target // 4, args.met_resamplings))
        return
    data["honest"] = honest_pool(args, backend, cache)
    if args.rescore and args.surprise_draws and "fp32" in args.honest_parts:  # last: the largest rescoring
        m = args.samples
        data["tilted draws"] = tilted(backend, cache / "tilted-draws.npz",
                                      [p for p in data["prompt_ids"] for _ in range(m)],
                                      [o for d in data["draws"] for o in d], data["draw_scores"].logprob)
    if args.pools_only:
        return
    table(args, data, cache)


if __name__ == "__main__":
    main()
