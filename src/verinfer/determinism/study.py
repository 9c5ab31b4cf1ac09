"""Measurements and experiments: the seed paper's observations 1-3, the baselines, the threshold sweep.

- ``measure``: run the reference (deterministic path) and the fast path over the same dynamic-batch
  schedule and report the synchronous token-flip rate, the margins at flips against stable steps, the
  logit perturbation, and the K/V deviation from the reference before and at the first flip.
- ``evaluate``: run policies side by side (interleaved repeats) and score each against the reference:
  trigger rate, repair rate, sequence-level determinism of protected requests, wall and CPU time.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from verinfer.determinism.engine import Engine, Output, Policy, Request, Run
from verinfer.determinism.model import Llama

PROMPT_SETS = ("chitchat", "human-eval", "gsm8k")


def load_prompt_set(name: str, n: int, seed: int = 0):
    """A seeded sample of ``n`` prompts from a built-in set of ``verinfer.prompts`` or a file."""
    from verinfer.prompts import load_prompts

    return load_prompts(name, n, seed)


def make_requests(tokenizer, prompts, max_new_tokens: int, arrival_gap: int = 2,
                  protected: Sequence[bool] | None = None) -> list[Request]:
    """One request per prompt; request i arrives at engine step ``i * arrival_gap`` (a changing batch)."""
    from verinfer.prompts import render

    out = []
    for i, p in enumerate(prompts):
        prot = True if protected is None else bool(protected[i])
        out.append(Request(p.id, tuple(render(tokenizer, p)), max_new_tokens, prot, i * arrival_gap))
    return out


# ----- observations 1-3 ---------------------------------------------------------------------------

class TopRecorder:
    """Engine observer: the top-``k`` logits of every emitted token of a run."""

    def __init__(self, k: int = 8):
        self.k = k
        self.top: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, request: Request, index: int, logits: torch.Tensor) -> None:
        values, ids = logits.topk(self.k)
        self.top[(request.id, index)] = (ids, values)


class DeviationRecorder:
    """Engine observer for the fast run: its logits at the reference's top-k ids, and the reference
    token's rank in its logits (0 = its own top-1)."""

    def __init__(self, reference: TopRecorder):
        self.reference = reference
        self.dev: dict[tuple[str, int], float] = {}
        self.rank: dict[tuple[str, int], int] = {}

    def __call__(self, request: Request, index: int, logits: torch.Tensor) -> None:
        key = (request.id, index)
        if key not in self.reference.top:
            return
        ids, values = self.reference.top[key]
        self.dev[key] = float((logits[ids] - values).abs().max())
        self.rank[key] = int((logits > logits[ids[0]]).sum())


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts at the shorter end)."""
    for k in range(min(len(a), len(b))):
        if a[k] != b[k]:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class KVSummary:
    layers: list[int]
    prompt: list[float]  # mean relative K error over prompt positions, per layer
    pre: list[float]  # mean over decoded positions before the first flip (flip trials)
    pre_max: list[float]
    at_flip: list[float]  # at the flipped token's column
    post: list[float]  # after it
    stable: list[float]  # mean over decoded positions of trials with no flip
    pre_slope: list[float]  # median per-trial slope of the pre-flip error, per position
    v_pre: list[float] = field(default_factory=list)
    v_at_flip: list[float] = field(default_factory=list)


@dataclass
class Measurement:
    name: str
    sequences: int
    sync_steps: int
    flips: int
    flip_margins: list[float]  # fast-path top-1/top-2 margin at each flip
    stable_margins: np.ndarray  # at every synchronous non-flip step
    flip_ref_ranks: list[int]  # rank of the reference token in the fast logits at a flip (1 = second)
    logit_dev: np.ndarray  # per synchronous step: max |fast - ref| over the reference's top-8 ids
    kv: KVSummary | None
    # with ``verifier_fidelity``: the deterministic step recomputed on the fast path's cache at every
    # synchronous step (what a verifier would see), against the reference
    verifier_dev: np.ndarray | None = None
    verifier_mismatches: int | None = None

    @property
    def flip_rate(self) -> float:
        return self.flips / self.sync_steps if self.sync_steps else 0.0

    def below(self, delta: float) -> tuple[float, float]:
        """Fraction of stable and of flip steps whose fast margin is below ``delta``."""
        st = float((self.stable_margins < delta).mean()) if self.stable_margins.size else math.nan
        fl = float(np.mean([m < delta for m in self.flip_margins])) if self.flip_margins else math.nan
        return st, fl


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per layer and position: ||a - b|| / ||b|| over heads and head dims. a, b: [L', Hkv, T, hd]."""
    a, b = a.float(), b.float()
    return (a - b).norm(dim=(1, 3)) / b.norm(dim=(1, 3)).clamp_min(1e-30)


