"""The public API: generate, verify, calibrate and audit, returning typed results.

The command line (``verinfer.cli``) is a thin layer of options, progress bars and tables over these
functions; notebooks and services call them directly::

    import verinfer

    honest = verinfer.generate("chitchat", n=8, max_tokens=32, seed=1000)
    calibration = verinfer.calibrate(verinfer.verify(honest), batch_sizes=(8,))
    result = verinfer.verify(verinfer.generate("chitchat", n=8, max_tokens=32, seed=5000),
                             calibration=calibration)
    print(result.verdict.text)

Models are loaded once per (model, dtype, device) and reused; pass ``backend=`` to use one you
loaded yourself.

Threads: the functions that run a model (``load_model``, ``generate``, ``verify``, ``audit``,
``diagnose``) apply the command line's thread policy (``verinfer.machine``: the physical cores this
process may use that other processes leave idle, one thread in a worker process) once per process,
unless you chose already: ``OMP_NUM_THREADS`` (or ``MKL_NUM_THREADS``) set, or
``torch.set_num_threads`` called with a count other than torch's default
(``verinfer.machine.ensure_threads``). To keep torch's default count, set ``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import functools
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa

from verinfer.files import check_outputs, derived_path, write_atomic
from verinfer.machine import check_device, ensure_threads
from verinfer.models.backend import Backend
from verinfer.models.load import DEFAULT_MODEL
from verinfer.prompts import Prompt, load_prompts
from verinfer.sampling.params import SamplingParams, parse_speculative
from verinfer.sampling.profiles import get_profile, params_problems
from verinfer.simulate.generate import build_requests, placed
from verinfer.simulate.generate import generate as simulate
from verinfer.simulate.speculative import generate_speculative as simulate_speculative
from verinfer.stats.calibration import Calibrator, normalize_precisions, signature_mismatch
from verinfer.stats.shipped import find_calibration
from verinfer.stats.summary import Summary, fit_calibrator, summarize
from verinfer.stats.sides import detectors as side_detectors, judged_groups, oriented
from verinfer.stats.verdict import Verdict
from verinfer.trace import Trace, TraceError, read_traces, write_traces
from verinfer.scoring.diagnosis import Diagnosis, Judged
from verinfer.scoring.diagnosis_run import diagnose as run_diagnosis, prepare, reference_model
from verinfer.scoring.scores import commit_scores, read_commit_scores, read_scores, read_signature, verified_signature
from verinfer.scoring.traces import Scored, align_retokenized, check_traces, score_traces

Progress = Callable[[int], None] | None


@functools.lru_cache(maxsize=4)
def _load(model: str, dtype: str, device: str, backend: str) -> Backend:
    if backend == "transformers":
        return Backend.load(model, dtype, device=device)
    from verinfer.models.vllm_backend import VllmBackend, engine_args

    return VllmBackend.load(model, dtype, device, engine_args(backend))


def load_model(model: str = DEFAULT_MODEL, dtype: str = "float32", device: str = "cpu",
               backend: str = "transformers") -> Backend:
    """The reference or provider model, loaded offline once per (model, dtype, device, backend).

    ``backend``: ``transformers`` (the model here, on ``device``), or ``vllm[:KEY=VALUE,...]``: hidden
    states from vLLM itself, the head applied on ``device`` (``verinfer.models.vllm_backend``)."""
    check_device(device)
    ensure_threads()
    if backend != "transformers":
        from verinfer.models.vllm_backend import engine_args

        engine_args(backend)  # an unknown backend is named before anything loads
    return _load(model, dtype, device, backend)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_batch_size(batch_size: int | None, calibrator: Calibrator | None, where: str = "calibration") -> None:
    """A verdict batch size is a positive integer the calibration was fitted at; refused before any
    work, so a wrong one never costs a scoring pass (or a paid request) and never falls back to another."""
    if batch_size is None:
        return
    _positive("--verdict-batch", batch_size)
    if calibrator is not None and batch_size not in calibrator.batch_sizes:
        raise ValueError(f"{where}: --verdict-batch {batch_size} was not calibrated (calibrated: "
                         f"{', '.join(map(str, calibrator.batch_sizes))})")


# --------------------------------------------------------------------------------------------------
# generate


def generate(prompts: str | Sequence[Prompt] = "chitchat", *, n: int = 16, model: str = DEFAULT_MODEL,
             dtype: str = "float32", device: str = "cpu", profile: str = "vllm", temperature: float = 1.0,
             top_k: int = 50, top_p: float = 0.95, min_p: float = 0.0, seed: int | None = 1000,
             max_tokens: int = 64, batch_size: int = 8, commits=None, out: str | Path | None = None,
             backend: Backend | None = None, on_batch: Progress = None,
             speculative: str | dict | None = None) -> list[Trace]:
    """Generate traces with a sampler profile (the provider simulator); request i gets ``seed + i``.

    ``speculative`` (``DRAFT:K`` such as ``layers:28:4``, or ``{"draft", "k"}``) decodes as vLLM's
    speculative decoding does (``verinfer.simulate.speculative``; one request at a time, and without
    activation commits).
    ``prompts`` is a built-in set name, a JSONL file, or a list of ``Prompt``; ``commits`` a
    ``verinfer.commits.trace_commits.CommitSpec`` to attach activation commits. With ``out`` the
    traces are also written (JSONL or Parquet, atomically).
    """
    for name, value in (("n", n), ("max_tokens", max_tokens), ("batch_size", batch_size)):
        _positive(name, value)
    get_profile(profile)
    spec = parse_speculative(speculative) if isinstance(speculative, str) else speculative
    params = SamplingParams(profile=profile, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            seed=None if profile == "greedy" else seed, speculative=spec)
    problems = params_problems(placed(params, batch_size, 0, 1))  # with the place generate records (transformers)
    if problems:
        raise ValueError(f"sampling: {problems[0]}")
    if spec and commits is not None:
        raise ValueError("activation commits are not built for speculative decoding; drop --speculative or the commits")
    ensure_threads()
    backend = backend or load_model(model, dtype, device)
    prompt_list = load_prompts(prompts, n) if isinstance(prompts, str) else list(prompts)[:n]
    requests = build_requests(backend, prompt_list, params)
    if spec:
        traces = simulate_speculative(backend, requests, max_tokens, on_request=on_batch)
    else:
        traces = simulate(backend, requests, max_tokens, batch_size, on_batch=on_batch, commits=commits)
    if out is not None:
        write_traces(traces, out)
    return traces


# --------------------------------------------------------------------------------------------------
# verify


@dataclass
class VerifyResult:
    """Per-token scores, their summary and calibrated verdict, and the commit checks of one trace set."""

    summary: Summary
    scored: Scored
    skipped: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> Verdict | None:
        return self.summary.verdict

    @property
    def consistent(self) -> bool | None:
        return self.summary.consistent

    @property
    def columns(self) -> dict[str, np.ndarray]:
        return self.scored.columns

    @property
    def scores(self) -> pa.Table:
        """Per-token scores as an Arrow table (every column when a score file was written)."""
        if self.scored.scores_path is not None:
            return pa.Table.from_pydict(read_scores(self.scored.scores_path))
        return pa.Table.from_pydict(self.scored.columns)

    def to_dict(self) -> dict:
        return {**self.summary.to_dict(), "signature": self.scored.signature, "skipped": self.skipped,
                "scores": str(self.scored.scores_path) if self.scored.scores_path else None,
                "commit_scores": str(self.scored.commits_path) if self.scored.commits_path else None}


def default_outputs(traces_path: str | Path) -> tuple[Path, Path]:
    """Where ``verify`` writes by default: ``<whole stem>.scores.parquet`` and ``.commits.parquet``
    for a JSONL trace file; a trace file in any other format keeps its extension in the name
    (``t.parquet`` -> ``t.parquet.scores.parquet``), so ``t.jsonl`` and ``t.parquet`` in one
    directory never share (and replace) each other's outputs."""
    keep = Path(traces_path).suffix.lower() != ".jsonl"
    return (derived_path(traces_path, ".scores.parquet", keep_extension=keep),
            derived_path(traces_path, ".commits.parquet", keep_extension=keep))


