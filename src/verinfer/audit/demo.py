"""The demo's audit: an honest and a misconfigured ``verinfer serve`` on loopback, audited over HTTP.

Both servers run the bundled model and claim the same model id; the misconfigured one serves
4-bit weights (``w4``) behind the same API. The audit sends greedy spot checks to both, persists
the responses, verifies them with the local reference and judges them against the shipped bands,
exactly as ``verinfer audit run`` would against remote endpoints.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Sequence

from verinfer.audit.bands import find_bands
from verinfer.audit.client import Endpoint
from verinfer.audit.plan import AuditSpec
from verinfer.audit.reference import LocalReference
from verinfer.audit.report import write_reports
from verinfer.audit.run import AuditResult, run_audit
from verinfer.prompts import Prompt

DEMO_PROVIDERS = {"honest": (), "w4": ("w4",)}


def audit_loopback(backend, prompts: Sequence[Prompt], out_dir: Path, max_tokens: int = 32,
                   providers: dict[str, tuple[str, ...]] = DEMO_PROVIDERS,
                   on_stage: Callable[[str], None] | None = None) -> tuple[AuditResult, Path]:
    """Serve each configuration on loopback, audit all of them, write the reports; returns the HTML path."""
    from verinfer.serve import ServeConfig, serve_in_thread

    spec = AuditSpec(mode="greedy", max_tokens=max_tokens)
    bands = find_bands(backend.model_id, spec.signature())
    if bands is None:
        raise ValueError(f"no shipped greedy bands for {backend.model_id}; build them with `verinfer audit bands`")
    with contextlib.ExitStack() as stack:
        endpoints = []
        for name, misconfig in providers.items():
            if on_stage:
                on_stage(f"starting the {name} server on loopback")
            url = stack.enter_context(serve_in_thread(backend, ServeConfig(misconfig=misconfig,
                                                                           max_batch=len(prompts))))
            endpoints.append(Endpoint(name, url, backend.model_id, None))
        result = run_audit(endpoints, prompts, spec, LocalReference(backend), out_dir, bands=bands,
                           concurrency=len(prompts), on_stage=on_stage)
    return result, write_reports(result, backend.tokenizer)[1]
