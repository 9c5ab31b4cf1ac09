"""One meaning per option across every command, old spellings as hidden aliases, inputs checked
before any model loads, default outputs that never overwrite, and output that does not wrap in
pipes (issue #31, items 2, 4, 5 and 7)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
from typer.testing import CliRunner

from verinfer.cli.main import app

# What each option name means wherever it appears: its help must say so. An option used by two or
# more commands must be listed here, so a new shared name gets one declared meaning.
MEANINGS = {
    "--allow-model-mismatch": "traces that claim another model",
    "--bands": "bands file",  # a file of calibrated bands; the variants they measure are --variants
    "--variants": "variant",
    "--skip-invalid": "skip invalid traces",
    "--batch-size": "requests decoded together",
    "--batch-sizes": "requests decoded together",
    "--verdict-batch": "tokens per verdict batch",
    "--verdict-batches": "tokens per verdict batch",
    "--calibration": "calibration file from `verinfer calibrate`",
    "--default-calibration": "shipped",  # without --calibration, the shipped one for the claim (verify, diagnose)
    "--commit-scores": "commit",
    "--db": "sqlite:///",
    "--device": "torch device",
    "--dtype": "compute dtype",
    "--fpr": "false-positive rate",
    "--host": "interface",
    "--max-tokens": "new tokens per request",
    "--mode": "greedy",
    "--model": "model",
    "--n": "prompts",
    "--out": "",  # what a command writes differs by nature (traces, a calibration, a report, ...)
    "--out-dir": "",
    "--port": "port",
    "--profile": "sampler profile",
    "--prompt-seed": "which prompts a built-in set samples",
    "--prompts": "built-in prompt set (chitchat, human-eval, gsm8k) or a JSONL file",
    "--provider": "",  # gateway: the name recorded in traces; audit run: NAME=URL of a provider to audit
    "--ray": "ray cluster",
    "--seed": "the first request's sampling seed: request i uses seed + i",
    "--speculative": "draft:k",
    "--threads": "threads",
    "--temperature": "temperature",
    "--min-p": "min-p",
    "--timeout": "seconds per network operation",
    "--token-ids": "token ids",
    "--auth-token-env": "environment variable holding the token",  # dashboard, gateway, monitor --metrics-port
    "--top-k": "top-k",
    "--backend": "what computes the reference",  # verify, monitor, diagnose, audit run
    "--top-p": "top-p",
    "--workers": "",  # verify/monitor --ray: model replicas; gateway: processes sharing its port (uvicorn's word)
}

# Options whose default is a per-command choice of size or place, not a meaning.
PER_COMMAND_DEFAULTS = {
    "--batch-size": "how many requests to decode together is each job's throughput choice",
    "--max-tokens": "each job's length (a demo, a sweep, an audit)",
    "--model": "None where the model comes from the input (the traces' claim, the engine's id)",
    "--mode": "audit modes: bands are built per mode",
    "--n": "each job's size (a band needs more prompts than a spot check)",
    "--out": "each command's own output",
    "--out-dir": "each command's own output",
    "--port": "servers started side by side need different ports",
    "--provider": "two uses, see MEANINGS",
    "--workers": "two uses, see MEANINGS: Ray picks replicas by its resources (None); a gateway is one process",
    "--timeout": "the gateway waits for an engine's whole non-streamed completion; an audit's reads are shorter",
    "--verdict-batches": "calibrate fits 10 and 100; experiment evaluates a whole range by default",
    "--commit-scores": "verify: one output file; calibrate: a list of input files",
    "--variants": "audit bands builds the five bands an audit uses; diagnose adds variants only when asked "
                  "(one prefill each)",
}

# (option, command): a default that differs from the other commands', and why (say it in the help).
EXCEPTIONS = {
    ("--top-k", "audit run"): "requests carry only OpenAI fields (top_k is sent only when > 0)",
    ("--top-k", "audit bands"): "bands are built for what audit run asks",
    ("--top-p", "audit run"): "an audit asks for the whole distribution; generate simulates vLLM chat",
    ("--top-p", "audit bands"): "bands are built for what audit run asks",
    ("--prompt-seed", "audit bands"): "bands are built on another sample than the one audit run audits",
}


def walk(cmd=None, path=()):
    """Every (command path, click command) of the app, sub-apps included."""
    cmd = cmd or typer.main.get_command(app)
    if hasattr(cmd, "commands"):
        for name, sub in cmd.commands.items():
            yield from walk(sub, (*path, name))
    else:
        yield " ".join(path), cmd


def visible_options():
    table = defaultdict(dict)
    for path, cmd in walk():
        for p in cmd.params:
            if p.param_type_name == "option" and not p.hidden:
                table[max(p.opts, key=len)][path] = p
    return table


def test_every_option_has_one_meaning_and_one_default_across_commands():
    shared = {name: uses for name, uses in visible_options().items() if len(uses) > 1}
    assert "--batch-size" in shared and "--verdict-batch" in shared  # the walk reaches sub-apps' commands
    unknown = sorted(set(shared) - set(MEANINGS))
    assert not unknown, f"options used by several commands without a declared meaning: {unknown}"
    for name, uses in shared.items():
        for path, p in uses.items():
            assert MEANINGS[name].lower() in (p.help or "").lower(), (name, path, p.help)
        if name in PER_COMMAND_DEFAULTS:
            continue
        common = {repr(p.default) for path, p in uses.items() if (name, path) not in EXCEPTIONS}
        assert len(common) == 1, f"{name} has different defaults: " + ", ".join(
            f"{path}={p.default!r}" for path, p in uses.items())
        for path, p in uses.items():
            if (name, path) in EXCEPTIONS:
                assert repr(p.default) not in common, f"stale exception: {name} in {path} now agrees"
                assert "generate" in p.help or "default" in p.help, f"{name} in {path}: help must say why it differs"


def test_no_option_keeps_a_name_of_two_meanings():
    """Verdict batches are --verdict-batch(es) everywhere; --batch-size(s) only counts requests."""
    options = visible_options()
    for path, p in {**options["--batch-size"], **options.get("--batch-sizes", {})}.items():
        assert "token" not in (p.help or "").lower(), (path, p.help)
    assert set(options["--verdict-batch"]) == {"verify", "audit run"}
    assert set(options["--verdict-batches"]) == {"calibrate", "experiment"}
    assert "--no-token-ids" not in {o for uses in options.values() for p in uses.values() for o in p.secondary_opts}
    assert options["--token-ids"]["audit run"].secondary_opts == ["--text-only"]
    assert {p.default for p in options["--dtype"].values()} == {"float32"}


# Old spellings and the one name each now has: the old is hidden wherever it is accepted, and the new
# is the visible option there (issue #31, item 2: one meaning per option, one option per meaning).
RENAMED = {"--sampler": "--profile", "--reference-model": "--model", "--max-batch": "--batch-size",
           "--no-token-ids": "--token-ids"}


def test_no_concept_has_two_visible_names():
    hidden_at = defaultdict(set)
    for path, cmd in walk():
        for p in cmd.params:
            if p.param_type_name == "option" and p.hidden:
                hidden_at[max(p.opts, key=len)].add(path)
    options = visible_options()
    for old, new in RENAMED.items():
        assert old not in options, f"{old} is visible in {sorted(options[old])}; it is {new} now"
        assert hidden_at[old], f"{old}: no command accepts the old spelling any more (drop it from RENAMED)"
        missing = sorted(hidden_at[old] - set(options[new]))
        assert not missing, f"{old} is hidden in {missing} without a visible {new}"
    profile = options["--profile"]
    assert {"generate", "serve", "gateway", "audit run", "audit bands"} <= set(profile), sorted(profile)


def fake_audit(monkeypatch):
    """api.load_model and api.audit stand-ins: what audit run would load and send to providers."""
    import verinfer.api

    loaded = []
    monkeypatch.setattr(verinfer.api, "load_model",
                        lambda model, *a, **k: loaded.append(model) or SimpleNamespace(model_id=model))

    def audit(endpoints, **kwargs):
        got, loaded[:] = list(loaded), []
        raise Captured(json.dumps({"loaded": got, "served": [e.model for e in endpoints], "profile": kwargs["profile"]}))
    monkeypatch.setattr(verinfer.api, "audit", audit)


def test_sampler_is_a_hidden_alias_of_profile(monkeypatch, tmp_path):
    fake_audit(monkeypatch)
    base = ["audit", "run", "-p", "a=http://127.0.0.1:1/v1", "-o", tmp_path / "a"]
    assert captured(invoke(*base, "--profile", "sglang"))["profile"] == "sglang"
    old = invoke(*base, "--sampler", "vllm-cpu")
    assert captured(old)["profile"] == "vllm-cpu" and "--sampler is deprecated; use --profile" in old.output
    capture(monkeypatch, "verinfer.api", "generate")
    monkeypatch.setattr(importlib.import_module("verinfer.cli.main"), "_load_backend", lambda *a, **k: None)
    old = invoke("generate", "-o", tmp_path / "g.jsonl", "--sampler", "sglang")
    assert captured(old)["profile"] == "sglang" and "use --profile" in old.output
    import verinfer.cli.serve

    monkeypatch.setattr(verinfer.cli.serve, "_serve", lambda err, model, host, port, profile, *a, **k: (
        _ for _ in ()).throw(Captured(json.dumps({"profile": profile}))))
    old = invoke("serve", "--sampler", "vllm-v1")
    assert captured(old)["profile"] == "vllm-v1" and "use --profile" in old.output


def test_audit_run_model_is_the_local_reference_and_served_model_the_providers_id(monkeypatch, tmp_path, no_model):
    """``--model`` loads the reference in audit run as everywhere; ``--served-model`` is what providers
    are asked for; an old script's ``--model <provider id>`` stops before anything loads, saying what to do."""
    base = ["audit", "run", "-p", "a=http://127.0.0.1:1/v1", "-o", tmp_path / "a"]
    for model in ("gpt-4o", "Qwen/Qwen2.5-0.5B-Instruct"):
        one_line(invoke(*base, "--model", model), f"--model {model}", f"--served-model {model}")
    one_line(invoke(*base, "--model", "smollm2-135m", "--reference-model", "smollm2-135m-x"),
             "--reference-model", "--served-model smollm2-135m")
    assert no_model == [] and not (tmp_path / "a").exists()
    fake_audit(monkeypatch)
    assert captured(invoke(*base)) == {"loaded": ["smollm2-135m"], "served": ["smollm2-135m"], "profile": "vllm"}
    got = captured(invoke(*base, "--model", "smollm2-135m", "--served-model", "meta-llama/Llama-3.1-8B"))
    assert (got["loaded"], got["served"]) == (["smollm2-135m"], ["meta-llama/Llama-3.1-8B"])
    old = invoke(*base, "--reference-model", "smollm2-135m")
    assert captured(old)["loaded"] == ["smollm2-135m"] and "--reference-model is deprecated; use --model" in old.output
    help_text = invoke("audit", "run", "--help").output
    assert "--served-model" in help_text and "--reference-model " not in help_text