def shipped_calibration(traces: Sequence[Trace], backend: Backend) -> tuple[Calibrator, str] | None:
    """The shipped default calibration for the traces' model and sampling settings, and how a summary
    names it (``verinfer.stats.shipped``); None when none ships. One rule for verify and diagnose."""
    shipped = find_calibration(verified_signature(traces, backend))
    return None if shipped is None else (Calibrator.load(shipped), f"{shipped.name} (shipped default)")


def verify(traces: str | Path | Sequence[Trace], *, model: str | None = None, dtype: str = "float32",
           device: str = "cpu", calibration: Calibrator | str | Path | None = None, batch_size: int | None = None,
           scores: str | Path | None = None, commit_scores_out: str | Path | None = None,
           skip_invalid: bool = False, allow_model_mismatch: bool = False, alpha: float | None = None,
           backend: Backend | None = None, on_rows: Progress = None, default_calibration: bool = True) -> VerifyResult:
    """Replay traces with one prefill each, score every token (Token-DiFR), check activation commits,
    and judge with a calibration when one is given (``verinfer.stats.verdict``).

    ``traces`` is a trace file or a list of ``Trace``. For a file, scores go by default to
    ``<stem>.scores.parquet`` and commit scores to ``<stem>.commits.parquet`` beside it
    (``default_outputs``); outputs that would overwrite an input or each other, a device this machine
    lacks and a batch size the calibration was not fitted at are refused before any work. Without a
    ``calibration`` the shipped default for the traces' model and sampling settings is used when one
    exists (``verinfer.stats.shipped``; ``default_calibration=False`` turns that off), and the
    summary names the calibration it used.
    """
    source = str(traces) if isinstance(traces, (str, Path)) else "traces"
    if isinstance(traces, (str, Path)):
        default_scores, default_commits = default_outputs(traces)
        if scores is None:
            scores = default_scores
        if commit_scores_out is None:
            commit_scores_out = default_commits if scores == default_scores else None
        trace_list = read_traces(traces)
    else:
        trace_list = list(traces)
    if scores is not None and commit_scores_out is None:
        commit_scores_out = derived_path(scores, ".commits.parquet")
    calibration_path = calibration if isinstance(calibration, (str, Path)) else None
    check_outputs([scores, commit_scores_out],
                  [traces if isinstance(traces, (str, Path)) else None, calibration_path])
    calibrator = Calibrator.load(calibration) if calibration_path else calibration
    check_batch_size(batch_size, calibrator, str(calibration_path or "calibration"))
    for n, t in enumerate(trace_list, 1):  # a lone surrogate decodes from JSON but cannot be written anywhere
        if not _utf8(t.id):
            raise TraceError(f"{source}: record {n} (id {ascii(t.id)}): field 'id' is not valid Unicode text "
                             "(a lone surrogate)")
    ensure_threads()
    if backend is None:  # the traces' own model unless told otherwise (one rule with diagnose)
        backend = load_model(reference_model(trace_list, model, source), dtype, device)
    kept, skipped = check_traces(trace_list, backend, source, skip_invalid, allow_model_mismatch)
    kept, unaligned, replays = align_retokenized(backend, kept)  # re-tokenization drift is never scored as divergence
    used = str(calibration_path) if calibration_path else ("calibration given by the caller" if calibrator else None)
    missing = None  # why no shipped calibration fits, and how to fit one (one line)
    if calibrator is None and default_calibration and kept:
        from verinfer.stats.shipped import no_default

        shipped = shipped_calibration(kept, backend)
        if shipped is not None:
            calibrator, used = shipped
            check_batch_size(batch_size, calibrator, used)
        else:
            missing = no_default(verified_signature(kept, backend))
    if calibrator is not None:  # refuse a calibration of another configuration before scoring
        problem = signature_mismatch(calibrator.signature, verified_signature(kept, backend))
        if problem:
            raise ValueError(f"{calibration_path or 'calibration'}: does not match {source}: {problem}")
    scored = score_traces(backend, kept, scores, commit_scores_out, on_rows, skip=unaligned, reuse=replays)
    summary = summarize(scored.columns, calibrator, batch_size, scored.commit_checks,
                        commit_scores(scored.commit_checks), alpha)
    summary.calibration = used
    if missing is not None:
        summary.note = missing
    return VerifyResult(summary, scored, skipped)


