"""Re-tokenized text aligned with the sampled tokens (issue #27 item 0: an honest provider that
returns text only was called INCONSISTENT because one merged token shifted every later seeded draw).

Unit tests of the re-split on the real tokenizer, then seeded audits of a real ``verinfer serve`` over
HTTP with token ids withheld (``token_ids=False``: the audit re-tokenizes the text, as it must for
``llama_cpp.server``): the honest server is CONSISTENT although merges occur, and the same server
behind the seed-rewriting proxy stays INCONSISTENT. The live ``llama_cpp.server`` version of the
honest case is in tests/test_engine_llama_server.py."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from tests.audit_servers import seed_proxy
from verinfer.auditing.alignment import align_claims, count_mismatch
from verinfer.scoring.alignment import resplit
from verinfer.auditing.responses import Claim


def _cols(claimed, replayed, nats=None) -> dict[str, np.ndarray]:
    """A replay's score columns: the claimed ids, the reference's tokens and (uniform unless given) cross-entropy."""
    return {"claimed": np.asarray(claimed), "verifier_token": np.asarray(replayed),
            "cross_entropy": np.ones(len(claimed)) if nats is None else np.asarray(nats, float)}


def _claim(ids: list[int], text: str, **kw) -> Claim:
    return Claim("p", 0, [1, 2], list(ids), "retokenized", text, kw.pop("finish_reason", "length"), **kw)


@pytest.fixture(scope="module")
def tok(backend):
    return backend.tokenizer


def test_a_merged_pair_is_split_where_the_reference_sampled_its_first_half(tok):
    sampled = tok.encode(" Hi,", add_special_tokens=False) + [tok.convert_tokens_to_ids("Ġthe"),
                                                                tok.convert_tokens_to_ids("re")]
    text = tok.decode(sampled)
    merged = tok.encode(text, add_special_tokens=False)
    assert merged != sampled and len(merged) == len(sampled) - 1  # " the" + "re" re-tokenize as " there"
    p = len(merged) - 1
    assert resplit(tok, merged, text, p, sampled[p]) == sampled
    # the reference's token must be where the text goes: another token, a stop token or the same one is no break
    assert resplit(tok, merged, text, p, tok.convert_tokens_to_ids("Ġcat")) is None
    assert resplit(tok, merged, text, p, tok.eos_token_id) is None
    assert resplit(tok, merged, text, p, merged[p]) is None


def test_align_claims_recovers_the_sampled_ids_and_leaves_unexplained_mismatches(tok):
    words = [" the", "re", " is", " a", " cat"]
    sampled = [tok.convert_tokens_to_ids(tok.tokenize(w)[0]) for w in words]
    text = tok.decode(sampled)
    honest = _claim(tok.encode(text, add_special_tokens=False), text)
    lying = _claim(tok.encode(" I am a dog", add_special_tokens=False), " I am a dog")
    calls = []

    def replay(claims):  # a reference that samples `sampled` (the honest provider's tokens) after any prefix
        calls.append(len(claims))
        return [_cols(c.output_token_ids, [sampled[i] if i < len(sampled) else 0
                                           for i in range(len(c.output_token_ids))]) for c in claims]

    out = align_claims([honest, lying], replay, tok)
    assert out[0].output_token_ids == sampled and out[0].drift["realigned"] == [0]
    assert out[1].output_token_ids == lying.output_token_ids and out[1].drift["realigned"] == []
    assert calls == [2, 1]  # the second replay only for the claim that changed


def test_a_replay_token_that_is_a_prefix_is_no_break_when_the_count_already_agrees_with_usage(tok):
    """Issue #41 item 5: a wrong seed's token is often a prefix of the served one (" the" where " there"
    was served); taken for a break, the output was re-split, its count no longer matched usage, and it
    was cut at its first mismatch (35% and 63% of a seed-rewriting proxy's tokens went unscored)."""
    text = " there is a cat"
    ids = tok.encode(text, add_special_tokens=False)
    the = tok.convert_tokens_to_ids("Ġthe")
    wrong = lambda claims: [_cols(c.output_token_ids, [the] + c.output_token_ids[1:]) for c in claims]  # noqa: E731
    agreeing = _claim(list(ids), text, served={"completion_tokens": len(ids)})
    (out,) = align_claims([agreeing], wrong, tok)
    assert out.output_token_ids == ids and out.drift["realigned"] == [] and out.drift["count_mismatch"] == 0
    merged = _claim(list(ids), text, served={"completion_tokens": len(ids) + 1})  # usage says " the" + "re"
    (out,) = align_claims([merged], wrong, tok)
    assert out.drift["realigned"] == [0] and out.drift["count_mismatch"] == 0
    (out,) = align_claims([_claim(list(ids), text)], wrong, tok)  # no usage: as before, the text decides
    assert out.drift["realigned"] == [0]


def test_a_returned_id_claim_is_never_realigned(tok):
    c = Claim("p", 0, [1], [5, 6], "returned", "xy", "length")
    assert align_claims([c], lambda cs: pytest.fail("no replay needed"), tok) == [c]


@pytest.mark.parametrize("reported, finish, flagged", [(3, "length", 0), (4, "stop", 0), (4, "length", 1),
                                                       (2, "stop", 1), (None, "length", None)])
def test_count_mismatch_allows_a_stop_token_only(tok, reported, finish, flagged):
    c = count_mismatch(_claim([5, 6, 7], "abc", finish_reason=finish, served={"completion_tokens": reported}))
    assert c.drift.get("count_mismatch") == flagged


SEEDED = dict(mode="seeded", profile="vllm", temperature=1.0, top_k=50, top_p=0.95, seed=100, max_tokens=32,
              token_ids=False)


@pytest.fixture(scope="module")
def honest_url(backend):
    import torch

    from verinfer.serve import ServeConfig, serve_in_thread

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with serve_in_thread(backend, ServeConfig(max_batch=16)) as url:
        yield url
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def seeded_audit(backend, honest_url, tmp_path_factory):
    from verinfer.auditing.bands import Bands, build_bands
    from verinfer.auditing.client import Endpoint
    from verinfer.auditing.plan import AuditSpec
    from verinfer.auditing.reference import LocalReference
    from verinfer.auditing.run import run_audit
    from verinfer.prompts import load_prompts

    spec = AuditSpec(**SEEDED)
    out = tmp_path_factory.mktemp("aligned")
    (out / "bands.json").write_text(json.dumps(build_bands(backend, load_prompts("chitchat", 8, seed=11), spec,
                                                           variants=("honest", "bf16"))))
    with seed_proxy(honest_url, out) as proxy_url:
        endpoints = [Endpoint("honest", honest_url, backend.model_id, None),
                     Endpoint("proxy", proxy_url, backend.model_id, None)]
        return run_audit(endpoints, load_prompts("chitchat", 16, seed=3), spec, LocalReference(backend), out / "audit",
                         bands=Bands.load(out / "bands.json"), concurrency=4)


def test_honest_text_only_seeded_audit_with_merged_tokens_is_consistent(seeded_audit, backend):
    honest = seeded_audit.providers[0]
    print(f"\nhonest: {honest.verdict.text}; drift {honest.drift}")
    assert honest.drift["retokenized"] == 16
    assert honest.drift["realigned"]["sequences"] >= 1  # merges occurred: what this test is about
    assert honest.drift["count_mismatch"]["sequences"] == 0  # after alignment every count agrees with usage
    assert honest.verdict.consistent, honest.verdict.text
    assert np.all(honest.columns["exact_match"])
    assert honest.verdict.tokens == sum(len(c.output_token_ids) for c in honest.claims) \
        - honest.drift["realigned"]["total"]  # re-split positions are drift, not evidence

    from verinfer.auditing.report import to_json, warning_lines

    # audit.json's warnings are the lines the terminal prints, drift included (issue #41 item 5: they were empty)
    doc = to_json(seeded_audit, backend.tokenizer)
    assert doc["providers"][0]["warnings"] == warning_lines(honest)
    assert any("re-split" in w for w in doc["providers"][0]["warnings"])


def test_wrong_seed_text_only_stays_inconsistent(seeded_audit):
    proxy = seeded_audit.providers[1]
    print(f"\nproxy: {proxy.verdict.text}; drift {proxy.drift}")
    assert not proxy.verdict.consistent, proxy.verdict.text
    assert np.mean(proxy.columns["exact_match"]) < 0.8
    # No wrong-seed token taken for a tokenization break (issue #41 item 5: 35% and 63% of a proxy's tokens went
    # unscored that way): a re-split may not take the count away from usage's.
    total = sum(len(c.output_token_ids) for c in proxy.claims)
    cut = (proxy.drift.get("unaligned") or {}).get("total", 0)
    print(f"proxy: {proxy.drift['realigned']['total']} re-split and {cut} cut of {total} tokens")
    # An output whose count disagrees with usage (a merge the wrong seed's replay cannot place, or bytes its text
    # lost) is repaired by the likeliest edit or cut where its bytes were lost, not at its first mismatch: one
    # output ending in a cut emoji lost all but one of its 32 tokens that way (7.9% of the proxy's tokens).
    assert (proxy.drift["realigned"]["total"] + cut) / total <= 0.05


def test_a_count_still_off_after_alignment_scores_up_to_the_first_mismatch_only(tok):
    from verinfer.auditing.alignment import unscored

    text = " I am a dog"
    ids = tok.encode(text, add_special_tokens=False)
    # the provider counts one token fewer, and no two adjacent tokens of the text merge into one
    c = _claim(ids, text, served={"completion_tokens": len(ids) - 1})
    replayed = ids[:2] + [tok.convert_tokens_to_ids("Ġcat")] * (len(ids) - 2)  # no break the text explains
    (out,) = align_claims([c], lambda cs: [_cols(ids, replayed) for _ in cs], tok)
    assert out.output_token_ids == ids and out.drift["count_mismatch"] == 1
    assert out.drift["unaligned_from"] == 3 and out.drift["unaligned"] == len(ids) - 3  # the mismatch at 2 is scored
    assert unscored([out], "x") == {"x/p": set(range(3, len(ids)))}


def test_an_output_cut_inside_a_character_is_scored_up_to_its_lost_bytes(tok):
    """The text of an output cut inside an emoji ends in U+FFFD: the provider's last tokens held bytes the
    text lost, and re-tokenizing the replacement character gives other tokens (here as many: the count
    agrees and cannot tell). The tokens from the character ahead of the lost bytes on are drift, whatever
    the replay; a count that leaves that tail no plausible number of tokens, or a replacement character
    inside the text (which could be steered to hide what follows), is no lost tail."""
    from verinfer.auditing.alignment import unscored
    from verinfer.scoring.alignment import lost_bytes_tail

    head = " Sorry. Can you?"
    emoji = tok.encode(" \U0001F641", add_special_tokens=False)  # " 🙁": the space and four bytes
    served = tok.encode(head, add_special_tokens=False) + emoji[:-1]  # stopped before the last byte's token
    text = tok.decode(served)
    assert text.endswith("\ufffd")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids != served
    n = len(tok.encode(head, add_special_tokens=False))  # up to the character (the space) before the lost bytes
    assert lost_bytes_tail(tok, ids, text, (len(served),)) == n == lost_bytes_tail(tok, ids, text)
    assert lost_bytes_tail(tok, ids, text, (n + 40,)) is None  # 40 tokens cannot hide in two characters
    assert lost_bytes_tail(tok, ids, head, (len(served),)) is None  # no lost bytes
    inside = text + " and more"
    assert lost_bytes_tail(tok, tok.encode(inside, add_special_tokens=False), inside) is None
    c = _claim(ids, text, served={"completion_tokens": len(served)})
    replayed = list(served) + [0] * (len(ids) - len(served))  # the provider's own tokens: the tail mismatches
    (out,) = align_claims([c], lambda cs: [_cols(x.output_token_ids, replayed[:len(x.output_token_ids)])
                                           for x in cs], tok)
    assert out.output_token_ids == ids and out.drift["realigned"] == []
    assert out.drift["unaligned_from"] == n and out.drift["unaligned"] == len(ids) - n
    assert unscored([out], "x") == {"x/p": set(range(n, len(ids)))}


def test_count_edits_keep_the_text_and_offer_the_sampled_split(tok):
    from verinfer.scoring.alignment import count_edits

    text = " there is a cat"
    ids = tok.encode(text, add_special_tokens=False)
    sampled = [tok.convert_tokens_to_ids("Ġthe"), tok.convert_tokens_to_ids("re")] + ids[1:]
    longer = count_edits(tok, ids, text, longer=True)
    assert (sampled, [0, 1]) in longer
    assert all(len(e) == len(ids) + 1 and tok.decode(e) == text for e, _ in longer)
    shorter = count_edits(tok, sampled, text, longer=False)
    assert (ids, [0]) in shorter and all(tok.decode(e) == text for e, _ in shorter)
    assert count_edits(tok, ids, text + "!", longer=True) == []  # ids that are not the text: nothing to offer


def test_a_count_off_with_no_break_is_repaired_by_the_likeliest_edit(tok):
    """Issue #41 item 5: a replay with another seed than the provider's shows no break, so an output whose
    text merged two sampled tokens (usage counts one more) was cut at its first mismatch. Each split that
    keeps the text is replayed; the one the reference finds likeliest is kept, its two positions unscored,
    and every other position is scored."""
    from verinfer.auditing.alignment import unscored

    text = " there is a cat"
    ids = tok.encode(text, add_special_tokens=False)
    sampled = [tok.convert_tokens_to_ids("Ġthe"), tok.convert_tokens_to_ids("re")] + ids[1:]
    cat = tok.convert_tokens_to_ids("Ġdog")
    seen = []

    def wrong_seed(claims):  # the reference never draws the served token; it finds the sampled split likeliest
        seen.append(len(claims))
        return [_cols(c.output_token_ids, [cat] * len(c.output_token_ids),
                      [0.5 if c.output_token_ids == sampled else 2.0] * len(c.output_token_ids)) for c in claims]

    (out,) = align_claims([_claim(ids, text, served={"completion_tokens": len(sampled)})], wrong_seed, tok)
    assert out.output_token_ids == sampled and out.drift["realigned"] == [0, 1]
    assert out.drift["count_mismatch"] == 0 and "unaligned" not in out.drift
    assert unscored([out], "x") == {"x/p": {0, 1}}
    assert seen[0] == 1 and seen[1] > 1 and seen[2:] == [1]  # as sent, the candidates side by side, the chosen one


def test_verify_aligns_traces_whose_ids_were_retokenized_from_text(backend, monkeypatch):
    """``verinfer verify`` (and so the monitor) aligns traces the gateway recorded from a text-only
    engine (``meta.token_source: retokenized``) the same way; other traces are scored as they stand.
    The alignment's last replay of each trace is its score: no trace is replayed again for the verdict."""
    from dataclasses import replace

    import verinfer.scoring.traces as scoring_traces

    from verinfer.api import generate, verify

    from verinfer.prompts import load_prompts

    # the prompts and seeds of the audits above, where one output's sampled tokens merge in its text
    sampled = generate(load_prompts("chitchat", 16, seed=3), n=16, backend=backend, seed=100, top_k=50, top_p=0.95,
                       max_tokens=32)
    tok, stops = backend.tokenizer, {tok_id for tok_id in (backend.tokenizer.eos_token_id,) if tok_id is not None}
    recorded = []
    for t in sampled:
        body = [i for i in t.output_token_ids if i not in stops]
        text = tok.decode(body, skip_special_tokens=True)
        recorded.append(replace(t, output_token_ids=tok.encode(text, add_special_tokens=False), output_text=text,
                                meta={"token_source": "retokenized"}))
    merged = [r.id for r, t in zip(recorded, sampled) if r.output_token_ids != [i for i in t.output_token_ids
                                                                                 if i not in stops]]
    assert merged, "no sampled output re-tokenizes differently: the test needs one"
    plain = verify([replace(r, meta=None) for r in recorded], backend=backend)
    replayed: list[str] = []
    real = scoring_traces.verify_traces

    def counting(backend, traces, **kw):
        replayed.extend(t.id for t in traces)
        return real(backend, traces, **kw)

    monkeypatch.setattr(scoring_traces, "verify_traces", counting)
    aligned = verify(recorded, backend=backend)
    monkeypatch.undo()
    print(f"\n{len(merged)} of {len(recorded)} outputs re-tokenize differently; exact match "
          f"{plain.summary.exact_match_rate:.4f} as they stand, {aligned.summary.exact_match_rate:.4f} aligned")
    assert plain.summary.exact_match_rate < 1.0  # scored as they stand, the merges look like divergence
    assert aligned.summary.exact_match_rate == 1.0
    sampled_tokens = sum(len([i for i in t.output_token_ids if i not in stops]) for t in sampled)
    assert sampled_tokens - aligned.summary.tokens >= len(merged)  # each merge leaves a re-split position unscored
    times = Counter(replayed)
    assert all(times[r.id] == 1 for r in recorded if r.id not in merged)  # never replayed again for the verdict
    assert all(times[i] >= 2 for i in merged)  # once as recorded, once per re-split

    # the reused replays are the scores a fresh replay of the aligned traces gives
    traces, skip, replays = scoring_traces.align_retokenized(backend, recorded)
    reused = scoring_traces.score_traces(backend, traces, skip=skip, reuse=replays).columns
    fresh = scoring_traces.score_traces(backend, traces, skip=skip).columns
    assert list(reused["trace_id"]) == list(fresh["trace_id"]) and np.array_equal(reused["position"], fresh["position"])
    np.testing.assert_allclose(reused["margin"], fresh["margin"], atol=1e-4)
    assert np.array_equal(reused["exact_match"], fresh["exact_match"])
