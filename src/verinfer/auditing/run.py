"""One audit end to end: ask every provider, persist, parse, score against the reference, judge.

All providers' generations are fetched (and persisted) before any scoring starts, so a failure
while scoring never costs a paid request; re-running the same audit directory resumes from what
is stored. Files per provider: ``responses.jsonl`` (raw, as received), ``rejected.jsonl`` (raw
responses that were malformed), ``traces.jsonl`` (what was verified), ``scores.parquet`` (local
reference) and, for a reference API, its own ``reference/responses.jsonl``.

A calibration is checked against the audit's sampling settings before any request, and again
against the traces once the responses are parsed: a provider that reports speculative decoding
(``verinfer_sampling.speculative``) gets traces that claim it, which only a calibration fitted on
the same speculative claim may judge (as ``verinfer verify`` requires of the same traces).
"""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from verinfer.auditing.alignment import align_claims, count_mismatch, unscored
from verinfer.auditing.auto import component_spec, judge_auto, probe_calls
from verinfer.auditing.bands import Bands
from verinfer.auditing.client import Endpoint, ProviderClient, ProviderError, RetryPolicy
from verinfer.auditing.plan import AuditSpec, generation_calls
from verinfer.auditing.responses import claim_traces
from verinfer.auditing.responses import Claim, parse_generation, summarize_drift, summarize_served
from verinfer.auditing.seedless import judge_logprobs, judge_sampled
from verinfer.auditing.store import ResponseStore
from verinfer.prompts import Prompt
from verinfer.scoring.scores import signature, with_reference
from verinfer.scoring.traces import Replays, by_trace
from verinfer.stats.calibration import Calibrator, signature_mismatch
from verinfer.stats.pooling import MARGIN_CLIP, sequence_stats
from verinfer.stats.verdict import Verdict, adjust, calibrated_verdict, pooled_verdict
from verinfer.trace import write_traces


@dataclass
class ProviderAudit:
    endpoint: Endpoint
    claims: list[Claim]
    columns: dict[str, np.ndarray]
    sequences: np.ndarray
    verdict: Verdict
    drift: dict
    requests_sent: int  # HTTP attempts this run (0 when everything was stored)
    responses_stored: int
    damaged_lines: int
    empty_outputs: list[str] = field(default_factory=list)
    served: dict = field(default_factory=dict)  # what the provider said it served, with warnings (summarize_served)
    prompts: list[dict] | None = None  # seedless modes: per-prompt results (verinfer.auditing.seedless)
    tests: list[dict] | None = None  # auto mode: each test, whether it ran and its Holm-adjusted p (auditing.auto)
    pacing: dict = field(default_factory=dict)  # requests in flight: asked, lowest, final (auditing.pacing)


@dataclass
class AuditResult:
    providers: list[ProviderAudit]
    spec: AuditSpec
    reference: str
    fpr: float
    out_dir: Path
    bands: Bands | None
    started: float
    elapsed_s: float
    reports: tuple[Path, Path] | None = None  # (audit.json, audit.html) once written
    gap_bands: Bands | None = None  # the logprobs test's bands, when they judged it
    judged_by: str | None = None  # the calibration that judged the replayed tokens (its file, shipped or given)


def safe_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name):
        raise ValueError(f"provider name {name!r}: use letters, digits, '.', '_' or '-' (it names a directory)")
    return name


def stop_ids(tokenizer) -> set[int]:
    from verinfer.models.backend import Backend

    vocab = tokenizer.get_vocab()
    ids = {vocab[t] for t in Backend.TURN_TERMINATORS if t in vocab}
    return ids | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


def reference_signature(reference, spec: AuditSpec) -> dict | None:
    """What a calibration must match for this audit (None for a reference API: no local dtype)."""
    backend = getattr(reference, "backend", None)
    if backend is None:
        return None
    return with_reference({"model": backend.model_id, "dtype": backend.dtype_name, "sampling": [spec.signature()]},
                          backend.reference_name)


def _unspeculative(sig: dict | None) -> dict | None:
    """A calibration signature without the speculative claims its sampling settings may carry."""
    if sig is None:
        return None
    return {**sig, "sampling": [{k: v for k, v in s.items() if k != "speculative"} for s in sig.get("sampling", [])]}


