"""``verinfer.diagnose`` (the API) on synthetic logits: the same diagnosis as the core, its JSON
written atomically, and outputs that would overwrite the traces refused before any work."""

from __future__ import annotations

import json

import pytest

import verinfer
from tests.test_diagnose import by_label, synthetic
from verinfer.trace import write_traces


def test_api_diagnoses_a_trace_file_and_writes_json(tmp_path):
    backend, traces = synthetic(by_label("seed +1"))
    path = write_traces(traces, tmp_path / "t.jsonl")
    d = verinfer.diagnose(path, backend=backend, out=tmp_path / "d.json")
    assert isinstance(d, verinfer.Diagnosis)
    assert d.best.candidate.label == "seed +1" and d.claim_rejected, d.text
    saved = json.loads((tmp_path / "d.json").read_text())
    assert saved["conclusion"] == d.text and saved["best"]["label"] == "seed +1"
    assert saved["test"].startswith("Vuong") and saved["settings"]["tokens"] == d.claim.tokens


def test_api_refuses_bad_arguments_before_any_work(tmp_path):
    backend, traces = synthetic(by_label("seed +1"), n_traces=1, length=4)
    path = write_traces(traces, tmp_path / "t.jsonl")
    with pytest.raises(ValueError, match="t.jsonl"):
        verinfer.diagnose(path, backend=backend, out=path)  # would overwrite the traces
    with pytest.raises(ValueError, match="--alpha"):
        verinfer.diagnose(path, backend=backend, alpha=1.5)
    with pytest.raises(ValueError, match="unknown model variant"):
        verinfer.diagnose(path, backend=backend, variants="w5")
    mixed = [traces[0], traces[0].__class__.from_dict({**traces[0].to_dict(), "id": "b",
                                                       "sampling": {**traces[0].sampling.to_dict(), "top_k": 7}}, "x")]
    with pytest.raises(ValueError, match="2 sampling settings"):
        verinfer.diagnose(mixed, backend=backend)