# --------------------------------------------------------------------------------------------------
# calibrate


def calibrate(honest: VerifyResult | str | Path | Sequence[VerifyResult | str | Path], *,
              batch_sizes: Sequence[int] = (10, 100), fpr: float = 0.01,
              commit_scores_files: Sequence[str | Path] = (), out: str | Path | None = None,
              resample: int | None = None, precisions: Sequence[str] | None = None,
              shape: bool = True) -> Calibrator:
    """Fit detector thresholds on honest scores at a target false-positive rate.

    ``honest`` is one or more ``verify`` results or score files of honest traces, all verified under
    one signature (model, dtype, sampling settings), which the calibration records and ``verify``
    and ``audit`` then check. Commit detectors are fitted from the results' commit checks or from
    ``commit_scores_files``. ``precisions`` names the honest providers' precisions behind the
    scores (``fp32``, ``bf16``, ...), recorded with the profiles as the calibration's coverage
    (``coverage_warnings`` says what an fp32-only null will reject); each source's mismatch sides are
    kept as one honest group for the sampler-shape null (give each precision its own file: one file
    mixing fp32 and bf16 traces is one group); ``resample`` bootstraps
    overlapping windows when honest tokens are scarce (``Calibrator``); ``shape=False`` leaves out
    the sampler-shape detectors (the margin-only verdict of before issue #28).
    """
    sources = [honest] if isinstance(honest, (VerifyResult, str, Path)) else list(honest)
    if not sources:
        raise ValueError("no honest scores to calibrate on")
    for size in batch_sizes:
        _positive("batch size", size)
    columns, commits, signatures = [], [], []
    for s in sources:
        if isinstance(s, VerifyResult):
            columns.append(s.columns)
            commits.append(commit_scores(s.scored.commit_checks))
            signatures.append((s.scored.signature, "verify result"))
        else:
            columns.append(read_scores(s))
            signatures.append((read_signature(s), str(s)))
    commits += [read_commit_scores(p) for p in commit_scores_files]
    sig = signatures[0][0]
    for other, where in signatures[1:]:
        if other != sig:
            raise ValueError(f"{where}: verified under {other}, but {signatures[0][1]} under {sig}; "
                             "calibrate each configuration on its own")
    merged = {k: np.concatenate([c[k] for c in columns]) for k in ("margin", "cross_entropy", "exact_match")}
    merged_commits = {m: np.concatenate([c[m] for c in commits if m in c]) for m in {m for c in commits for m in c}}
    if all("depth_shift" in c for c in columns):
        merged["depth_shift"] = np.concatenate([c["depth_shift"] for c in columns])
    coverage = {"precisions": normalize_precisions(precisions) if precisions else None,
                "profiles": sorted({s.get("profile", "?") for s in (sig or {}).get("sampling", [])}) or None}
    # Each source is one honest provider's side counts (verinfer.stats.sides): the verdict takes the least
    # favourable group, where one pooled mixture of precisions that lean to different sides would not.
    groups = ({f"{i}: {where}": c for i, (c, (_, where)) in enumerate(zip(columns, signatures))}
              if "depth_shift" in merged else None)
    calibrator = fit_calibrator(merged, tuple(batch_sizes), fpr, merged_commits, sig, shape=shape,
                                resample=resample, coverage=coverage, groups=groups)
    if out is not None:
        check_outputs([out], [s for s in sources if not isinstance(s, VerifyResult)] + list(commit_scores_files))
        write_atomic(out, json.dumps(calibrator.to_dict(), indent=1))
    return calibrator