def run_audit(endpoints: Sequence[Endpoint], prompts: Sequence[Prompt], spec: AuditSpec, reference,
              out_dir: Path, bands: Bands | None = None, calibrator: Calibrator | None = None,
              batch_size: int | None = None, fpr: float = 0.01, concurrency: int = 4,
              policy: RetryPolicy = RetryPolicy(), on_stage: Callable[[str], None] | None = None,
              gap_bands: Bands | None = None, judged_by: str | None = None) -> AuditResult:
    """Audit each endpoint with ``prompts`` as ``spec`` asks; verdicts from ``bands`` or ``calibrator``
    (``gap_bands``: the logprobs test's, in ``--mode logprobs`` and ``auto``; ``judged_by``: the
    calibration's name for the reports)."""
    stage = on_stage or (lambda _: None)
    if spec.problems():
        raise ValueError(spec.problems()[0])
    if spec.mode == "surprise" and getattr(reference, "backend", None) is None:
        raise ValueError("--mode surprise needs the reference's exact per-position moments, which a reference "
                         "API's top-20 logprobs only approximate (honest providers flagged: RESULTS.md section 22); "
                         "use --mode rank, which stays exact with the API's scores")
    if spec.seedless and (bands is not None or calibrator is not None):
        raise ValueError(f"--mode {spec.mode} needs no margin bands or calibration" + (
            " (its bands are logprob-gap bands: `verinfer audit bands --mode logprobs`)" if spec.mode == "logprobs" else
            " (its null is the reference's own sampling distribution)") + "; drop --bands / --calibration")
    for b, kind in ((bands, "margin"), (gap_bands, "logprob-gap")):
        if b is not None and b.kind != kind:
            raise ValueError(f"{b.source}: {b.kind} bands, where {kind} bands were expected")
    if gap_bands is not None and spec.mode not in ("logprobs", "auto"):
        raise ValueError(f"{gap_bands.source}: logprob-gap bands judge --mode logprobs and auto, not --mode {spec.mode}")
    if spec.mode == "auto" and not spec.seeds and (bands is not None or calibrator is not None):
        raise ValueError("bands or a calibration judge auto's seeded test, which needs seeds: add --seeds, or drop "
                         "--bands / --calibration")
    if not spec.seedless and (bands is None) == (calibrator is None) and not (spec.mode == "auto" and bands is None):
        raise ValueError("give exactly one of bands or a calibration file for the verdict" +
                         (" (auto: they judge its seeded test)" if spec.mode == "auto" else ""))
    if calibrator is not None:  # refuse before any request is paid for (speculation is only known from
        # the responses, which claim it in verinfer_sampling: checked against the traces below)
        problem = signature_mismatch(_unspeculative(calibrator.signature), reference_signature(reference, spec))
        if problem:
            raise ValueError(f"calibration does not match this audit: {problem}")
    if calibrator is not None:
        judged_by = judged_by or "calibration (given)"
        stage(f"judged by {judged_by}: the margin and the sampler-shape detectors, at {calibrator.fpr:g} FPR")
    names = [safe_name(e.name) for e in endpoints]
    if len(set(names)) != len(names):
        raise ValueError(f"provider names must be distinct, got {names}")
    started = time.time()  # out_dir is made by the first file written in it (none when the audit fails first)
    tokenizer = reference.tokenizer
    fetched = []
    for e in endpoints:
        store = ResponseStore(out_dir / e.name / "responses.jsonl")
        client = ProviderClient(e, store, concurrency, policy, on_retry=stage)
        asked = generation_calls(spec, prompts, tokenizer, e.model)
        calls = list({c.key: c for c in asked[::-1]}.values())  # identical prompts: asked and counted once,
        calls.sort(key=lambda c: c.meta["index"])  # keeping the first of each
        if spec.mode == "auto" and spec.seeds:  # are seeds honoured? (verinfer.auditing.auto)
            calls += probe_calls(calls)
        stage(f"{e.name}: {sum(c.key not in store for c in calls)} of {len(calls)} requests to send"
              + (f" ({len(asked) - len(calls)} duplicate prompt(s) skipped)" if len(asked) > len(calls) else ""))
        records = client.fetch(calls)
        fetched.append((e, store, client, records))
    stops = stop_ids(tokenizer)
    audits = []
    for e, store, client, records in fetched:
        if spec.seedless:
            audit = _sampled_audit(e, store, client, records, spec, reference, out_dir, fpr, stops, stage,
                                   gap_bands if spec.mode == "logprobs" else None)
        elif spec.mode == "auto":
            audit = _auto_audit(e, store, client, records, spec, reference, out_dir, bands, calibrator,
                                batch_size, fpr, stops, stage, gap_bands)
        else:
            audit = _replayed_audit(e, store, client, records, spec, reference, out_dir, bands, calibrator,
                                    batch_size, fpr, stops, stage)
        audit.pacing = client.pacer.summary()
        audits.append(audit)
    adjust([a.verdict for a in audits])  # Holm over providers, whatever the mode
    return AuditResult(audits, spec, reference.describe(), calibrator.fpr if calibrator and spec.mode != "auto" else fpr,
                       out_dir, bands, started, time.time() - started, gap_bands=gap_bands,
                       judged_by=judged_by if calibrator is not None else None)


