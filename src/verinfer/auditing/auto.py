"""``--mode auto``: every test a provider's responses allow, combined into one verdict.

One request per prompt asks for everything at once: sampling at the claimed settings without a seed
(customers' traffic carries none; with ``--seeds``, the audit's seed ``seed + i * choices``),
``choices`` completions (``n``), the top logprobs and, unless ``--text-only``, the token ids. What
comes back decides which tests can run:

- ``surprise`` (each completion's reference log-probability against its expectation, an exact test
  martingale with no reference draws, ``verinfer.auditing.surprise``): with a local reference, on
  every completion; the most powerful seedless test at a prefill's cost (RESULTS.md section 21);
- ``logprobs`` (LOGIC): when every response returns logprobs;
- ``rank`` (RUT against ``--samples`` reference draws per completion): only where surprise cannot
  run (a reference API's top-20 logprobs cannot give surprise's exact null), as each draw costs a
  generation: with surprise beside it, rank would multiply the audit's cost for a weaker test;
- ``mmd`` (Model Equality Testing): when every response holds at least 2 completions (``--choices``);
- ``seeded`` (Token-DiFR replay of the seeded sampler, judged by bands or a calibration): only with
  ``--seeds``, when the provider returns token ids, honours seeds, the reference is local (a
  reference API cannot replay a seeded sampler) and bands or a calibration for the seeded settings
  exist (they name the claimed sampler profile: without them the test is not run, rather than claim a
  sampler the user did not). Seeds are honoured when the first ``PROBES`` prompts, asked a second
  time with the same seed (the request differs only in ``user``), return the same non-empty
  completion both times.

Which tests run depends only on the form of the responses (and the probe), never on a p-value. The
K tests run are combined by Holm's procedure (``verinfer.stats.verdict.holm``): the provider is
INCONSISTENT when the smallest Holm-adjusted p-value, ``min(1, K * min p_k)``, is below the audit's
FPR. That is the closed test of the global null "every test's null holds" with Bonferroni's local
tests, valid whatever the dependence between the tests (they share the same completions), so the
false-positive rate stays at the FPR however many tests the responses allow. Each test is run at
``FPR / K`` so that its own sequential looks and *tokens needed* are those of the combined level;
the test with the smallest p-value *carried the decision* and is named in the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from verinfer.auditing.client import Call
from verinfer.auditing.plan import AuditSpec
from verinfer.auditing.responses import Claim, parse_generation
from verinfer.auditing.logprobs import ReferenceValues, token_table
from verinfer.auditing.seedless import judge_logprobs, judge_sampled, returned_logprobs_of
from verinfer.stats.verdict import Verdict, holm

TESTS = ("seeded", "surprise", "logprobs", "rank", "mmd")  # the order ties are broken in
PROBES = 2  # prompts asked twice to learn whether seeds are honoured
PROBE_USER = "verinfer-seed-probe"


@dataclass
class AutoTest:
    """One test of an auto audit: its verdict at ``FPR / K`` (None when it could not run) and why."""

    name: str
    verdict: Verdict | None
    note: str
    p_holm: float | None = None  # Holm-adjusted over the tests that ran (``combine``)
    rejects: bool | None = None  # p_holm below the audit's FPR

    def to_dict(self) -> dict:
        v = self.verdict
        return {"test": self.name, "ran": v is not None, "note": self.note, "p_holm": self.p_holm,
                "rejects": self.rejects, **({} if v is None else {
                    "p_value": v.p_value, "statistic": v.statistic, "statistic_name": v.statistic_name,
                    "tokens": v.tokens, "tokens_needed": v.tokens_needed, "method": v.method})}


def probe_calls(calls: Sequence[Call]) -> list[Call]:
    """The first ``PROBES`` requests again, differing only in ``user`` (a new request key, the same seed)."""
    return [Call(c.path, {**c.body, "user": PROBE_USER}, {**c.meta, "kind": "seed-probe"}) for c in calls[:PROBES]]


def seeds_honoured(pairs: Sequence[tuple[Claim, Claim]]) -> bool:
    """Whether every (first answer, probe answer) pair is the same non-empty completion."""
    return bool(pairs) and all(a.output_token_ids and a.output_token_ids == b.output_token_ids for a, b in pairs)


def combine(results: Sequence[AutoTest], alpha: float) -> Verdict:
    """One verdict from the tests that ran: Holm over them (module docstring); fills ``p_holm``."""
    ran = [r for r in results if r.verdict is not None]
    if not ran:
        raise ValueError("no test could run on these responses")
    for r, p in zip(ran, holm([r.verdict.p_value for r in ran])):
        r.p_holm, r.rejects = p, p < alpha
    carrier = min(ran, key=lambda r: (r.p_holm, TESTS.index(r.name)))
    v, p = carrier.verdict, min(1.0, len(ran) * min(r.verdict.p_value for r in ran))
    consistent = p >= alpha
    names = ", ".join(f"{r.name} (p {r.verdict.p_value:.3g})" for r in ran)
    skipped = "; ".join(f"{r.name} not run: {r.note}" for r in results if r.verdict is None)
    role = "carried the decision" if not consistent else "came closest"
    method = (f"auto: Holm over the {len(ran)} test(s) the responses allowed, {names}, each run at "
              f"{alpha:.3g}/{len(ran)}; {carrier.name} {role} (Holm-adjusted p {carrier.p_holm:.3g}): "
              f"{v.method}" + (f". {skipped}" if skipped else ""))
    out = replace(v, consistent=consistent, p_value=p, alpha=alpha, method=method,
                  statistic_name=f"{v.statistic_name} [{carrier.name}]",
                  tokens_needed=v.tokens_needed if not consistent else None, p_adjusted=None)
    return out


def carried_by(results: Sequence[AutoTest]) -> str | None:
    """The test with the smallest Holm-adjusted p-value (after ``combine``)."""
    ran = [r for r in results if r.p_holm is not None]
    return min(ran, key=lambda r: (r.p_holm, TESTS.index(r.name))).name if ran else None


def completions(records: Sequence[dict], tokenizer, stops: set[int], vocab_size: int, want: int,
                where: Callable[[dict], str]) -> list[Claim]:
    """Up to ``want`` completions of each response (what the provider returned), in order."""
    return [parse_generation(r, tokenizer, stops, vocab_size, where(r), j)
            for r in records for j in range(min(want, len(r["response"]["choices"])))]


def plan_tests(spec: AuditSpec, records: Sequence[dict], claims: Sequence[Claim], honoured: bool,
               local: bool, judged_by: str | None) -> dict[str, str | None]:
    """Test name -> None when it can run, else why not (decided by the responses' form alone)."""
    firsts = [r["response"]["choices"][0] for r in records]
    counts = [len(r["response"]["choices"]) for r in records]
    why: dict[str, str | None] = {}
    why["seeded"] = (
        "no seeds were sent (--seeds sends them and adds this test)" if not spec.seeds else
        "a reference API cannot replay a seeded sampler (use a local reference model)" if not local else
        "no bands or calibration for the seeded settings (build them with `verinfer audit bands --mode seeded`)"
        if judged_by is None else
        "the provider returned no token ids" if any(c.source != "returned" for c in claims) else
        f"the provider does not honour seeds (the first {PROBES} prompts asked again with the same seed came back "
        "different)" if not honoured else None)
    why["logprobs"] = (None if all(isinstance(c.get("logprobs"), dict) for c in firsts)
                       else "the provider returned no logprobs")
    why["surprise"] = None if local else "a reference API's top-20 logprobs cannot give its exact null"
    why["rank"] = ("surprise ran: the stronger test needs no reference draws (--mode rank runs this one)" if local
                   else None if len(claims) >= 2 else "fewer than 2 completions")
    why["mmd"] = (None if min(counts) >= 2 and len(records) >= 2 else
                  f"fewer than 2 completions per prompt (asked n={spec.choices}; --choices 2 or more enables it)")
    return why


def shared_rows(records: Sequence[dict], claims: Sequence[Claim], returned, choices: int) -> dict[int, int]:
    """``id(claim)`` -> the returned logprobs it continues (``completions``' order: each response's first
    ``choices`` claims): its response's first completion, when the returned ids are a prefix of the claim's
    (a causal model's logits at those positions are then the same); the others are prefilled on their own."""
    which: dict[int, int] = {}
    at = 0
    for k, (record, ret) in enumerate(zip(records, returned)):
        c = claims[at]
        if c.prompt_token_ids == ret.prompt_token_ids and c.output_token_ids[:len(ret.token_ids)] == ret.token_ids:
            which[id(c)] = k
        at += min(choices, len(record["response"]["choices"]))
    return which


def component_spec(spec: AuditSpec, mode: str) -> AuditSpec:
    """The single-mode settings of one component (the same claimed sampling settings)."""
    return replace(spec, mode=mode, choices=spec.choices if mode == "seeded" else 1)


@dataclass
class AutoJudgement:
    verdict: Verdict
    tests: list[AutoTest]
    claims: list[Claim]  # every completion returned (up to ``choices`` per prompt)
    prompts: list[dict]  # per-prompt rows of surprise (or rank with a reference API), else of logprobs
    seeds_honoured: bool | None  # None: no seeds were sent, so none were probed


def judge_auto(records: Sequence[dict], probes: Sequence[dict], spec: AuditSpec, reference, out_dir, fpr: float,
               stops: set[int], provider: str, store, seeded: Callable[[float], Verdict] | None,
               on_stage: Callable[[str], None] | None = None, gap_bands=None) -> AutoJudgement:
    """Run every test ``plan_tests`` allows at ``fpr / K`` and ``combine`` them.

    ``seeded(alpha)`` gives the seeded test's verdict on the same responses (``verinfer.auditing.run``
    replays them; None when no bands or calibration judge it)."""
    stage = on_stage or (lambda _: None)
    where = lambda r: f"provider {provider!r}: {store.path} (prompt {r['prompt_id']})"  # noqa: E731
    claims = completions(records, reference.tokenizer, stops, reference.vocab_size, spec.choices, where)
    firsts = completions(records, reference.tokenizer, stops, reference.vocab_size, 1, where)
    probed = completions(probes, reference.tokenizer, stops, reference.vocab_size, 1, where)
    honoured = seeds_honoured(list(zip(firsts, probed)))
    backend = getattr(reference, "backend", None)
    remote = None if backend is not None else reference
    why = plan_tests(spec, records, claims, honoured, backend is not None, None if seeded is None else "given")
    k = sum(v is None for v in why.values())
    if k == 0:
        raise ValueError(f"provider {provider!r}: no test can run on its responses: "
                         + "; ".join(f"{n}: {w}" for n, w in why.items()))
    alpha = fpr / k
    sink, which = None, None
    if why["surprise"] is None and why["logprobs"] is None:  # the logprobs test's reference values come from
        # surprise's prefill of the same completions: one prefill for both tests
        returned = returned_logprobs_of(firsts, records, token_table(reference.tokenizer), provider, store)
        sink, which = ReferenceValues(returned), shared_rows(records, claims, returned, spec.choices)
    results, rows = [], None
    for name in TESTS:
        if why[name] is not None:
            results.append(AutoTest(name, None, why[name]))
            continue
        stage(f"{provider}: auto: {name} test at {alpha:.3g} ({k} test(s))")
        if name == "seeded":
            verdict = seeded(alpha)
        elif name == "surprise":
            judged = judge_sampled(claims, component_spec(spec, name), backend, out_dir, alpha, on_stage,
                                   on_block=None if sink is None else
                                   lambda block, judged: sink.add(block, [which.get(id(c)) for c in judged]))
            verdict, rows = judged.verdict, judged.prompts
        elif name == "logprobs":
            judged = judge_logprobs(firsts, records, component_spec(spec, name), backend, alpha, provider, store,
                                    remote=remote, sink=sink, bands=gap_bands)
            verdict, rows = judged.verdict, rows if rows is not None else judged.prompts
        else:
            judged = judge_sampled(claims, component_spec(spec, name), backend, out_dir, alpha, on_stage,
                                   remote=remote)
            verdict = judged.verdict
            if name == "rank":
                rows = judged.prompts
        results.append(AutoTest(name, verdict, "ran"))
    return AutoJudgement(combine(results, fpr), results, claims, rows or [], honoured if spec.seeds else None)