# --------------------------------------------------------------------------------------------------
# audit


def audit(providers: Mapping[str, str] | Sequence, *, out: str | Path = "verinfer-audit", model: str = DEFAULT_MODEL,
          served_model: str | None = None, device: str = "cpu", prompts: str | Sequence[Prompt] = "chitchat",
          n: int = 16, prompt_seed: int = 0, mode: str = "greedy", profile: str = "vllm", temperature: float = 1.0,
          top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0, seed: int = 1000, max_tokens: int = 48,
          endpoint: str = "chat", token_ids: bool = True, bands: str | Path | None = None,
          calibration: Calibrator | str | Path | None = None, batch_size: int | None = None, fpr: float = 0.01,
          concurrency: int = 4, timeout: float = 120.0, retries: int = 4, deadline: float = 600.0,
          max_response_mb: float = 64.0, api_key_env: str | None = "OPENAI_API_KEY", reference_url: str | None = None,
          reference_api_model: str | None = None, reference_api_key_env: str | None = None,
          backend: Backend | None = None, on_stage: Callable[[str], None] | None = None, samples: int = 16,
          stream: bool = False, top_logprobs: int = 5, extra_body: Mapping[str, Any] | None = None,
          choices: int = 1, reference_model: str | None = None, sampler: str | None = None, seeds: bool = False):
    """Audit OpenAI-compatible providers against a trusted reference.

    ``providers`` maps names to base URLs (ending in ``/v1``), or is a list of
    ``verinfer.auditing.client.Endpoint``. ``model`` is the local reference model (as everywhere in the
    API and the CLI), ``served_model`` the model id sent to providers (default: the reference's id) and
    ``profile`` the engine whose sampler the providers claim; ``reference_model`` and ``sampler`` are
    the old names of ``model`` and ``profile`` (a DeprecationWarning; with ``reference_model`` given,
    ``model`` keeps its old meaning, the providers' id). The reference is the local model, or with
    ``reference_url`` an API returning prompt logprobs. Every response is stored before it is
    scored (re-running with the same ``out`` resumes); the verdict comes from the shipped or given
    bands, or from a calibration (a seeded replay given neither: the shipped calibration of its settings,
    as ``verify`` uses it), by the one verdict rule; both are checked against the audit's
    settings before any request is paid for (``mode="rank"`` / ``"mmd"`` audit sampled traffic without
    seeds against ``samples`` reference draws per prompt and need neither; ``mode="auto"`` runs every
    test the responses allow and combines them by Holm, ``verinfer.auditing.auto``, sending seeds only with
    ``seeds=True``; with ``reference_url``
    the seedless modes draw and score with that API, ``verinfer.auditing.remote_reference``; a seeded audit with ``choices > 1``
    asks ``n`` completions per request, choice j claiming seed + j as vLLM seeds it). ``extra_body`` adds fields to
    every generation request (``verinfer.auditing.plan``; the audit's own fields win). ``timeout`` bounds
    each network operation, ``deadline`` each request as a whole and ``max_response_mb`` its body
    (``verinfer.auditing.client.RetryPolicy``); everything is checked before the first request, and a
    failed audit leaves no empty ``out``. Returns
    ``verinfer.auditing.run.AuditResult``; its reports (``audit.json``, ``audit.html``) are written to ``out``.
    """
    from verinfer.auditing.bands import Bands, bands_filename, find_bands
    from verinfer.auditing.client import Endpoint, ProviderClient, RetryPolicy
    from verinfer.auditing.logprobs import gap_signature
    from verinfer.auditing.plan import AuditSpec
    from verinfer.auditing.reference import ApiReference, LocalReference
    from verinfer.auditing.report import write_reports
    from verinfer.auditing.run import run_audit
    from verinfer.auditing.store import ResponseStore

    if sampler is not None:
        warnings.warn("api.audit(sampler=) is now profile=", DeprecationWarning, stacklevel=2)
        profile = sampler
    if reference_model is not None:
        warnings.warn("api.audit(reference_model=) is now model=, and the providers' model id served_model=",
                      DeprecationWarning, stacklevel=2)
        served_model, model = served_model or (model if model != DEFAULT_MODEL else None), reference_model
    spec = AuditSpec(mode=mode, profile=profile, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                     seed=seed, max_tokens=max_tokens, endpoint=endpoint, token_ids=token_ids, samples=samples,
                     stream=stream, top_logprobs=top_logprobs, extra_body=extra_body, choices=choices, seeds=seeds)
    if spec.problems():
        raise ValueError(spec.problems()[0])
    if not 0 < fpr < 1:
        raise ValueError(f"fpr must be in (0, 1), got {fpr}")
    _positive("n", n)
    _positive("concurrency", concurrency)
    policy = RetryPolicy(retries=retries, timeout_s=timeout, deadline_s=deadline,
                         max_response_bytes=int(max_response_mb * 2**20))
    if policy.problems():
        raise ValueError(policy.problems()[0])
    out = Path(out)
    ensure_threads()
    if backend is None:
        from verinfer.models.load import available_offline

        if (problem := available_offline(model)) is not None:
            raise ValueError(f"{problem}: model= is the local reference model; the providers' model id is "
                             f"served_model={model!r}")
        backend = load_model(model, "float32", device)
    endpoints = ([Endpoint(name, url, served_model or backend.model_id, api_key_env) for name, url in providers.items()]
                 if isinstance(providers, Mapping) else list(providers))
    if not endpoints:
        raise ValueError("no providers to audit: give at least one NAME=BASE_URL")
    calibrator = Calibrator.load(calibration) if isinstance(calibration, (str, Path)) else calibration
    check_batch_size(batch_size, calibrator, str(calibration) if isinstance(calibration, (str, Path)) else "calibration")
    band_set = gap_bands = None
    given = Bands.load(bands) if bands else None
    if given is not None and given.kind == "logprob-gap":  # the logprobs test's bands (--mode logprobs, auto)
        given, gap_bands = None, given
    asked = str(prompts) if isinstance(prompts, (str, Path)) else None
    if spec.mode in ("logprobs", "auto") and gap_bands is None and not reference_url:  # shipped, if any: those
        # built on the audit's prompt set first
        gap_bands = find_bands(backend.model_id, gap_signature(spec.params(0)), kind="logprob-gap", prompt_set=asked)
    if gap_bands is not None and gap_bands.signature != gap_signature(spec.params(0)):
        raise ValueError(f"{gap_bands.source}: logprob-gap bands were built for sampling {gap_bands.signature}, the "
                         f"audit claims {gap_signature(spec.params(0))}")
    if gap_bands is not None and gap_bands.prompt_set != asked and on_stage is not None:
        on_stage(f"warning: the logprobs test's bands were built on {gap_bands.prompt_set or 'other'} prompts, this "
                 f"audit asks {asked or 'its own'}: honest logprob gaps depend on the kind of prompt (honest bf16's is "
                 "larger on code than on chat: RESULTS.md section 31), so an honest provider may be flagged; "
                 f"build bands on these prompts: verinfer audit bands --mode logprobs --prompts {asked or 'FILE'}")
    judged_by = f"{Path(calibration).name} (given)" if isinstance(calibration, (str, Path)) else None
    shipped_note = ""
    if calibrator is None and given is None and spec.replays and not reference_url:  # seeded replays: the shipped
        # calibration of the claimed settings, as `verify` uses it (the margin and the sampler-shape detectors)
        shipped = find_calibration({"model": backend.model_id, "dtype": backend.dtype_name,
                                    "sampling": [spec.signature()]})
        default = Calibrator.load(shipped) if shipped is not None else None
        if default is not None and default.fpr != fpr:
            shipped_note = f" (the shipped {shipped.name} judges at {default.fpr:g} FPR, not {fpr:g})"
        elif default is not None:
            calibrator, judged_by = default, f"{shipped.name} (shipped default)"
    if calibrator is None and (spec.mode == "greedy" or spec.replays):  # the bands a verdict needs, found before
        # any request is paid for
        band_set = given or find_bands(backend.model_id, spec.signature())
        if band_set is None and spec.mode != "auto":  # auto runs its seeded test only with them
            raise ValueError(f"no bands for {backend.model_id} with {spec.signature()} "
                             f"(looked for {bands_filename(backend.model_id, spec.signature())}) and no shipped "
                             f"calibration for these settings{shipped_note}; build bands with `verinfer audit bands` "
                             "and pass --bands, or pass --calibration")
        if band_set is not None and band_set.signature != spec.signature():
            raise ValueError(f"{band_set.source}: bands were built for sampling {band_set.signature}, the audit "
                             f"uses {spec.signature()}")
    if reference_url:
        ref_endpoint = Endpoint("reference", reference_url, reference_api_model or backend.model_id,
                                reference_api_key_env)
        store = ResponseStore(out / "reference" / "responses.jsonl")
        reference = ApiReference(ProviderClient(ref_endpoint, store, concurrency, policy), backend.tokenizer)
    else:
        reference = LocalReference(backend)
    prompt_list = (load_prompts(prompts, n, seed=prompt_seed, distinct=True) if isinstance(prompts, str)
                   else list(prompts)[:n])  # distinct: --n 4 sends 4 requests
    result = run_audit(endpoints, prompt_list, spec, reference, out, band_set or given, calibrator, batch_size, fpr,
                       concurrency, policy, on_stage=on_stage, gap_bands=gap_bands, judged_by=judged_by)
    result.reports = write_reports(result, backend.tokenizer)
    return result


