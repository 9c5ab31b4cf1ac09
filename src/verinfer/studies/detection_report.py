"""Analyse the detection matrix: AUC-vs-tokens curves, tokens needed, held-out FPR, tables and plots.

``analyse`` is pure over the cached per-token scores (see ``detection``); ``write_report`` turns its
result into ``detection.json``, ``detection.md`` and two figures (AUC vs tokens per
misconfiguration, like DiFR figures 1-3, and the cross-entropy attack, like figure 2).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import numpy as np

from verinfer.files import write_atomic
from verinfer.stats.summary import token_statistics
from verinfer.studies.detection import ConfigData, Matrix, pool, split, split_ids
from verinfer.stats.power import (BATCH_SIZES, COMBINED, DETECTORS, fit_transforms, held_out, power_curves,
                                  tokens_to_reach)

TARGET_AUC = 0.99
MARGIN_LABELS = tuple(d.label for d in DETECTORS if d.metric in ("margin", "likelihood"))
CROSS_ENTROPY = "cross-entropy clip 99.99"
HELD_OUT_SIZES = (1, 10, 100)


def analyse(data: dict[str, ConfigData], matrix: Matrix, batch_sizes: Sequence[int] = BATCH_SIZES,
            n_batches: int = 1000, n_boot: int = 100, fpr: float = 0.01) -> dict:
    """Everything the report shows, as JSON-ready data."""
    test_ids = split_ids(data, matrix.split_seed)
    halves = {name: split(d.columns, test_ids) for name, d in data.items()}
    honest = [n for n, d in data.items() if d.config.honest]
    bad = [n for n, d in data.items() if not d.config.honest]
    h_train = pool([halves[n][0] for n in honest])
    h_test = pool([halves[n][1] for n in honest])
    transforms = fit_transforms(h_train)
    sizes = [n for n in batch_sizes if n >= 1]
    result: dict = {
        "settings": {"matrix": {k: v for k, v in matrix.__dict__.items()}, "batch_sizes": sizes,
                     "n_batches": n_batches, "n_boot": n_boot, "fpr": fpr, "target_auc": TARGET_AUC},
        "tokens": {n: {"total": d.tokens, "train": int(halves[n][0]["margin"].size),
                       "test": int(halves[n][1]["margin"].size)} for n, d in data.items()},
        "honest_pool": honest,
        "percentiles": transforms.to_dict()["metrics"],
        "honest_noise": {n: _noise(data[n].columns) for n in data},
        "configs": {},
    }
    for name in bad:
        curves = power_curves(transforms, h_train, h_test, halves[name][0], halves[name][1],
                              batch_sizes=sizes, n_batches=n_batches, n_boot=n_boot, max_fpr=fpr)
        config = data[name].config
        needed = {label: tokens_to_reach(points, TARGET_AUC) for label, points in curves.items()}
        result["configs"][name] = {
            "variant": config.variant, "target": config.target, "target_detector": config.target_detector,
            "attack": data[name].info if config.attack else None,
            "tokens_needed": needed,
            "curves": {label: [{"tokens": p.tokens, "auc": p.auc.estimate, "low": p.auc.low, "high": p.auc.high,
                                "oriented": p.oriented} for p in points] for label, points in curves.items()},
            "verdict": _verdict(config, needed, curves, sizes),
        }
    _, fprs = held_out(h_train, h_test, DETECTORS, HELD_OUT_SIZES, fpr)
    result["held_out_fpr"] = [{"detector": label, "tokens": n, "flagged": p.k, "batches": p.n,
                               "rate": p.estimate, "low": p.low, "high": p.high,
                               "covers_target": bool(p.low <= fpr <= p.high), "holds": bool(p.low <= fpr)}
                              for (label, n), p in fprs.items()]
    return result


def _noise(columns: dict[str, np.ndarray]) -> dict:
    m = columns["margin"]
    finite = m[np.isfinite(m)]
    t = token_statistics(columns)
    return {"exact_match": t["exact_match_rate"], "filtered": t["filtered_rate"], "mean_margin_bound20": t["mean_margin"],
            "p99_margin": float(np.percentile(finite, 99)) if finite.size else None,
            "p999_margin": float(np.percentile(finite, 99.9)) if finite.size else None,
            "mean_cross_entropy": t["mean_cross_entropy"]}


def _verdict(config, needed: dict, curves: dict, sizes: Sequence[int]) -> dict:
    """Best Token-DiFR detector (or the target's named one) against the paper's bar."""
    labels = (config.target_detector,) if config.target_detector else MARGIN_LABELS
    best = min(labels, key=lambda lb: (needed[lb] is None, needed[lb] or 0, -curves[lb][-1].auc.estimate))
    out = {"detector": best, "tokens": needed[best], "auc_at_max": curves[best][-1].auc.estimate,
           "max_tokens": sizes[-1]}
    if config.target is not None:
        out["met"] = needed[best] is not None and needed[best] <= config.target
    if config.attack:
        ce = curves[CROSS_ENTROPY]
        out["cross_entropy_auc_at_max"] = ce[-1].auc.estimate
        out["cross_entropy_tokens"] = needed[CROSS_ENTROPY]
    return out


def _fmt_tokens(n: int | None, points: list[dict]) -> str:
    if n is not None:
        return f"{n:,}"
    return f">{points[-1]['tokens']:,} ({points[-1]['auc']:.2f})"


def markdown(result: dict) -> str:
    """The tables: tokens needed per detector and configuration, targets, noise, held-out FPR."""
    s = result["settings"]
    lines = [f"Tokens needed for AUC at {s['fpr']:.0%} FPR >= {s['target_auc']} (batch sizes "
             f"{', '.join(f'{n:,}' for n in s['batch_sizes'])}; `>N (x)`: not reached, AUC x at N tokens). "
             f"{s['n_batches']} batches per side and size, {s['n_boot']} bootstrap resamples.", ""]
    labels = [d.label for d in DETECTORS] + [COMBINED]
    lines += ["| configuration | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for name, c in result["configs"].items():
        cells = [_fmt_tokens(c["tokens_needed"][lb], c["curves"][lb]) for lb in labels]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Against the paper's bar (best Token-DiFR margin detector unless the target names one):", "",
              "| configuration | target (tokens) | detector | measured tokens | AUC at max size | met |",
              "|---|---|---|---|---|---|"]
    for name, c in result["configs"].items():
        v = c["verdict"]
        met = "-" if "met" not in v else ("yes" if v["met"] else "**no**")
        target = f"{c['target']:,}" if c["target"] else "-"
        lines.append(f"| {name} | {target} | {v['detector']} | {_fmt_tokens(v['tokens'], c['curves'][v['detector']])}"
                     f" | {v['auc_at_max']:.3f} | {met} |")
    attacks = {n: c for n, c in result["configs"].items() if c["attack"]}
    if attacks:
        lines += ["", "Cross-entropy attack (temperature tuned until the verifier's mean cross-entropy matches "
                  "the honest fp32 one):", "",
                  "| configuration | tuned T | its cross-entropy | honest target | cross-entropy AUC at max | "
                  "Token-DiFR tokens needed |", "|---|---|---|---|---|---|"]
        for name, c in attacks.items():
            a, v = c["attack"], c["verdict"]
            lines.append(f"| {name} | {a['temperature']:.3f} | {a['cross_entropy']:.3f} | {a['target']:.3f} | "
                         f"{v['cross_entropy_auc_at_max']:.3f} | "
                         f"{_fmt_tokens(v['tokens'], c['curves'][v['detector']])} ({v['detector']}) |")
    lines += ["", "Per-token noise of every configuration against the fp32 reference:", "",
              "| configuration | tokens | exact match | filtered | mean margin (bound 20) | p99 margin | "
              "p99.9 margin | mean cross-entropy |", "|---|---|---|---|---|---|---|---|"]
    for name, z in result["honest_noise"].items():
        tag = " (honest)" if name in result["honest_pool"] else ""
        lines.append(f"| {name}{tag} | {result['tokens'][name]['total']:,} | {z['exact_match']:.2%} | "
                     f"{z['filtered']:.2%} | {z['mean_margin_bound20']:.4f} | {z['p99_margin']:.3f} | "
                     f"{z['p999_margin']:.3f} | {z['mean_cross_entropy']:.3f} |")
    lines += ["", f"Held-out false-positive rate of thresholds calibrated at {s['fpr']:.0%} on the honest training "
              "half (consecutive disjoint batches), on the honest test half (Wilson 95% interval):", "",
              "| detector | tokens | flagged / batches | rate | 95% interval | covers target | not above target |",
              "|---|---|---|---|---|---|---|"]
    for r in result["held_out_fpr"]:
        lines.append(f"| {r['detector']} | {r['tokens']} | {r['flagged']} / {r['batches']} | {r['rate']:.2%} | "
                     f"{r['low']:.2%} - {r['high']:.2%} | {'yes' if r['covers_target'] else 'no'} | "
                     f"{'yes' if r['holds'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def plot_curves(result: dict, path: Path, names: Sequence[str] | None = None,
                labels: Sequence[str] | None = None, title: str = "AUC at 1% FPR vs tokens per batch") -> Path:
    """One panel per misconfiguration, one line (with its bootstrap band) per detector."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(names or result["configs"])
    labels = list(labels or [d.label for d in DETECTORS if d.label in (
        "margin (bound 20)", "margin clip 99.9", "margin clip 99.999", "margin tail", "likelihood clip 99.9",
        "exact mismatch", CROSS_ENTROPY)] + [COMBINED])
    cols = min(4, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False, sharey=True)
    for ax, name in zip(axes.flat, names):
        c = result["configs"][name]
        for label in labels:
            pts = c["curves"][label]
            x = [p["tokens"] for p in pts]
            line, = ax.plot(x, [p["auc"] for p in pts], marker=".", lw=1.2, label=label)
            ax.fill_between(x, [p["low"] for p in pts], [p["high"] for p in pts], color=line.get_color(), alpha=0.12)
        ax.axhline(TARGET_AUC, color="grey", lw=0.8, ls="--")
        if c["target"]:
            ax.axvline(c["target"], color="red", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_ylim(0.45, 1.02)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("tokens per batch")
    for ax in axes[:, 0]:
        ax.set_ylabel("AUC at 1% FPR")
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    handles, leg = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, leg, loc="lower center", ncol=min(4, len(leg)), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.06 + 0.02 * math.ceil(len(leg) / 4), 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(result: dict, out: Path, machine: str, command: str) -> list[Path]:
    """detection.json, detection.md and the figures under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    result = {**result, "machine": machine, "command": command}
    paths = [out / "detection.json", out / "detection.md"]
    write_atomic(paths[0], json.dumps(result, indent=1, default=str))
    write_atomic(paths[1], f"Command: `{command}`\n\nMachine: {machine}\n\n" + markdown(result))
    plain = [n for n, c in result["configs"].items() if not c["attack"]]
    if plain:
        paths.append(plot_curves(result, out / "auc_vs_tokens.png", plain))
    attacks = [n for n, c in result["configs"].items() if c["attack"]]
    if attacks:
        paths.append(plot_curves(result, out / "ce_attack.png", attacks,
                                 ["margin (bound 20)", "margin clip 99.9", CROSS_ENTROPY, "exact mismatch"],
                                 "Temperature-tuning attack: cross-entropy vs Token-DiFR"))
    return paths


__all__ = ["analyse", "markdown", "plot_curves", "write_report"]
