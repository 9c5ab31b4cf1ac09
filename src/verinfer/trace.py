"""Trace records: one generated sequence, with token ids as the source of truth.

Schema ``verinfer.trace/1`` (one JSON object per line in JSONL; the same fields as Parquet columns,
with nested fields stored as JSON strings so the Parquet schema never depends on their content):

    schema            "verinfer.trace/1"
    id                unique string
    model             model id the provider claims (e.g. "smollm2-135m")
    prompt_token_ids  list of int, the exact prompt the model saw (chat template applied)
    output_token_ids  list of int, the generated tokens (a stop token, if emitted, included)
    sampling          {profile, temperature, top_k, top_p, min_p, seed[, fp64_gumbel, stream, speculative]}
    messages          optional chat messages the prompt was rendered from
    prompt_text, output_text   optional text, informational only
    fingerprints      optional activation commits, by method name
    provider, meta    optional free-form provenance
    spec_modes        optional, with sampling.speculative: one letter per output token saying how the
                      speculative sampler produced it: "a" an accepted draft, "r" resampled after the
                      draft at that position was rejected, "b" the bonus after all k drafts passed
                      (so a step is at most k "a" then one "r" or "b"; the last step may be cut short)

Reading never drops a record silently: a malformed record raises ``TraceError`` naming the file,
line (or row) and field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from verinfer.files import atomic_path
from verinfer.jsonl import read_jsonl
from verinfer.sampling.params import SamplingParams

SCHEMA = "verinfer.trace/1"
_JSON_FIELDS = ("sampling", "messages", "fingerprints", "meta")
_OPTIONAL = ("messages", "prompt_text", "output_text", "fingerprints", "provider", "meta", "spec_modes")


class TraceError(ValueError):
    """A malformed or inconsistent trace; the message names where and what."""


@dataclass
class Trace:
    id: str
    model: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingParams
    messages: list[dict[str, str]] | None = None
    prompt_text: str | None = None
    output_text: str | None = None
    fingerprints: dict[str, Any] | None = None
    provider: str | None = None
    meta: dict[str, Any] | None = None
    spec_modes: str | None = None
    schema: str = SCHEMA

    @classmethod
    def of_output(cls, id: str, model: str, prompt_token_ids, output_token_ids, sampling: SamplingParams, *,
                  tokenizer=None, provider: str | None = None, meta: dict[str, Any] | None = None,
                  **fields: Any) -> "Trace":
        """The one trace builder for a generated output: ids as lists, the output text decoded with
        ``tokenizer`` (special tokens skipped) unless ``output_text`` is given."""
        output = [int(t) for t in output_token_ids]
        if tokenizer is not None and "output_text" not in fields:
            fields["output_text"] = tokenizer.decode(output, skip_special_tokens=True)
        return cls(id=id, model=model, prompt_token_ids=[int(t) for t in prompt_token_ids], output_token_ids=output,
                   sampling=sampling, provider=provider, meta=meta, **fields)

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-ready values; shallow (lists and dicts are shared, not copied: the
        gateway writes one per answered choice, and ``dataclasses.asdict`` copies every token id)."""
        d = {k: v for k, v in self.__dict__.items() if v is not None or k not in _OPTIONAL}
        d["sampling"] = self.sampling.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "Trace":
        """Parse one record, raising TraceError('<where>: field: problem') on anything malformed."""
        if not isinstance(d, dict):
            raise TraceError(f"{where}: record is a {type(d).__name__}, expected a JSON object")
        rid = d.get("id")
        here = f"{where} (id {rid!r})" if rid is not None else where
        if d.get("schema", SCHEMA) != SCHEMA:
            raise TraceError(f"{here}: schema {d.get('schema')!r} is not supported (expected {SCHEMA!r})")
        for name in ("id", "model", "prompt_token_ids", "output_token_ids", "sampling"):
            if d.get(name) is None:
                raise TraceError(f"{here}: missing field {name!r}")
        if not isinstance(rid, str) or not rid:
            raise TraceError(f"{here}: field 'id' must be a non-empty string")
        if not isinstance(d["model"], str):
            raise TraceError(f"{here}: field 'model' must be a string")
        for name in ("prompt_token_ids", "output_token_ids"):
            ids = d[name]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise TraceError(f"{here}: field {name!r} must be a list of integers")
        sampling = d["sampling"]
        if not isinstance(sampling, dict):
            raise TraceError(f"{here}: field 'sampling' must be an object")
        try:
            params = SamplingParams.from_dict(sampling)
        except (TypeError, ValueError) as exc:
            raise TraceError(f"{here}: sampling: {exc}") from None
        if d.get("spec_modes") is not None and not isinstance(d["spec_modes"], str):
            raise TraceError(f"{here}: field 'spec_modes' must be a string of a/r/b letters")
        unknown = set(d) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise TraceError(f"{here}: unknown field(s) {', '.join(sorted(unknown))}")
        kwargs = {k: d[k] for k in _OPTIONAL if d.get(k) is not None}
        return cls(rid, d["model"], d["prompt_token_ids"], d["output_token_ids"], params, **kwargs)

    def problems(self, vocab_size: int | None = None, model_id: str | None = None,
                 max_length: int | None = None) -> list[str]:
        """Semantic problems against a verifier (vocabulary size, model, context length), as 'field: problem'."""
        out = []
        if max_length is not None and len(self.prompt_token_ids) + len(self.output_token_ids) > max_length:
            out.append(f"prompt_token_ids: prompt + output is {len(self.prompt_token_ids) + len(self.output_token_ids)}"
                       f" tokens, more than the verifier's context of {max_length}")
        if not self.prompt_token_ids:
            out.append("prompt_token_ids: empty prompt")
        if not self.output_token_ids:
            out.append("output_token_ids: empty output")
        from verinfer.sampling.profiles import params_problems  # torch and numba: only where traces are checked

        out += [f"sampling.{p}" if p.startswith("profile:") else f"sampling: {p}" for p in params_problems(self.sampling)]
        out += [f"spec_modes: {p}" for p in spec_modes_problems(self)]
        if vocab_size is not None:
            for name in ("prompt_token_ids", "output_token_ids"):
                bad = [(i, t) for i, t in enumerate(getattr(self, name)) if not 0 <= t < vocab_size]
                if bad:
                    i, t = bad[0]
                    out.append(f"{name}[{i}]: token id {t} is outside the vocabulary [0, {vocab_size})"
                               + (f" ({len(bad)} such ids)" if len(bad) > 1 else ""))
        if model_id is not None and self.model != model_id:
            out.append(f"model: trace claims {self.model!r} but the verifier runs {model_id!r}")
        return out