def test_audit_run_mode_help_names_every_mode():
    from verinfer.auditing.plan import MODES

    help_text = visible_options()["--mode"]["audit run"].help
    missing = [m for m in MODES if m not in help_text]
    assert not missing, f"audit run --mode help omits {missing}"


# ---------------------------------------------------------------- hidden aliases


class Captured(ValueError):
    """Raised by a stand-in for the work a command does, carrying what the command passed it."""


def capture(monkeypatch, target: str, name: str):
    def fake(*args, **kwargs):
        raise Captured(json.dumps({k: v for k, v in kwargs.items() if isinstance(v, (int, str, bool, tuple, list))
                                   or v is None}, default=str))
    monkeypatch.setattr(importlib.import_module(target), name, fake)


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def captured(result) -> dict:
    assert result.exit_code == 2, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("error: "))
    return json.loads(line[len("error: "):])


@pytest.fixture
def traces(tmp_path):
    from verinfer.sampling.params import SamplingParams
    from verinfer.trace import Trace, write_traces

    return write_traces([Trace(id="t0", model="smollm2-135m", prompt_token_ids=[1, 2], output_token_ids=[3],
                               sampling=SamplingParams(seed=3))], tmp_path / "t.jsonl")


@pytest.fixture
def no_model(monkeypatch):
    """Every way a command loads a model, recorded and refused."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("a model was loaded")

    import verinfer.api
    import verinfer.cli.main
    from verinfer.models.backend import Backend

    monkeypatch.setattr(verinfer.api, "load_model", refuse)
    monkeypatch.setattr(verinfer.cli.main, "_load_backend", refuse)
    monkeypatch.setattr(Backend, "load", classmethod(lambda cls, *a, **k: refuse(*a)))
    return calls


@pytest.mark.parametrize("new, old", [(["--verdict-batch", "7"], ["--batch-size", "7"])])
def test_verify_verdict_batch_and_its_old_spelling(monkeypatch, traces, new, old):
    import verinfer.api
    import verinfer.cli.main

    monkeypatch.setattr(verinfer.cli.main, "_load_backend", lambda *a, **k: None)
    capture(monkeypatch, "verinfer.api", "verify")
    for args, note in ((new, False), (old, True)):
        result = invoke("verify", traces, *args)
        assert captured(result)["batch_size"] == 7
        assert ("--batch-size (tokens per verdict batch) is deprecated; use --verdict-batch" in result.output) == note
    assert "--batch-size" not in invoke("verify", "--help").output  # hidden


def test_calibrate_verdict_batches_and_its_old_spelling(monkeypatch, tmp_path):
    scores = tmp_path / "s.parquet"
    scores.write_bytes(b"")
    capture(monkeypatch, "verinfer.api", "calibrate")
    assert captured(invoke("calibrate", scores, "-o", tmp_path / "c.json", "--verdict-batches", "1,5"))[
        "batch_sizes"] == [1, 5]
    result = invoke("calibrate", scores, "-o", tmp_path / "c.json", "--batch-sizes", "2")
    assert captured(result)["batch_sizes"] == [2] and "--batch-sizes (tokens per verdict batch) is deprecated" in \
        result.output


def test_audit_run_text_only_and_verdict_batch_with_old_spellings(monkeypatch, tmp_path):
    import verinfer.api

    monkeypatch.setattr(verinfer.api, "load_model", lambda *a, **k: SimpleNamespace(model_id="smollm2-135m"))
    capture(monkeypatch, "verinfer.api", "audit")
    base = ["audit", "run", "-p", "a=http://127.0.0.1:1/v1", "-o", tmp_path / "a"]
    assert captured(invoke(*base))["token_ids"] is True
    assert captured(invoke(*base, "--text-only"))["token_ids"] is False
    old = invoke(*base, "--no-token-ids")
    assert captured(old)["token_ids"] is False and "--no-token-ids is deprecated" in old.output
    assert captured(invoke(*base, "--no-no-token-ids"))["token_ids"] is True
    assert captured(invoke(*base, "--verdict-batch", "5"))["batch_size"] == 5
    old = invoke(*base, "--batch-size", "6")
    assert captured(old)["batch_size"] == 6 and "use --verdict-batch" in old.output
    help_text = invoke("audit", "run", "--help").output
    assert "--text-only" in help_text and "no-no-token-ids" not in help_text


def test_gateway_text_only_and_its_old_spelling(monkeypatch, tmp_path):
    import verinfer.production.gateway

    capture(monkeypatch, "verinfer.production.gateway", "GatewayConfig")
    base = ["gateway", "--upstream", "http://127.0.0.1:1", "--traces", tmp_path / "t"]
    assert captured(invoke(*base))["token_ids"] is True
    assert captured(invoke(*base, "--text-only"))["token_ids"] is False
    old = invoke(*base, "--no-token-ids")
    assert captured(old)["token_ids"] is False and "--no-token-ids is deprecated" in old.output


def test_experiment_verdict_batches_and_its_old_spelling(monkeypatch, tmp_path):
    import verinfer.studies.detection
    import verinfer.studies.detection_report

    monkeypatch.setattr(verinfer.studies.detection, "run_matrix", lambda *a, **k: {})
    monkeypatch.setattr(verinfer.studies.detection_report, "analyse",
                        lambda data, matrix, sizes, **k: (_ for _ in ()).throw(Captured(json.dumps({"sizes": sizes}))))
    base = ["experiment", "--smoke", "--cache", tmp_path / "cache", "-o", tmp_path / "out"]
    assert captured(invoke(*base, "--verdict-batches", "1,5"))["sizes"] == [1, 5]
    old = invoke(*base, "--batch-sizes", "3")
    assert captured(old)["sizes"] == [3] and "use --verdict-batches" in old.output


# ---------------------------------------------------------------- inputs checked before any model loads


def one_line(result, *fragments):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for f in fragments:
        assert f in lines[0], result.output


def test_missing_inputs_fail_before_any_model_loads(no_model, traces, tmp_path):
    missing = tmp_path / "missing.json"
    one_line(invoke("verify", traces, "--calibration", missing), "--calibration", "missing.json", "does not exist")
    one_line(invoke("verify", tmp_path / "none.jsonl"), "none.jsonl")
    one_line(invoke("calibrate", tmp_path / "none.parquet", "-o", tmp_path / "c.json"),
             "none.parquet", "does not exist")
    one_line(invoke("calibrate", traces, "--commit-scores", tmp_path / "c.parquet", "-o", tmp_path / "c.json"),
             "--commit-scores", "does not exist")
    one_line(invoke("generate", "-o", tmp_path / "g.jsonl", "--prompts", tmp_path / "p.jsonl"),
             "--prompts", "p.jsonl", "does not exist")
    audit = ["audit", "run", "-p", "a=http://127.0.0.1:1/v1", "-o", tmp_path / "a"]
    for flag in ("--calibration", "--bands", "--providers-file"):
        one_line(invoke(*audit, flag, missing), flag, "does not exist")
    one_line(invoke("audit", "run", "-p", "not-a-url", "-o", tmp_path / "a"), "expected NAME=URL")
    one_line(invoke("monitor", tmp_path, "--db", f"sqlite:///{tmp_path}/m.db", "--once", "--calibration", missing),
             "--calibration", "does not exist")
    one_line(invoke("margingate", "decode", "-o", tmp_path / "d.jsonl", "--prompts", tmp_path / "p.jsonl"),
             "does not exist")
    one_line(invoke("experiment", "--smoke", "-o", tmp_path / "e", "--verdict-batches", "x"), "--verdict-batches")
    assert no_model == []
    assert not (tmp_path / "a").exists() and not (tmp_path / "c.json").exists()


def test_traces_of_several_models_ask_for_model_before_any_loads(no_model, tmp_path):
    """verify, diagnose and the API share one rule for which model the traces claim (reference_model)."""
    from verinfer import api
    from verinfer.sampling.params import SamplingParams
    from verinfer.trace import Trace, write_traces

    mixed = [Trace(id=f"t{i}", model=m, prompt_token_ids=[1, 2], output_token_ids=[3], sampling=SamplingParams(seed=3))
             for i, m in enumerate(("smollm2-135m", "gemma3-270m"))]
    path = write_traces(mixed, tmp_path / "mixed.jsonl")
    for command in ("verify", "diagnose"):
        one_line(invoke(command, path), "traces claim several models (gemma3-270m, smollm2-135m)", "pass --model")
    with pytest.raises(ValueError, match="pass --model"):
        api.verify(mixed, scores=tmp_path / "s.parquet")
    assert no_model == []


def test_a_missing_scores_file_says_it_does_not_exist(tmp_path):
    from verinfer.scoring.scores import read_scores

    with pytest.raises(ValueError, match="none.parquet: cannot read token scores: does not exist"):
        read_scores(tmp_path / "none.parquet")


def test_audit_prompts_are_distinct(tmp_path):
    """`--n 4` of chitchat with prompt seed 0 drew one prompt twice (the audit sent 3 requests): an
    audit's draw has no repeats, and a draw that had none is unchanged."""
    from verinfer.prompts import load_prompts

    key = lambda p: (p.messages, p.token_ids)  # noqa: E731
    plain = load_prompts("chitchat", 4, seed=0)
    assert len({key(p) for p in plain}) == 3  # the case of the issue
    distinct = load_prompts("chitchat", 4, seed=0, distinct=True)
    assert len(distinct) == 4 and len({key(p) for p in distinct}) == 4
    assert len({p.id for p in plain} & {p.id for p in distinct}) == 3
    no_repeats = load_prompts("chitchat", 32, seed=0)
    assert len({key(p) for p in no_repeats}) == 32
    assert load_prompts("chitchat", 32, seed=0, distinct=True) == no_repeats
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("a", "a", "b")))
    assert [p.messages for p in load_prompts(str(path), 2, distinct=True)] == [(("user", "a"),), (("user", "b"),)]


