"""MarginGate: our decoder against Hugging Face, batch invariance of the reference path, and the
controller's repair (single column, forced disagreement, per-request protection). Real SmolLM2."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from verinfer.determinism.engine import Engine, Policy, Request
from verinfer.determinism.model import KVPool, Llama
from verinfer.determinism.study import choose_threshold, first_divergence, Row

PROMPTS = [
    "Hi! How are you today?",
    "Write a haiku about the sea, and then explain why the sea is salty.",
    "Name three primes.",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: the 2 cores are often shared, where two OpenMP threads wait on each other.
    (Results do not depend on the thread count; REFERENCE.md section 2.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def fp32():
    from verinfer.models.backend import Backend

    backend = Backend.load("smollm2-135m", "float32")
    return backend, Llama(backend.model)


@pytest.fixture(scope="module")
def prompts(fp32):
    from verinfer.prompts import Prompt, render

    backend, _ = fp32
    return [render(backend.tokenizer, Prompt(f"p{i}", (("user", t),))) for i, t in enumerate(PROMPTS)]


def requests(prompts, n_new=6, protected=(True, True, True), arrival_gap=1):
    return [Request(f"r{i}", tuple(p), n_new, protected[i], i * arrival_gap) for i, p in enumerate(prompts)]


class LogitLog:
    def __init__(self):
        self.rows = {}

    def __call__(self, request, index, logits):
        self.rows[(request.id, index)] = logits.clone()


def test_decoder_reproduces_hugging_face(fp32, prompts):
    from transformers import DynamicCache

    backend, model = fp32
    ids = prompts[1]
    h, cache = backend.hidden(torch.tensor([ids]), None, None, DynamicCache())
    expected = backend.logits(h[:, -1])[0]
    pool = model.new_pool(2, 128)
    fast = model.prefill_fast(pool, [0], [ids])[0]
    det = model.prefill_det(pool, 1, ids)
    assert (fast - expected).abs().max() <= 1e-5
    assert (det - expected).abs().max() <= 1e-4  # the deterministic path pads rows to the >=4 bucket
    token = int(expected.argmax())
    for step in range(3):
        pos = len(ids) + step
        h, cache = backend.hidden(torch.tensor([[token]]), None, torch.tensor([[pos]]), cache)
        expected = backend.logits(h[:, -1])[0]
        got = model.decode_fast(pool, torch.tensor([token]))[0]
        got_det, _, _ = model.decode_det(pool, [1], torch.tensor([token]), [pos])
        assert (got - expected).abs().max() <= 1e-5
        assert (got_det[0] - expected).abs().max() <= 1e-4
        token = int(expected.argmax())


def test_fast_path_depends_on_the_batch(fp32, prompts):
    """The phenomenon: the same request's fast-path logits change with what else is in the batch."""
    _, model = fp32
    alone, batched = LogitLog(), LogitLog()
    reqs = requests(prompts, 4)
    Engine(model, 1, 128, observer=alone).run(reqs[:1], Policy.fast())
    Engine(model, 3, 128, observer=batched).run(reqs, Policy.fast())
    diffs = [float((alone.rows[k] - batched.rows[k]).abs().max()) for k in alone.rows]
    assert max(diffs) > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_path_is_batch_invariant(fp32, prompts, dtype):
    """The deterministic path gives a request bit-identical logits alone or among other requests of
    other lengths, whatever the batch size, arrival order and slot."""
    if dtype == "float32":
        model = fp32[1]
    else:
        from verinfer.models.backend import Backend

        model = Llama(Backend.load("smollm2-135m", dtype).model)
    n_new = 5 if dtype == "float32" else 2
    alone, batched, reordered = LogitLog(), LogitLog(), LogitLog()
    reqs = requests(prompts, n_new)
    Engine(model, 1, 128, observer=alone).run(reqs[1:2], Policy.deterministic())
    Engine(model, 3, 128, observer=batched).run(reqs, Policy.deterministic())
    if dtype == "float32":  # other slot, other batch size, other arrival order
        shuffled = [replace(reqs[2], arrival=0), replace(reqs[0], arrival=0), replace(reqs[1], arrival=2)]
        Engine(model, 2, 128, observer=reordered).run(shuffled, Policy.deterministic())
    keys = [k for k in alone.rows]
    assert len(keys) == n_new
    for k in keys:
        assert torch.equal(alone.rows[k], batched.rows[k])
        if reordered.rows:
            assert torch.equal(alone.rows[k], reordered.rows[k])


