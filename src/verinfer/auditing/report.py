"""Audit reports: a JSON document and a self-contained HTML page (inline SVG plots, no links out).

The HTML shows what a person needs to act on: each provider's verdict line, a comparison table
(with Holm-adjusted p-values when several providers were audited), the pooled statistic with its
interval against the bands' ranges at the same number of tokens, the per-token margin histogram
against the honest band, tokenization drift, and a per-prompt table whose output tokens are
highlighted where the reference disagrees with the provider. What each provider said it served
(model id, usage, returned tokens) is listed with a warning for every contradiction with the request.

Both files are written atomically (``verinfer.files.write_atomic``) and redacted
(``verinfer.auditing.secrets``): no API key and no ``user:password@`` of a provider URL reaches them.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from verinfer.auditing.bands import HIST_EDGES, histogram
from verinfer.auditing.draws import store_path
from verinfer.auditing.pacing import pacing_warning
from verinfer.auditing.run import AuditResult, ProviderAudit
from verinfer.auditing.secrets import redact, redact_text
from verinfer.files import write_atomic
from verinfer.stats.pooling import MARGIN_CLIP

TEMPLATE = Path(__file__).with_name("templates") / "report.html.j2"


def prompt_text(tokenizer, claim) -> str:
    """The prompt a provider was asked to continue, as text: our chat-template rendering decoded
    without special tokens (so a report reader sees the question, not only its id)."""
    return tokenizer.decode(claim.prompt_token_ids, skip_special_tokens=True).strip()


def prompt_rows(audit: ProviderAudit, tokenizer, clip: float) -> list[dict]:
    """One row per verified sequence: the prompt's text, scores and the output as tokens with their
    margins (seedless modes: the per-prompt results and the first completion's text)."""
    if audit.prompts is not None:
        first = {}
        for c in audit.claims:
            first.setdefault(c.prompt_id, c)
        return [{**r, "prompt_text": prompt_text(tokenizer, first[r["prompt_id"]]),
                 "pieces": [(tokenizer.decode(first[r["prompt_id"]].output_token_ids, skip_special_tokens=True), None)]}
                for r in audit.prompts]
    ids = np.asarray(audit.columns["trace_id"], dtype=object)
    margin = np.asarray(audit.columns["margin"], dtype=np.float64)
    rows = []
    for c in audit.claims:
        m = margin[ids == f"{audit.endpoint.name}/{c.prompt_id}"]
        pieces = [tokenizer.decode([t]) for t in c.output_token_ids]
        rows.append({"prompt_id": c.prompt_id, "prompt_text": prompt_text(tokenizer, c), "tokens": int(m.size),
                     "exact": int((m == 0).sum()),
                     "mean_clipped_margin": float(np.minimum(m, clip).mean()) if m.size else 0.0,
                     "divergent_positions": [int(i) for i in np.flatnonzero(m > 0)],
                     "token_source": c.source, "drift": c.drift,
                     "served": {k: v for k, v in c.served.items() if k not in ("requested_model", "max_tokens")},
                     "pieces": list(zip(pieces, m.tolist()))})  # rendered by templates/tokens.html.j2
    return rows


def _svg(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def bands_plot(audit: ProviderAudit) -> str:
    """The provider's pooled statistic and interval against each band's 95% range at its size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    v = audit.verdict
    labels = list(v.band_ranges)
    fig, ax = plt.subplots(figsize=(7, 0.45 * (len(labels) + 1) + 1.2))
    for y, name in enumerate(labels):
        lo, mid, hi = v.band_ranges[name]
        ax.plot([lo, hi], [y, y], lw=9, color="#9ecae1" if "reference" in name or "bf16" in name else "#fdae6b",
                solid_capstyle="butt")
        ax.plot([mid], [y], "|", color="#444", ms=14)
    y = len(labels)
    ax.errorbar([v.statistic], [y], xerr=[[v.statistic - v.ci_low], [v.ci_high - v.statistic]], fmt="o",
                color="#c0392b" if not v.consistent else "#1e8449", capsize=5, ms=8)
    ax.set_yticks(range(len(labels) + 1), labels + [f"{audit.endpoint.name} (95% CI)"])
    ax.set_xscale("symlog", linthresh=1e-3)
    ax.set_xlim(0, 1.5 * max([v.ci_high, v.statistic] + [r[2] for r in v.band_ranges.values()]) + 1e-3)
    ax.set_xlabel(f"mean clipped margin over {v.tokens} tokens (bands: 2.5-97.5% of pseudo-audits)")
    ax.grid(axis="x", alpha=0.3)
    return _svg(fig)


def histogram_plot(audit: ProviderAudit, honest_counts: list[int] | None) -> str:
    """Share of tokens per margin bin: the provider against the pooled honest bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if audit.prompts is not None:
        return rank_plot(audit)
    mine = np.asarray(histogram(audit.columns["margin"]), dtype=float)
    labels = ["0", f"<{HIST_EDGES[2]:g}"] + [f"{a:g}-{b:g}" for a, b in zip(HIST_EDGES[2:], HIST_EDGES[3:])] + [
        f">={HIST_EDGES[-1]:g}"]
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(7, 2.8))
    width = 0.4 if honest_counts else 0.8
    ax.bar(x - (width / 2 if honest_counts else 0), mine / mine.sum(), width, label=audit.endpoint.name,
           color="#c0392b")
    if honest_counts:
        h = np.asarray(honest_counts, dtype=float)
        ax.bar(x + width / 2, h / h.sum(), width, label="honest bands", color="#3182bd")
    ax.set_yscale("log")
    ax.set_xticks(x, labels, rotation=30, fontsize=8)
    ax.set_xlabel("per-token margin (raw-logit units)")
    ax.set_ylabel("share of tokens")
    ax.legend(fontsize=8)
    return _svg(fig)


def rank_plot(audit: ProviderAudit) -> str:
    """Seedless modes: the sorted per-prompt rank quantiles against the uniform diagonal (rank mode),
    or a note that the mode has no per-prompt statistic (mmd, logprobs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    u = np.sort([r["rank_quantile"] for r in audit.prompts if "rank_quantile" in r])
    if u.size:
        ax.plot((np.arange(u.size) + 0.5) / u.size, u, "o", color="#c0392b", ms=4, label=audit.endpoint.name)
        ax.plot([0, 1], [0, 1], color="#3182bd", label="uniform (honest)")
        ax.set_xlabel("expected quantile")
        ax.set_ylabel("rank quantile among reference draws")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, f"{audit.verdict.statistic_name}: one statistic over all prompts", ha="center", va="center")
        ax.set_axis_off()
    return _svg(fig)


def warning_lines(audit: ProviderAudit) -> list[str]:
    """The contradictions between what the provider said it served and what was asked (redacted), and
    the re-tokenization drift that left tokens out of the verdict (``verinfer.auditing.alignment``)."""
    lines = [redact_text(w) for w in audit.served.get("warnings", [])]
    realigned, unaligned = audit.drift.get("realigned") or {}, audit.drift.get("unaligned") or {}
    if realigned.get("total"):
        lines.append(f"{realigned['total']} re-tokenized position(s) in {realigned['sequences']} sequence(s) re-split "
                     "where the text allowed the reference's token or edited to agree with the provider's usage "
                     "count (tokenization drift, not scored)")
    if unaligned.get("total"):
        lines.append(f"{unaligned['sequences']} re-tokenized output(s) disagree with the provider's usage count "
                     f"after alignment: {unaligned['total']} token(s) past where the alignment is known to hold "
                     "not scored (ask the provider for token ids)")
    paced = pacing_warning(audit.pacing)
    return lines + ([paced] if paced else [])


def to_json(result: AuditResult, tokenizer) -> dict:
    """The report as a JSON-ready dict, with every secret redacted."""
    clip = result.bands.clip if result.bands else MARGIN_CLIP
    return redact({
        "format": "verinfer.audit.report/1",
        "reference": result.reference, "fpr": result.fpr, "calibration": result.judged_by, "elapsed_s": round(result.elapsed_s, 2),
        "spec": result.spec.__dict__,
        "bands": None if result.bands is None else {"source": display_path(result.bands.source, result.out_dir), "clip": result.bands.clip,
                                                    "statistic": result.bands.data.get("statistic")},
        "logprob_gap_bands": None if result.gap_bands is None else {
            "source": display_path(result.gap_bands.source, result.out_dir), "clip": result.gap_bands.clip,
            "prompts": result.gap_bands.prompt_set,
            "statistic": result.gap_bands.data.get("statistic")},
        "providers": [{
            "name": a.endpoint.name, "base_url": a.endpoint.base_url, "model": a.endpoint.model,
            "verdict": a.verdict.to_dict(), "warnings": warning_lines(a), "served": a.served,
            "drift": a.drift, "requests_sent": a.requests_sent, "concurrency": a.pacing,
            "responses_stored": a.responses_stored, "damaged_lines": a.damaged_lines, "empty_outputs": a.empty_outputs,
            "prompts": [{k: v for k, v in r.items() if k != "pieces"} for r in prompt_rows(a, tokenizer, clip)],
            **({"tests": a.tests} if a.tests is not None else {}),  # auto mode (verinfer.auditing.auto)
            **({"reference_draws": display_path(store_path(result.out_dir), result.out_dir)}
               if a.prompts is not None and store_path(result.out_dir).exists() else {}),  # surprise draws none
        } for a in result.providers],
    })


def display_path(path: str | Path, out_dir: Path) -> str:
    """A path as a report shows it: relative to the audit directory when inside it, else the shipped
    file's name (never the installation's absolute path)."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path(out_dir).resolve()))
    except ValueError:
        return path.name


def write_reports(result: AuditResult, tokenizer) -> tuple[Path, Path]:
    """``audit.json`` and ``audit.html`` in the audit directory, each written atomically."""
    import jinja2

    clip = result.bands.clip if result.bands else MARGIN_CLIP
    doc = to_json(result, tokenizer)
    json_path = result.out_dir / "audit.json"
    write_atomic(json_path, json.dumps(doc, indent=1, default=str))
    honest = None
    if result.bands is not None:
        honest = np.sum([b.histogram for b in result.bands.bands if b.honest], axis=0).tolist()
    providers = [{"audit": a, "json": d, "bands_svg": bands_plot(a) if a.verdict.band_ranges else None,
                  "hist_svg": histogram_plot(a, honest), "rows": prompt_rows(a, tokenizer, clip)}
                 for a, d in zip(result.providers, doc["providers"])]
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE.parent), undefined=jinja2.StrictUndefined,
                             autoescape=jinja2.select_autoescape(["html", "j2"]))
    page = env.get_template(TEMPLATE.name).render(result=result, doc=doc, providers=providers, clip=clip,
                                                  several=len(result.providers) > 1)
    html_path = result.out_dir / "audit.html"
    write_atomic(html_path, redact_text(page))
    return json_path, html_path
