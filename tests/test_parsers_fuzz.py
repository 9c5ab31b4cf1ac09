"""Every file parser, fed arbitrary bytes or arbitrary JSON, either parses or raises its own error
whose one line names the file (and the line or record), never another exception."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verinfer.auditing.bands import Bands
from verinfer.prompts import PromptError, load_prompts
from verinfer.stats.calibration import Calibrator
from verinfer.trace import TraceError, read_traces

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                      max_size=5), max_leaves=20)
trace_like = st.fixed_dictionaries({
    "id": st.one_of(st.text(max_size=5), st.integers()),
    "model": st.sampled_from(["smollm2-135m", "", 3]),
    "prompt_token_ids": st.one_of(st.lists(st.integers(-5, 2**70), max_size=4), st.text(max_size=3)),
    "output_token_ids": st.one_of(st.lists(st.integers(-5, 2**70), max_size=4), st.none()),
    "sampling": st.one_of(json_values, st.fixed_dictionaries({"profile": st.sampled_from(["vllm", "greedy", "x"]),
                                                             "seed": st.integers(-2**70, 2**70)})),
}, optional={"schema": st.sampled_from(["verinfer.trace/1", "verinfer.trace/9", 1]), "meta": json_values})
lines = st.lists(st.one_of(st.binary(max_size=40), json_values.map(lambda v: json.dumps(v).encode()),
                           trace_like.map(lambda v: json.dumps(v).encode())), min_size=1, max_size=4)


def write(data: bytes, suffix: str) -> Path:
    fh = tempfile.NamedTemporaryFile("wb", suffix=suffix, delete=False)
    fh.write(data)
    fh.close()
    return Path(fh.name)


def one_line(exc: Exception, path: Path) -> None:
    text = str(exc)
    assert "\n" not in text and text.startswith(str(path)), text


@SETTINGS
@given(lines)
def test_trace_files(chunks):
    path = write(b"\n".join(c.replace(b"\n", b" ") for c in chunks) + b"\n", ".jsonl")
    try:
        traces = read_traces(path)
    except TraceError as exc:
        one_line(exc, path)
    else:
        for t in traces:  # what parses validates against a verifier without raising
            t.problems(49152, "smollm2-135m", 8192)
    finally:
        path.unlink()


@SETTINGS
@given(lines)
def test_prompt_files(chunks):
    path = write(b"\n".join(c.replace(b"\n", b" ") for c in chunks) + b"\n", ".jsonl")
    try:
        load_prompts(str(path))
    except PromptError as exc:
        one_line(exc, path)
    finally:
        path.unlink()


@SETTINGS
@given(st.one_of(json_values, st.binary(max_size=30).map(lambda b: b.hex())))
def test_calibration_files(value):
    path = write(json.dumps(value).encode(), ".json")
    try:
        Calibrator.load(path)
    except ValueError as exc:
        one_line(exc, path)
    finally:
        path.unlink()


@SETTINGS
@given(json_values)
def test_bands_files(value):
    path = write(json.dumps(value).encode(), ".json")
    try:
        Bands.load(path)
    except ValueError as exc:
        one_line(exc, path)
    finally:
        path.unlink()