def _kv_summary(reqs: Sequence[Request], ref: dict[str, Output], fast: dict[str, Output], layers: list[int],
                firsts: dict[str, int | None]) -> KVSummary:
    nl = len(layers)
    acc = {k: [[] for _ in range(nl)] for k in ("prompt", "pre", "pre_max", "at", "post", "stable", "slope",
                                                 "v_pre", "v_at")}
    for r in reqs:
        fk, fv = fast[r.id].cache
        rk, rv = ref[r.id].cache
        n = min(fk.shape[2], rk.shape[2])
        ek, ev = _rel_err(fk[:, :, :n], rk[:, :, :n]), _rel_err(fv[:, :, :n], rv[:, :, :n])
        p = len(r.prompt)
        first = firsts[r.id]
        for li in range(nl):
            acc["prompt"][li].append(float(ek[li, :p].mean()))
            if first is None:
                if n > p:
                    acc["stable"][li].append(float(ek[li, p:n].mean()))
                continue
            flip_pos = p + first
            pre = ek[li, p:min(flip_pos, n)]
            if pre.numel():
                acc["pre"][li].append(float(pre.mean()))
                acc["pre_max"][li].append(float(pre.max()))
                acc["v_pre"][li].append(float(ev[li, p:min(flip_pos, n)].mean()))
            if pre.numel() >= 3:
                x = np.arange(pre.numel(), dtype=float)
                acc["slope"][li].append(float(np.polyfit(x, pre.numpy(), 1)[0]))
            if flip_pos < n:
                acc["at"][li].append(float(ek[li, flip_pos]))
                acc["v_at"][li].append(float(ev[li, flip_pos]))
                if flip_pos + 1 < n:
                    acc["post"][li].append(float(ek[li, flip_pos + 1:n].mean()))

    def mean(xs):
        return float(np.mean(xs)) if xs else math.nan

    def med(xs):
        return float(np.median(xs)) if xs else math.nan

    return KVSummary(layers, [mean(x) for x in acc["prompt"]], [mean(x) for x in acc["pre"]],
                     [max(x) if x else math.nan for x in acc["pre_max"]], [mean(x) for x in acc["at"]],
                     [mean(x) for x in acc["post"]], [mean(x) for x in acc["stable"]],
                     [med(x) for x in acc["slope"]], [mean(x) for x in acc["v_pre"]], [mean(x) for x in acc["v_at"]])


class VerifierProbe:
    """Fault hook that only looks: at every fast step, recompute the step deterministically on the
    fast path's own cache (``decode_det`` without commit) and compare with the reference."""

    def __init__(self, model: Llama, reference: TopRecorder):
        self.model, self.reference = model, reference
        self.dev: dict[tuple[str, int], float] = {}
        self.same: dict[tuple[str, int], bool] = {}

    def __call__(self, site) -> None:
        key = (site.request.id, site.index)
        if key not in self.reference.top:
            return
        logits, _, _ = self.model.decode_det(site.pool, [site.slot], torch.tensor([site.token_in]), [site.pos],
                                             commit=False)
        ids, values = self.reference.top[key]
        self.dev[key] = float((logits[0, ids] - values).abs().max())
        self.same[key] = int(logits[0].argmax()) == int(ids[0])