def test_a_set_with_too_few_distinct_prompts_is_refused(monkeypatch):
    from verinfer import prompts

    monkeypatch.setitem(prompts.BUILTIN, "chitchat",
                        lambda: [prompts.Prompt(f"p{i}", (("user", str(i % 3)),)) for i in range(9)])
    with pytest.raises(prompts.PromptError, match="holds 3 distinct prompts; --n 4 asks for more"):
        prompts.load_prompts("chitchat", 4, seed=0, distinct=True)


# ---------------------------------------------------------------- default outputs never overwrite


def test_fresh_path_never_returns_an_occupied_path(tmp_path):
    from verinfer.files import fresh_path

    a = fresh_path(tmp_path / "bands.json")
    a.write_text("first run")
    b = fresh_path(tmp_path / "bands.json")
    assert (a.name, b.name) == ("bands.json", "bands-2.json") and a.read_text() == "first run" and b.exists()
    d1, d2 = fresh_path(tmp_path / "out", directory=True), fresh_path(tmp_path / "out", directory=True)
    assert (d1.name, d2.name) == ("out", "out-2") and d1.is_dir() and d2.is_dir()


def test_audit_bands_default_is_a_new_file_in_the_working_directory(monkeypatch, tmp_path):
    import verinfer.auditing.bands
    from verinfer.auditing.bands import DATA_DIR
    from verinfer.models.backend import Backend

    shipped = sorted(p.name for p in DATA_DIR.iterdir())
    monkeypatch.setattr(Backend, "load", classmethod(lambda cls, *a, **k: SimpleNamespace(model_id="smollm2-135m")))
    monkeypatch.setattr(verinfer.auditing.bands, "build_bands",
                        lambda *a, **k: {"bands": {}, "clip": 1.0, "built_s": 0})
    monkeypatch.chdir(tmp_path)
    first, second = invoke("audit", "bands", "--n", "2"), invoke("audit", "bands", "--n", "2")
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    written = sorted(p.name for p in tmp_path.iterdir())
    assert len(written) == 2 and {w.replace("-2.json", ".json") for w in written} == {written[1]}, written
    assert all(w in first.output + second.output for w in written)
    assert sorted(p.name for p in DATA_DIR.iterdir()) == shipped