def _replayed_audit(e: Endpoint, store: ResponseStore, client: ProviderClient, records: list[dict], spec: AuditSpec,
                    reference, out_dir: Path, bands: Bands | None, calibrator: Calibrator | None,
                    batch_size: int | None, fpr: float, stops: set[int], stage,
                    alpha: float | None = None) -> ProviderAudit:
    """A provider judged by replaying its greedy or seeded outputs on the reference (Token-DiFR margins)
    against ``bands`` at ``fpr`` or ``calibrator`` at its own FPR (``alpha``: at that level instead)."""
    tokenizer = reference.tokenizer
    claims = [c for r in records for c in _seeded_claims(r, spec, tokenizer, stops, reference.vocab_size,
                                                          f"provider {e.name!r}: {store.path} (prompt {r['prompt_id']})")]
    empty = [c.prompt_id for c in claims if not c.output_token_ids]
    served = summarize_served(claims)  # empty outputs included
    claims = [c for c in claims if c.output_token_ids]
    if not claims:
        raise ProviderError(f"provider {e.name!r}: every response has an empty output; nothing to verify")
    model_id = getattr(getattr(reference, "backend", None), "model_id", e.model)
    replays: Replays = {}
    if getattr(reference, "backend", None) is not None and any(c.source == "retokenized" for c in claims):
        stage(f"{e.name}: aligning re-tokenized text with the reference's replay")
        scratch = out_dir / e.name / "alignment"
        claims = align_claims(claims, _replayer(reference, e.name, model_id, spec, scratch, replays), tokenizer)
        shutil.rmtree(scratch, ignore_errors=True)
    claims = [count_mismatch(c) for c in claims]
    traces = claim_traces(claims, e.name, model_id, spec.params)
    write_traces(traces, out_dir / e.name / "traces.jsonl")
    if calibrator is not None:  # the traces may claim speculative decoding: judged only by its calibration
        problem = signature_mismatch(calibrator.signature, signature(traces, model_id, reference.backend.dtype_name,
                                                                       reference.backend.reference_name)
                                     if getattr(reference, "backend", None) is not None else None)
        if problem:
            raise ValueError(f"provider {e.name!r}: the calibration does not match its traces "
                             f"({out_dir / e.name / 'traces.jsonl'}; responses kept): {problem}")
    stage(f"{e.name}: scoring {sum(len(c.output_token_ids) for c in claims)} tokens with the reference")
    columns = reference.score(traces, out_dir / e.name, skip=unscored(claims, e.name),
                              **({"reuse": replays} if replays else {}))
    seq = sequence_stats(columns, bands.clip if bands is not None else MARGIN_CLIP)
    if calibrator is not None:
        verdict = calibrated_verdict(columns, calibrator, batch_size, alpha=alpha)
        verdict.exact_match_rate, verdict.sequences = float(seq[:, 2].sum() / seq[:, 0].sum()), len(seq)
    else:
        verdict = pooled_verdict(seq, bands.honest_bands(), fpr if alpha is None else alpha, all_bands=bands.labelled(),
                                 source=Path(bands.source).name, clip=bands.clip)
    return ProviderAudit(e, claims, columns, seq, verdict, summarize_drift(claims), client.sent, len(store),
                         store.damaged_lines, empty, served)


def _replayer(reference, provider: str, model_id: str, spec: AuditSpec, scratch: Path, last: Replays):
    """Claims -> the reference's score columns per claim, scored in ``scratch``; each
    claim's last replay is kept in ``last`` (the final scoring reuses it rather than replaying again)."""
    def replay(claims: list[Claim]) -> list[dict[str, np.ndarray]]:
        traces = claim_traces(claims, provider, model_id, spec.params)
        got = by_trace(reference.score(traces, scratch))
        last.update(got)
        return [got[t.id] for t in traces]

    return replay