def test_kvpool_write_column_touches_one_column():
    pool = KVPool(layers=2, slots=2, kv_heads=3, max_len=8, head_dim=4, dtype=torch.float32)
    pool.k.normal_()
    pool.v.normal_()
    before_k, before_v = pool.k.clone(), pool.v.clone()
    k_col, v_col = torch.full((2, 3, 4), 7.0), torch.full((2, 3, 4), -7.0)
    pool.write_column(1, 5, k_col, v_col)
    changed = (pool.k != before_k).nonzero()
    assert set(changed[:, 1].tolist()) == {1} and set(changed[:, 3].tolist()) == {5}
    assert torch.equal(pool.k[:, 1, :, 5], k_col) and torch.equal(pool.v[:, 1, :, 5], v_col)
    mask = torch.ones_like(pool.k, dtype=torch.bool)
    mask[:, 1, :, 5] = False
    assert torch.equal(pool.k[mask], before_k[mask]) and torch.equal(pool.v[mask], before_v[mask])


class ForcedFlip:
    """Fault injection: at output index ``at`` of request ``rid``, make the fast path's second-best
    token win by a hair (a near tie the gate must catch) and corrupt the current K/V column."""

    def __init__(self, model, rid="r0", at=2, corrupt=True):
        self.model, self.rid, self.at, self.corrupt = model, rid, at, corrupt
        self.seen = {}

    def __call__(self, site):
        if site.request.id != self.rid:
            return
        pool, slot, pos = site.pool, site.slot, site.pos
        if site.index == self.at:
            _, expected_k, expected_v = self.model.decode_det(pool, [slot], torch.tensor([site.token_in]), [pos],
                                                              commit=False)
            self.seen["earlier"] = (pool.k[:, slot, :, :pos].clone(), pool.v[:, slot, :, :pos].clone())
            self.seen["expected"] = (expected_k[0], expected_v[0])
            self.seen["pos"] = pos
            if self.corrupt:
                pool.k[:, slot, :, pos] += 1.0
            top = site.logits.topk(2).indices
            self.seen["forced"] = int(top[1])
            site.logits[top[1]] = site.logits[top[0]] + 1e-4
        elif site.index == self.at + 1:
            p = self.seen["pos"]
            self.seen["after"] = (pool.k[:, slot, :, :p + 1].clone(), pool.v[:, slot, :, :p + 1].clone())


def test_forced_disagreement_is_repaired_in_one_column(fp32, prompts):
    _, model = fp32
    reqs = requests(prompts, 6)
    reference = Engine(model, 3, 128).run(reqs, Policy.deterministic()).outputs
    # without MarginGate the forced flip changes the protected output
    broken = Engine(model, 3, 128, fault=ForcedFlip(model, corrupt=False)).run(reqs, Policy.fast()).outputs
    assert first_divergence(broken["r0"].tokens, reference["r0"].tokens) == 2
    fault = ForcedFlip(model)
    run = Engine(model, 3, 128, fault=fault).run(reqs, Policy.margingate(1e-3, commit="repair"))
    out = run.outputs["r0"]
    assert out.tokens == reference["r0"].tokens
    assert out.repaired[2] and out.verified[2] and sum(out.repaired) == 1
    assert fault.seen["forced"] != reference["r0"].tokens[2]
    assert run.stats.repairs >= 1
    # the repair rewrote only the current column: earlier columns untouched, current = verifier's
    p = fault.seen["pos"]
    k_after, v_after = fault.seen["after"]
    k_before, v_before = fault.seen["earlier"]
    assert torch.equal(k_after[:, :, :p], k_before) and torch.equal(v_after[:, :, :p], v_before)
    assert torch.equal(k_after[:, :, p], fault.seen["expected"][0])
    assert torch.equal(v_after[:, :, p], fault.seen["expected"][1])


def test_unprotected_requests_are_unaffected(fp32, prompts):
    _, model = fp32
    reqs = requests(prompts, 6, protected=(True, False, False))
    fast = Engine(model, 3, 128, fault=ForcedFlip(model)).run(reqs, Policy.fast()).outputs
    gate = Engine(model, 3, 128, fault=ForcedFlip(model)).run(reqs, Policy.margingate(1e-3))
    reference = Engine(model, 3, 128).run(reqs, Policy.deterministic()).outputs
    assert gate.outputs["r0"].tokens == reference["r0"].tokens  # protected: repaired
    assert fast["r0"].tokens != reference["r0"].tokens
    for rid in ("r1", "r2"):  # unprotected: never verified, same tokens as the fast path
        assert not any(gate.outputs[rid].verified)
        assert gate.outputs[rid].tokens == fast[rid].tokens
    assert gate.stats.protected_decode_steps == 5