# --------------------------------------------------------------------------------------------------
# diagnose


def diagnose(traces: str | Path | Sequence[Trace], *, model: str | None = None, dtype: str = "float32",
             device: str = "cpu", variants: str | Sequence[str] | None = None, sigma: float | None = None,
             alpha: float | None = None, out: str | Path | None = None, skip_invalid: bool = False,
             allow_model_mismatch: bool = False, backend: Backend | None = None,
             calibration: Calibrator | str | Path | None = None, default_calibration: bool = True,
             on_rows: Progress = None, search_models: bool = True) -> Diagnosis:
    """Name the configuration that best explains the traces (``verinfer.scoring.diagnosis``), beside the
    verdict ``verify`` gives the same traces.

    One prefill with the reference model, then the sampler candidates (temperature, top-k, top-p,
    min-p, penalties, seed mappings, every engine profile, sampler bugs) replayed over its logits, the
    sampler families that beat the claim fitted at any value (``scoring.fit``); ``variants``
    (``default``, ``catalogue`` or model-side variant names, as ``verinfer diagnose --variants``) adds one
    prefill per derived model, and when nothing explains the tokens, or the verdict flags them and no
    candidate beats the claim, the derived models are searched (``search_models=False``: not; each is a
    prefill of a derived copy of the model). With a ``calibration``, else the shipped default
    for the claim (as ``verify`` picks it; ``default_calibration=False`` turns that off), the traces are
    also judged as ``verify`` judges them and the conclusion is reconciled with that verdict, which
    decides whether they deviate (``Diagnosis.deviates``; issue #41 item 3: one story). With ``out``
    the diagnosis is also written as JSON (atomically, never over the traces or the calibration).
    """
    trace_list, source, sigma, alpha, band_names = prepare(traces, out, sigma, alpha, variants)
    if isinstance(calibration, (str, Path)):
        check_outputs([out], [traces if isinstance(traces, (str, Path)) else None, calibration])
        calibrator, used = Calibrator.load(calibration), str(calibration)
    else:
        calibrator, used = calibration, "calibration given by the caller"
    ensure_threads()
    backend = backend or load_model(reference_model(trace_list, model, source), dtype, device)
    if not backend.decodes:  # vLLM's hidden states: the sampler, context and template candidates only
        from verinfer.models.vllm_backend import DERIVED_NEED_TRANSFORMERS

        if band_names:
            raise ValueError(DERIVED_NEED_TRANSFORMERS)
        search_models = False
    if calibrator is None and default_calibration:
        calibrator, used = shipped_calibration(trace_list, backend) or (None, None)
    judged = None
    if calibrator is not None:  # judged first: a flag no candidate explains sends diagnose to the model search
        judged = verify(trace_list, backend=backend, calibration=calibrator, skip_invalid=skip_invalid,
                        allow_model_mismatch=allow_model_mismatch, default_calibration=False).summary
    flagged = judged is not None and judged.verdict is not None and not judged.consistent
    result = run_diagnosis(trace_list, backend, source, band_names, sigma, alpha, None, skip_invalid,
                           allow_model_mismatch, on_rows, search_models, flagged)
    if judged is not None and judged.verdict is not None:
        verdict = judged.verdict
        result.verdict = Judged(bool(judged.consistent), verdict.p_value, verdict.tokens, used, verdict.decided_by,
                                *uncovered_noise(calibrator, band_names),
                                sides={k: d for k, d in verdict.detectors.items() if "on_side" in d},
                                detectors=max(len(verdict.detectors), 1), alpha=verdict.alpha,
                                honest_off=honest_other_side(calibrator))
    if out is not None:
        write_atomic(out, json.dumps(result.to_dict(), indent=2) + "\n")
    return result


def honest_other_side(calibrator: Calibrator) -> dict[str, float]:
    """Per sampler-shape detector, the largest per-token rate among the calibration's honest groups of
    mismatches off that detector's side (``scoring.shape``: a sampler change leaves no more there)."""
    groups = judged_groups(getattr(calibrator, "sides", None))
    return {d: max(oriented(g, d)[1] / max(int(g["tokens"]), 1) for g in groups)
            for d in side_detectors(calibrator.sides)} if groups else {}


def uncovered_noise(calibrator: Calibrator, variants: Sequence[str]) -> tuple[tuple[str, ...], bool]:
    """The honest precision variants among ``variants`` (bf16) whose noise the calibration was not fitted
    on, and whether it records its precisions at all (an unrecorded one is not assumed to hold them)."""
    from verinfer.simulate.variants import get_variant

    precisions = (calibrator.coverage or {}).get("precisions")
    out = []
    for name in variants:
        v = get_variant(name)
        if v.honest and v.settings.get("dtype") and v.settings["dtype"] not in (precisions or ()):
            out.append(name)
    return tuple(out), bool(precisions)


__all__ = ["VerifyResult", "audit", "calibrate", "default_outputs", "diagnose", "generate", "load_model", "verify"]
