"""Trace records: round trips and validation errors that name the record and field."""

import json

import pytest

from verinfer.sampling.params import SamplingParams
from verinfer.trace import Trace, TraceError, read_traces, write_traces


def make(i=0, **kw):
    base = dict(id=f"t{i}", model="smollm2-135m", prompt_token_ids=[1, 2, 3], output_token_ids=[4, 5],
                sampling=SamplingParams(seed=7, top_k=50, top_p=0.95), messages=[{"role": "user", "content": "hi"}],
                meta={"finish_reason": "stop"})
    base.update(kw)
    return Trace(**base)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_round_trip(tmp_path, suffix):
    traces = [make(0), make(1, sampling=SamplingParams(profile="greedy"), messages=None, fingerprints={"x": [1]})]
    path = write_traces(traces, tmp_path / f"t{suffix}")
    assert read_traces(path) == traces


def write_lines(tmp_path, lines):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def good_line(i=0, **changes):
    d = make(i).to_dict()
    d.update(changes)
    return json.dumps(d)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "bad.jsonl:2: not valid JSON"),
        ("[1, 2]", "bad.jsonl:2: record is a list"),
        (good_line(1, output_token_ids="abc"), "bad.jsonl:2 (id 't1'): field 'output_token_ids' must be a list of integers"),
        (good_line(1, prompt_token_ids=[1, 2.5]), "field 'prompt_token_ids' must be a list of integers"),
        (good_line(1, sampling={"profile": "vllm", "seed": 1, "topk": 5}), "sampling: unknown sampling field(s): topk"),
        (good_line(1, schema="verinfer.trace/99"), "schema 'verinfer.trace/99' is not supported"),
        (good_line(1, extra=1), "unknown field(s) extra"),
        (json.dumps({"id": "t1", "model": "m"}), "missing field 'prompt_token_ids'"),
        (good_line(0), "duplicate id 't0' (first at record 1)"),
    ],
)
def test_malformed_records_name_line_and_field(tmp_path, line, message):
    path = write_lines(tmp_path, [good_line(0), line])
    with pytest.raises(TraceError) as info:
        read_traces(path)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_semantic_problems():
    assert make().problems(vocab_size=100, model_id="smollm2-135m") == []
    assert "output_token_ids[1]: token id 500 is outside the vocabulary [0, 100)" in make(
        output_token_ids=[4, 500]).problems(vocab_size=100)
    assert "empty output" in make(output_token_ids=[]).problems()[0]
    assert "seeded but no seed" in make(sampling=SamplingParams(seed=None)).problems()[0]
    assert "unknown profile 'nope'" in make(sampling=SamplingParams(profile="nope", seed=1)).problems()[0]
    assert "trace claims 'smollm2-135m' but the verifier runs 'other'" in make().problems(model_id="other")[0]


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="no trace records"):
        read_traces(tmp_path / "empty.jsonl")
    with pytest.raises(TraceError, match="no such file"):
        read_traces(tmp_path / "missing.jsonl")
    (tmp_path / "x.parquet").write_bytes(b"PAR1garbage")
    with pytest.raises(TraceError, match="not a readable Parquet file"):
        read_traces(tmp_path / "x.parquet")