def test_always_on_with_verified_commit_is_the_reference(fp32, prompts):
    _, model = fp32
    reqs = requests(prompts, 5)
    reference = Engine(model, 3, 128).run(reqs, Policy.deterministic()).outputs
    run = Engine(model, 3, 128).run(reqs, Policy.always())
    assert run.stats.trigger_rate == 1.0
    assert all(run.outputs[r.id].tokens == reference[r.id].tokens for r in reqs)


def test_window_pass_equals_successive_deterministic_steps(fp32, prompts):
    """``forward_det`` over a run of tokens gives, bit for bit, the logits and K/V columns of the same
    tokens fed one deterministic step at a time (what lets the window verifier be exact)."""
    _, model = fp32
    prompt, run = prompts[1], [510, 2114, 314, 260, 1011]
    steps = model.new_pool(2, 64)
    model.prefill_det(steps, 1, prompt)
    step_logits = [model.decode_det(steps, [1], torch.tensor([t]), [len(prompt) + j])[0][0] for j, t in enumerate(run)]
    window = model.new_pool(2, 64)
    model.prefill_det(window, 0, prompts[0])  # another request in the pool changes nothing
    model.prefill_det(window, 1, prompt)
    logits, k_cols, v_cols = model.forward_det(window, [1], [run], [len(prompt)])
    end = len(prompt) + len(run)
    assert window.lengths[1] == steps.lengths[1] == end
    assert torch.equal(logits, torch.stack(step_logits))
    assert torch.equal(window.k[:, 1, :, :end], steps.k[:, 1, :, :end])
    assert torch.equal(window.v[:, 1, :, :end], steps.v[:, 1, :, :end])
    assert torch.equal(k_cols.permute(1, 2, 0, 3), steps.k[:, 1, :, len(prompt):end])
    before = window.k.clone()
    model.forward_det(window, [1], [run[:2]], [len(prompt)], commit=False)
    assert torch.equal(window.k, before) and window.lengths[1] == end


class ConfidentFlip:
    """Fault injection: once, at output index ``at`` of request ``rid``, make the fast path choose
    its second token by a wide margin (5 logits): a flip the margin gate cannot see."""

    def __init__(self, rid="r0", at=2):
        self.rid, self.at, self.fired = rid, at, False

    def __call__(self, site):
        if site.request.id == self.rid and site.index == self.at and not self.fired:
            self.fired = True
            top = site.logits.topk(2).indices
            site.logits[top[1]] = site.logits[top[0]] + 5.0


@pytest.mark.parametrize("threshold", [0.0, 1e-3, 0.5])
def test_window_rule_rolls_back_a_flip_the_gate_missed(fp32, prompts, threshold):
    """The window rule checks every token emitted since the last verified column (at the next
    trigger or when the request finishes) and rolls back to the first one the verifier would not
    have chosen; the paper's single-column rule cannot see a confident flip. Unprotected requests
    keep their fast tokens."""
    _, model = fp32
    reqs = requests(prompts, 6, protected=(True, True, False))
    reference = Engine(model, 3, 128).run(reqs, Policy.deterministic()).outputs
    fast = Engine(model, 3, 128, fault=ConfidentFlip()).run(reqs, Policy.fast()).outputs
    assert first_divergence(fast["r0"].tokens, reference["r0"].tokens) == 2
    paper = Engine(model, 3, 128, fault=ConfidentFlip()).run(reqs, Policy.margingate(threshold, "repair")).outputs
    assert paper["r0"].tokens != reference["r0"].tokens
    run = Engine(model, 3, 128, fault=ConfidentFlip()).run(reqs, Policy.margingate(threshold, "window"))
    out = run.outputs["r0"]
    assert out.tokens == reference["r0"].tokens and out.rollbacks == 1 and out.repaired[2]
    assert run.outputs["r1"].tokens == reference["r1"].tokens and run.outputs["r1"].rollbacks == 0
    assert run.stats.rollbacks == 1 and run.stats.dropped_tokens >= 1
    assert all(o.checked == len(o.tokens) for o in (out, run.outputs["r1"]))
    assert not any(run.outputs["r2"].verified) and run.outputs["r2"].tokens == fast["r2"].tokens


def test_policy_and_engine_validation(fp32, prompts):
    _, model = fp32
    with pytest.raises(ValueError):
        Policy("nope")
    with pytest.raises(ValueError):
        Policy.margingate(-1.0)
    with pytest.raises(ValueError):
        Policy.margingate(math.nan)
    with pytest.raises(ValueError):
        Policy.margingate(1.0, commit="sometimes")
    with pytest.raises(ValueError, match="max_len"):
        Engine(model, 2, 16).run(requests(prompts, 4), Policy.fast())
    with pytest.raises(ValueError, match="unique"):
        Engine(model, 2, 128).run([Request("a", (1, 2)), Request("a", (1, 2))], Policy.fast())
    assert Policy.always().name == "always-on" and Policy.margingate(0.5, "repair").name == "margingate@0.5/repair-only"
    assert Policy.margingate(0.5).name == "margingate@0.5" and Policy.margingate(0.5, "window").name == "margingate@0.5"
    assert Policy.margingate(0.5, "verified").name == "margingate@0.5/current-column"