def spec_modes_problems(trace: Trace) -> list[str]:
    """Whether ``spec_modes`` can be what the claimed speculative sampler produced."""
    modes, spec = trace.spec_modes, trace.sampling.speculative
    if modes is None:
        return []
    if not isinstance(spec, dict) or not isinstance(spec.get("k"), int):
        return ["given, but sampling.speculative claims no speculative decoding"]
    if len(modes) != len(trace.output_token_ids):
        return [f"{len(modes)} letters for {len(trace.output_token_ids)} output tokens"]
    run = 0
    for i, m in enumerate(modes):
        if m not in "arb":
            return [f"letter {i} is {m!r}, expected a, r or b"]
        if m == "a":
            run += 1
            if run > spec["k"]:
                return [f"letter {i}: more than k={spec['k']} accepted drafts in one step"]
            continue
        if m == "b" and run != spec["k"]:
            return [f"letter {i}: a bonus token after {run} accepted drafts (needs k={spec['k']})"]
        run = 0
    return []


def _is_parquet(path: Path) -> bool:
    return path.suffix.lower() in (".parquet", ".pq")


def read_traces(path: str | Path) -> list[Trace]:
    """Read a JSONL or Parquet trace file; TraceError on the first malformed record or duplicate id."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such file")
    traces = list(_read_parquet(path) if _is_parquet(path) else _read_jsonl(path))
    seen: dict[str, int] = {}
    for n, t in enumerate(traces):
        if t.id in seen:
            raise TraceError(f"{path}: record {n + 1}: duplicate id {t.id!r} (first at record {seen[t.id] + 1})")
        seen[t.id] = n
    if not traces:
        raise TraceError(f"{path}: no trace records")
    return traces


def _read_jsonl(path: Path) -> Iterator[Trace]:
    for where, record in read_jsonl(path, TraceError):
        yield Trace.from_dict(record, where)


def _read_parquet(path: Path) -> Iterator[Trace]:
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise TraceError(f"{path}: not a readable Parquet file ({exc})".splitlines()[0]) from None
    for row, record in enumerate(table.to_pylist(), 1):
        for name in _JSON_FIELDS:
            if isinstance(record.get(name), str):
                try:
                    record[name] = json.loads(record[name])
                except json.JSONDecodeError:
                    raise TraceError(f"{path}: row {row}: field {name!r} is not valid JSON") from None
        yield Trace.from_dict({k: v for k, v in record.items() if v is not None}, f"{path}: row {row}")


def write_traces(traces: Iterable[Trace], path: str | Path, durable: bool = True) -> Path:
    """Write traces as JSONL or Parquet (by suffix), atomically (``files.atomic_path``: a crash never
    leaves half a file; ``durable``: nor loses a finished one to a power cut)."""
    path = Path(path)
    records = [t.to_dict() for t in traces]
    with atomic_path(path, durable) as tmp:
        _write_records(records, path, tmp)
    return path


def _write_records(records: list[dict[str, Any]], path: Path, tmp: Path) -> None:
    if _is_parquet(path):
        columns = {name: [] for name in ("schema", "id", "model", "prompt_token_ids", "output_token_ids",
                                         "sampling", *_OPTIONAL)}
        for r in records:
            for name in columns:
                value = r.get(name)
                columns[name].append(json.dumps(value) if name in _JSON_FIELDS and value is not None else value)
        schema = pa.schema([
            ("schema", pa.string()), ("id", pa.string()), ("model", pa.string()),
            ("prompt_token_ids", pa.list_(pa.int64())), ("output_token_ids", pa.list_(pa.int64())),
            ("sampling", pa.string()), ("messages", pa.string()), ("prompt_text", pa.string()),
            ("output_text", pa.string()), ("fingerprints", pa.string()), ("provider", pa.string()),
            ("meta", pa.string()), ("spec_modes", pa.string()),
        ])
        pq.write_table(pa.Table.from_pydict(columns, schema=schema), tmp)
    else:
        with open(tmp, "w", encoding="utf-8") as fh:
            for r in records:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")