def test_experiment_default_is_a_new_directory_in_the_working_directory(monkeypatch, tmp_path):
    import verinfer.studies.detection
    import verinfer.studies.detection_report

    outs = []
    monkeypatch.setattr(verinfer.studies.detection, "run_matrix", lambda *a, **k: {})
    monkeypatch.setattr(verinfer.studies.detection_report, "analyse", lambda *a, **k: {"configs": {}})
    monkeypatch.setattr(verinfer.studies.detection_report, "write_report",
                        lambda result, out, machine, command: outs.append((out, command)) or [])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "verinfer-experiment").mkdir()
    (tmp_path / "verinfer-experiment" / "detection.md").write_text("a committed result")
    for _ in range(2):
        result = invoke("experiment", "--smoke", "--cache", tmp_path / "cache")
        assert result.exit_code == 0, result.output
    assert [o.name for o, _ in outs] == ["verinfer-experiment-2", "verinfer-experiment-3"]
    assert all(c.endswith(f"--out {o}") for o, c in outs)  # the recorded command names where it went
    assert (tmp_path / "verinfer-experiment" / "detection.md").read_text() == "a committed result"


# ---------------------------------------------------------------- full width in files and pipes


def test_tables_and_lines_do_not_wrap_in_pipes():
    code = ("from rich.table import Table; from verinfer.cli.main import console, err;"
            "t = Table('configuration', 'detail'); t.add_row('x' * 150, 'y' * 60); console.print(t);"
            "console.print('z' * 300); err.print('w' * 200)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                               **{k: v for k, v in os.environ.items() if k in ("HOME", "PYTHONPATH")}})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any("x" * 150 in line and "y" * 60 in line for line in lines), proc.stdout  # one table row, whole
    assert "z" * 300 in lines and "w" * 200 in proc.stderr.splitlines()


def test_every_command_module_uses_the_console_factory():
    from rich.console import Console

    from verinfer.cli import audit, errors, experiment, main, options
    from verinfer.cli.console import PIPE_WIDTH

    consoles = [getattr(m, name) for m in (audit, errors, experiment, main, options) for name in ("console", "err")
                if isinstance(getattr(m, name, None), Console)]
    assert len(consoles) == 8 and all(c.width == PIPE_WIDTH for c in consoles)  # pytest's streams: no terminal
    for module in Path(main.__file__).parent.glob("*.py"):  # one factory: no command module builds its own
        assert module.name == "console.py" or "Console(" not in module.read_text(), module.name