def _seeded_claims(record: dict, spec: AuditSpec, tokenizer, stops: set[int], vocab_size: int, where: str) -> list[Claim]:
    """The ``spec.choices`` claims of one greedy or seeded response: choice j of prompt i becomes claim
    ``spec.claim_index(i, j)`` (its seed), named ``<prompt id>/<j>`` when a request asks for several."""
    got = len(record["response"]["choices"])
    if got < spec.choices:
        raise ProviderError(f"{where}: asked for n={spec.choices} completions, got {got} (does the provider support n?)")
    claims = [parse_generation(record, tokenizer, stops, vocab_size, where, j) for j in range(spec.choices)]
    if spec.choices == 1:
        return claims
    return [replace(c, prompt_id=f"{c.prompt_id}/{j}", index=spec.claim_index(c.index, j)) for j, c in enumerate(claims)]


def _sampled_audit(e: Endpoint, store: ResponseStore, client: ProviderClient, records: list[dict], spec: AuditSpec,
                   reference, out_dir: Path, fpr: float, stops: set[int], stage,
                   gap_bands: Bands | None = None) -> ProviderAudit:
    """A provider judged on sampled completions without seeds (``--mode surprise`` / ``rank`` / ``mmd`` /
    ``logprobs``, the last by ``gap_bands`` when given: ``seedless.judge_logprobs``)."""
    want = spec.samples if spec.mode == "mmd" else 1
    claims = []
    for r in records:
        where = f"provider {e.name!r}: {store.path} (prompt {r['prompt_id']})"
        got = len(r["response"]["choices"])
        if got < want:
            raise ProviderError(f"{where}: asked for n={want} completions, got {got} (does the provider support n?)")
        use = got if spec.mode in ("rank", "surprise") else want  # every completion returned (n > 1 included)
        claims += [parse_generation(r, reference.tokenizer, stops, reference.vocab_size, where, i) for i in range(use)]
    stage(f"{e.name}: judging {len(claims)} sampled completions ({spec.mode})")
    backend = getattr(reference, "backend", None)
    remote = None if backend is not None else reference  # a reference API (verinfer.auditing.remote_reference)
    if spec.mode == "logprobs":
        judged = judge_logprobs(claims, records, spec, backend, fpr, e.name, store, remote=remote, bands=gap_bands)
    else:
        judged = judge_sampled(claims, spec, backend, out_dir, fpr, stage, remote=remote)
    empty = sorted({c.prompt_id for c in claims if not c.output_token_ids})
    return ProviderAudit(e, claims, {}, np.zeros((0, 3)), judged.verdict, summarize_drift(claims), client.sent,
                         len(store), store.damaged_lines, empty, summarize_served(claims), judged.prompts)


def _auto_audit(e: Endpoint, store: ResponseStore, client: ProviderClient, records: list[dict], spec: AuditSpec,
                reference, out_dir: Path, bands: Bands | None, calibrator: Calibrator | None, batch_size: int | None,
                fpr: float, stops: set[int], stage, gap_bands: Bands | None = None) -> ProviderAudit:
    """``--mode auto``: every test the responses allow, one verdict (``verinfer.auditing.auto``); the seeded
    test replays the same responses as ``--mode seeded`` would, when bands or a calibration judge it."""
    generated = [r for r in records if r.get("kind") != "seed-probe"]
    probes = [r for r in records if r.get("kind") == "seed-probe"]
    seeded = None
    if bands is not None or calibrator is not None:
        seeded = lambda alpha: _replayed_audit(e, store, client, generated, component_spec(spec, "seeded"),  # noqa: E731
                                               reference, out_dir, bands, calibrator, batch_size, alpha, stops,
                                               stage, alpha=alpha).verdict
    judged = judge_auto(generated, probes, spec, reference, out_dir, fpr, stops, e.name, store, seeded, stage,
                        gap_bands)
    claims = judged.claims
    return ProviderAudit(e, claims, {}, np.zeros((0, 3)), judged.verdict, summarize_drift(claims), client.sent,
                         len(store), store.damaged_lines, sorted({c.prompt_id for c in claims if not c.output_token_ids}),
                         summarize_served(claims), judged.prompts, [t.to_dict() for t in judged.tests])