def measure(model: Llama, requests: Sequence[Request], max_batch: int, stop_ids: set[int], max_len: int,
            name: str = "", kv_layers: Sequence[int] | None = None,
            verifier_fidelity: bool = False) -> tuple[Measurement, Run, Run]:
    """Observations 1-3 for the fast path against the reference over one dynamic-batch schedule.
    Returns the measurement and the two runs (reference, fast)."""
    n_layers = len(model.layers)
    layers = list(kv_layers) if kv_layers is not None else sorted({0, n_layers // 2, n_layers - 1})
    top = TopRecorder()
    ref_run = Engine(model, max_batch, max_len, stop_ids, keep_layers=layers, observer=top).run(
        requests, Policy.deterministic())
    dev = DeviationRecorder(top)
    probe = VerifierProbe(model, top) if verifier_fidelity else None
    fast_run = Engine(model, max_batch, max_len, stop_ids, keep_layers=layers, observer=dev, fault=probe).run(
        requests, Policy.fast())
    ref, fast = ref_run.outputs, fast_run.outputs
    sync_steps, flips, flip_margins, ranks, stable, devs = 0, 0, [], [], [], []
    vdevs, vbad = [], 0
    firsts = {}
    for r in requests:
        a, b = fast[r.id], ref[r.id]
        first = first_divergence(a.tokens, b.tokens)
        firsts[r.id] = first
        end = first if first is not None else len(a.tokens)
        if first is not None and first >= min(len(a.tokens), len(b.tokens)):
            first, end = None, min(len(a.tokens), len(b.tokens))  # one stopped early: no token flip
            firsts[r.id] = None
        stable.extend(a.margins[:end])
        if probe is not None:
            for k in range(end + (first is not None)):
                if (r.id, k) in probe.dev:
                    vdevs.append(probe.dev[(r.id, k)])
                    vbad += not probe.same[(r.id, k)]
        devs.extend(dev.dev[(r.id, k)] for k in range(end) if (r.id, k) in dev.dev)
        sync_steps += end
        if first is not None:
            sync_steps += 1
            flips += 1
            flip_margins.append(a.margins[first])
            ranks.append(dev.rank.get((r.id, first), -1))
            devs.append(dev.dev.get((r.id, first), math.nan))
    kv = _kv_summary(requests, ref, fast, layers, firsts)
    m = Measurement(name, len(requests), sync_steps, flips, flip_margins, np.asarray(stable), ranks,
                    np.asarray(devs), kv, np.asarray(vdevs) if probe else None, vbad if probe else None)
    return m, ref_run, fast_run


# ----- policies against the reference -------------------------------------------------------------

@dataclass
class Row:
    prompts: str
    policy: str
    batch: int
    wall_s: float
    cpu_s: float
    protected: int
    identical: int  # protected requests whose output equals the reference output
    decode_steps: int  # protected decode steps
    verifier_steps: int
    repairs: int
    verifier_calls: int
    verify_s: float = 0.0  # time inside verifier calls (the only work MarginGate adds to always-on's shared costs)
    verifier_rows: int = 0  # positions recomputed by the verifier (window rule: more than one per launch)
    rollbacks: int = 0  # window rule: flips the gate missed, found later and rolled back
    dropped_tokens: int = 0
    final_checks: int = 0  # window rule: launches at a request's end (counted in verifier_steps)
    overhead: float = math.nan  # wall time / fast wall time - 1
    cpu_overhead: float = math.nan

    @property
    def determinism(self) -> float:
        return self.identical / self.protected if self.protected else math.nan

    @property
    def trigger_rate(self) -> float:
        return self.verifier_steps / self.decode_steps if self.decode_steps else 0.0

    @property
    def repair_rate(self) -> float:
        return self.repairs / self.decode_steps if self.decode_steps else 0.0


def identical_count(run: Run, reference: dict[str, Output]) -> tuple[int, int]:
    prot = [o for o in run.outputs.values() if o.protected]
    return sum(o.tokens == reference[o.id].tokens for o in prot), len(prot)


def evaluate(model: Llama, requests: Sequence[Request], policies: Sequence[Policy], reference: dict[str, Output],
             max_batch: int, stop_ids: set[int], max_len: int, repeats: int = 1, name: str = "",
             runs_out: dict[str, Run] | None = None) -> list[Row]:
    """Run every policy ``repeats`` times, interleaved (policy order rotates each repeat), and score the
    protected outputs against ``reference``. Times are medians; overheads are against the ``fast`` row
    (run one if the list has none)."""
    policies = list(policies)
    if not any(p.mode == "fast" for p in policies):
        policies = [Policy.fast()] + policies
    engine = Engine(model, max_batch, max_len, stop_ids)
    walls: dict[str, list[float]] = {p.name: [] for p in policies}
    cpus: dict[str, list[float]] = {p.name: [] for p in policies}
    vers: dict[str, list[float]] = {p.name: [] for p in policies}
    last: dict[str, Run] = {}
    for rep in range(repeats):
        order = policies[rep % len(policies):] + policies[:rep % len(policies)]
        for p in order:
            run = engine.run(requests, p)
            walls[p.name].append(run.stats.wall_s)
            cpus[p.name].append(run.stats.cpu_s)
            vers[p.name].append(run.stats.verify_s)
            last[p.name] = run
    rows = []
    for p in policies:
        run = last[p.name]
        same, prot = identical_count(run, reference)
        s = run.stats
        rows.append(Row(name, p.name, max_batch, statistics.median(walls[p.name]), statistics.median(cpus[p.name]),
                        prot, same, s.protected_decode_steps, s.verifier_steps, s.repairs, s.verifier_calls,
                        statistics.median(vers[p.name]), s.verifier_rows, s.rollbacks, s.dropped_tokens,
                        s.final_checks))
    fast = next(r for r in rows if r.policy == "fast")
    for r in rows:
        r.overhead = r.wall_s / fast.wall_s - 1
        r.cpu_overhead = r.cpu_s / fast.cpu_s - 1
    if runs_out is not None:
        runs_out.update(last)
    return rows


def choose_threshold(rows: Sequence[Row], suffix: str = "", target: float = 1.0) -> float | None:
    """The smallest swept threshold of the rule named by ``suffix`` ("" = window, "/current-column",
    "/repair-only") whose protected outputs all match the reference (``target``) with no rollback:
    the gate alone caught every flip. (The window rule always matches; its rollbacks are the misses.)"""
    ok = []
    for r in rows:
        head, _, tail = r.policy.partition("@")
        value, slash, rule = tail.partition("/")
        if head == "margingate" and slash + rule == suffix and r.determinism >= target and r.rollbacks == 0:
            ok.append(float(value))
    return min(ok) if ok else None


# ----- tables -------------------------------------------------------------------------------------

def fmt_rate(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.2f}%"


def measurement_table(ms: Sequence[tuple[str, Measurement]]) -> str:
    lines = ["| dtype / prompts | sequences | synchronous steps | flips | flip rate | flip margins (fast) "
             "| stable margin median | ref token rank in fast logits at flips (1 = tied with the top) | max logit dev. (median / max) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, m in ms:
        fm = ", ".join(f"{x:.3g}" for x in sorted(m.flip_margins)) or "-"
        rk = ", ".join(str(x + 1) for x in m.flip_ref_ranks) or "-"
        med = float(np.median(m.stable_margins)) if m.stable_margins.size else math.nan
        dv = m.logit_dev[~np.isnan(m.logit_dev)] if m.logit_dev.size else m.logit_dev
        dev = f"{np.median(dv):.3g} / {np.max(dv):.3g}" if dv.size else "-"
        lines.append(f"| {label} | {m.sequences} | {m.sync_steps} | {m.flips} | {fmt_rate(m.flip_rate)} | {fm} | "
                     f"{med:.3g} | {rk} | {dev} |")
    return "\n".join(lines)


def fidelity_table(ms: Sequence[tuple[str, Measurement]]) -> str:
    """The verifier recomputing a step on the fast path's cache, against the reference."""
    lines = ["| dtype / prompts | synchronous steps | fast token != reference | verifier token != reference "
             "| fast max logit dev. (median / max) | verifier max logit dev. (median / max) |",
             "|---|---|---|---|---|---|"]
    for label, m in ms:
        if m.verifier_dev is None or not m.verifier_dev.size:
            continue
        dv = m.logit_dev[~np.isnan(m.logit_dev)]
        lines.append(f"| {label} | {m.sync_steps} | {m.flips} | {m.verifier_mismatches} | "
                     f"{np.median(dv):.3g} / {np.max(dv):.3g} | "
                     f"{np.median(m.verifier_dev):.3g} / {np.max(m.verifier_dev):.3g} |")
    return "\n".join(lines)


def margin_table(ms: Sequence[tuple[str, Measurement]], deltas: Sequence[float]) -> str:
    head = " | ".join(f"m < {d:g}: stable / flip" for d in deltas)
    lines = [f"| dtype / prompts | {head} |", "|---|" + "---|" * len(deltas)]
    for label, m in ms:
        cells = []
        for d in deltas:
            st, fl = m.below(d)
            cells.append(f"{fmt_rate(st)} / {fmt_rate(fl)}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kv_table(ms: Sequence[tuple[str, Measurement]]) -> str:
    lines = ["| dtype / prompts | layer | K prompt | K pre-flip mean (max) | K at flip | K post-flip "
             "| K no-flip trials | pre-flip slope /token | V pre-flip | V at flip |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, m in ms:
        kv = m.kv
        if kv is None:
            continue
        for i, layer in enumerate(kv.layers):
            lines.append(f"| {label} | {layer} | {kv.prompt[i]:.2e} | {kv.pre[i]:.2e} ({kv.pre_max[i]:.2e}) | "
                         f"{kv.at_flip[i]:.2e} | {kv.post[i]:.2e} | {kv.stable[i]:.2e} | {kv.pre_slope[i]:.1e} | "
                         f"{kv.v_pre[i]:.2e} | {kv.v_at_flip[i]:.2e} |")
    return "\n".join(lines)


def rows_table(rows: Sequence[Row], always: dict[tuple[str, int], Row] | None = None) -> str:
    """Markdown table; ``vs always-on`` is this row's overhead over the always-on row's (same set/batch)."""
    lines = ["| prompts | batch | policy | verifier launches / step (gate only) | recomputed / step | repair rate | rollbacks (dropped tokens) "
             "| seq. determinism | wall s | overhead | CPU overhead | overhead / always-on's | verifier s (/ always-on's) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = None
        if always is not None:
            ref = always.get((r.prompts, r.batch))
        ratio, vratio = "-", f"{r.verify_s:.1f}"
        if ref is not None and ref.overhead > 0 and r.policy.startswith("margingate"):
            ratio = f"{r.overhead / ref.overhead:.2f} (CPU {r.cpu_overhead / ref.cpu_overhead:.2f})"
        if ref is not None and ref.verify_s > 0 and r.policy.startswith("margingate"):
            vratio = f"{r.verify_s:.1f} ({r.verify_s / ref.verify_s:.2f})"
        per_step = fmt_rate(r.verifier_rows / r.decode_steps) if r.decode_steps else "-"
        gate = fmt_rate((r.verifier_steps - r.final_checks) / r.decode_steps) if r.decode_steps else "-"
        lines.append(f"| {r.prompts} | {r.batch} | {r.policy} | {fmt_rate(r.trigger_rate)} ({gate}) | {per_step} | "
                     f"{fmt_rate(r.repair_rate)} | {r.rollbacks} ({r.dropped_tokens}) | "
                     f"{r.identical}/{r.protected} | {r.wall_s:.1f} | {100 * r.overhead:+.1f}% | "
                     f"{100 * r.cpu_overhead:+.1f}% | {ratio} | {vratio} |")
    return "\n".join(lines)
