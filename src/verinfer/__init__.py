"""verinfer: verify that LLM outputs came from the claimed model and inference configuration.

The public API (``verinfer.api``): ``generate``, ``verify``, ``calibrate``, ``audit``,
``diagnose`` and ``load_model``, with typed results (``VerifyResult``, ``Summary``, ``Verdict``, ``Calibrator``,
``Trace``). Names load on first use, so ``import verinfer`` stays cheap.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "generate": "verinfer.api", "verify": "verinfer.api", "calibrate": "verinfer.api", "audit": "verinfer.api",
    "load_model": "verinfer.api", "diagnose": "verinfer.api", "Diagnosis": "verinfer.scoring.diagnosis",
    "VerifyResult": "verinfer.api", "Summary": "verinfer.stats.summary",
    "Verdict": "verinfer.stats.verdict", "Calibrator": "verinfer.stats.calibration", "Trace": "verinfer.trace",
    "read_traces": "verinfer.trace", "write_traces": "verinfer.trace", "SamplingParams": "verinfer.sampling.params",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'verinfer' has no attribute {name!r}")