def test_threshold_choice_and_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    rows = [Row("s", "margingate@0.5", 4, 1, 1, 4, 3, 10, 1, 0, 1), Row("s", "margingate@1", 4, 1, 1, 4, 4, 10, 2, 0, 1),
            Row("s", "margingate@2", 4, 1, 1, 4, 4, 10, 3, 0, 1), Row("s", "always-on", 4, 1, 1, 4, 4, 10, 10, 0, 1)]
    assert choose_threshold(rows) == 1.0
    assert choose_threshold(rows[:1]) is None
    # window rows always match the reference; a rollback (a flip the gate missed) disqualifies a threshold
    window = [Row("s", "margingate@0.25", 4, 1, 1, 4, 4, 10, 1, 0, 1, rollbacks=1),
              Row("s", "margingate@0.5", 4, 1, 1, 4, 4, 10, 2, 0, 1),
              Row("s", "margingate@0.25/repair-only", 4, 1, 1, 4, 4, 10, 1, 0, 1),
              Row("s", "margingate@0.1/current-column", 4, 1, 1, 4, 4, 10, 1, 0, 1)]
    assert choose_threshold(window) == 0.5
    assert choose_threshold(window, "/repair-only") == 0.25
    assert choose_threshold(window, "/current-column") == 0.1


def test_sweep_cli_end_to_end(tmp_path):
    """``verinfer margingate sweep`` on a tiny set writes every table; both rules are swept, the
    window rule's outputs all match the reference, and unprotected requests never pay."""
    from typer.testing import CliRunner

    from verinfer.cli.main import app

    out = tmp_path / "mg.md"
    result = CliRunner().invoke(app, ["margingate", "sweep", "--n", "2", "--n-transfer", "1", "--transfer", "gsm8k",
                                      "--max-tokens", "4", "--batch-size", "2", "--thresholds", "0,0.1",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    for title in ("Observation 1", "Calibration sweep", "Transfer", "Per-request protection"):
        assert title in text, title
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| chitchat | 2 | margingate@")]
    assert {r[2] for r in rows} == {"margingate@0", "margingate@0.1", "margingate@0/repair-only",
                                    "margingate@0.1/repair-only"}
    assert all(r[7] == "2/2" for r in rows if "/" not in r[2])  # window rule: every output identical


@pytest.mark.parametrize("args, needle", [
    (["--thresholds", "abc"], "comma-separated numbers"),
    (["--prompts", "/nonexistent/prompts.jsonl"], "prompts.jsonl"),
    (["--batch-sizes", "two"], "comma-separated integers"),
])
def test_sweep_cli_bad_input(args, needle):
    from typer.testing import CliRunner

    from verinfer.cli.main import app

    result = CliRunner().invoke(app, ["margingate", "sweep", "--n", "1", "--max-tokens", "2"] + args)
    assert result.exit_code == 2, result.output
    assert needle in result.output


def test_decode_cli_writes_batch_independent_traces(tmp_path):
    """``verinfer margingate decode`` writes greedy traces that do not depend on the batch size, and
    refuses bad options with exit 2."""
    from typer.testing import CliRunner

    from verinfer.cli.main import app
    from verinfer.trace import read_traces

    outs = {}
    for b in (1, 3):
        path = tmp_path / f"b{b}.jsonl"
        result = CliRunner().invoke(app, ["margingate", "decode", "-o", str(path), "--n", "3", "--max-tokens", "5",
                                          "--batch-size", str(b), "--dtype", "float32", "--threshold", "0.1"])
        assert result.exit_code == 0, result.output
        outs[b] = read_traces(path)
    assert [t.output_token_ids for t in outs[1]] == [t.output_token_ids for t in outs[3]]
    assert all(t.sampling.profile == "greedy" and t.meta["policy"] == "margingate@0.1" for t in outs[3])
    for bad, needle in ((["--policy", "sometimes"], "--policy"), (["--commit", "nope"], "commit rule"),
                        (["-o", str(tmp_path / "x.txt")], ".jsonl or .parquet")):
        args = ["margingate", "decode", "-o", str(tmp_path / "x.jsonl"), "--n", "1", "--max-new-tokens", "2"] + bad
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and needle in result.output, result.output
