"""vLLM 0.32's speculative-decoding rejection sampler (model runner V2), replayed token for token.

``fixtures/engines/vllm_v2_spec.json.gz`` was recorded by ``engines/vllm_cpu/spec_fixtures.py``: vLLM's own
``rejection_sample`` (``vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py``) and ``tl_rand32`` /
``gumbel_sample`` (``sample/gumbel.py``), executed unchanged but for their import lines in Triton's
interpreter on CPU. The inputs are rebuilt here from the recipe stored with each request (numpy only; no
triton, no vllm):

    raw    = default_rng(rng_seed).standard_normal((k + 1, V)).astype(float32) * float32(scale)
    draft  = raw[:k] + default_rng(rng_seed + 1).standard_normal((k, V)).astype(float32) * float32(draft_noise)
    target = raw / float32(temperature) if temperature > 0 else raw;  then the top-k mask (-inf) if top_k > 0

Row ``j`` is at position ``pos0 + j``; the recorded draft tokens are vLLM's drafting Gumbel proposals from
``draft[j]`` at ``pos0 + j`` (-1 at the placeholder steps).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from verinfer.sampling.params import SamplingParams
from verinfer.sampling.profiles import RowKeys
from verinfer.sampling.profiles.vllm import VllmProfile
from verinfer.sampling.sampler import replay

FIXTURE = Path(__file__).parent / "fixtures" / "engines" / "vllm_v2_spec.json.gz"


@pytest.fixture(scope="module")
def spec():
    with gzip.open(FIXTURE, "rt") as fh:
        return json.load(fh)


def _requests(spec) -> list[dict]:
    cols = spec["requests"]
    return [{name: cols[name][i] for name in cols} for i in range(len(cols["k"]))]


def _inputs(r: dict) -> tuple[np.ndarray, np.ndarray]:
    """(processed target logits [k+1, V], raw draft logits [k, V]), float32, as recorded."""
    k, vocab = r["k"], r["vocab"]
    raw = np.random.default_rng(r["rng_seed"]).standard_normal((k + 1, vocab)).astype(np.float32) \
        * np.float32(r["scale"])
    noise = np.random.default_rng(r["rng_seed"] + 1).standard_normal((k, vocab)).astype(np.float32)
    draft = (raw[:k] + noise * np.float32(r["draft_noise"])).astype(np.float32)
    t = r["temperature"]
    target = (raw / np.float32(t)).astype(np.float32) if t > 0 else raw.copy()
    if r["top_k"] > 0:
        kth = np.sort(target, axis=1)[:, -r["top_k"]][:, None]
        target = np.where(target >= kth, target, np.float32(-np.inf)).astype(np.float32)
    return target, draft


def test_fixture_covers_the_recipe_space(spec):
    reqs = spec["requests"]
    n, rows = len(reqs["k"]), sum(k + 1 for k in reqs["k"])
    assert n >= 3000 and rows >= 10000
    assert set(reqs["k"]) == {1, 2, 4}
    assert set(reqs["temperature"]) == {float(np.float32(t)) for t in (0.0, 0.6, 1.0, 1.3)}  # fp32, as the kernel saw
    assert max(reqs["vocab"]) > 8192 and set(reqs["fp64"]) == {False, True} and set(reqs["one_hot"]) == {False, True}
    assert any(reqs["placeholders"]) and any(t > 0 for t in reqs["top_k"]) and max(reqs["pos0"]) > 2**32
    accepted = np.array(reqs["num_sampled"]) - 1
    ks = np.array(reqs["k"])
    assert 0.3 < accepted.sum() / ks.sum() < 0.95  # realistic acceptance: rejections and bonus tokens both common
    assert (accepted == ks).mean() > 0.2 and (accepted < ks).mean() > 0.2
    assert len(spec["rand"]["bits"]) >= 4000


def test_tl_rand32_bit_identical(spec):
    philox = pytest.importorskip("verinfer.sampling.philox")
    rand = spec["rand"]
    seeds = np.array(rand["seed"], dtype=object)
    got = np.asarray(philox.tl_rand32(seeds, np.array(rand["pos"], dtype=np.int64)), dtype=np.float32)
    assert got.dtype == np.float32
    bits = got.view(np.uint32)
    expect = np.array(rand["bits"], dtype=np.uint32)
    wrong = np.flatnonzero(bits != expect)
    assert wrong.size == 0, (f"{wrong.size} of {expect.size} differ, e.g. "
                             f"{[(rand['seed'][i], rand['pos'][i], int(expect[i]), int(bits[i])) for i in wrong[:5]]}")


def test_draft_tokens_are_vllm_draft_proposals(spec):
    """The recorded drafts are what verinfer's ``vllm`` profile (drafting salt) samples from the draft logits
    (every eighth request: the Gumbel kernel itself is covered by ``vllm_v2_gumbel.json.gz``)."""
    wrong = []
    for fp64 in (False, True):
        reqs = [r for r in _requests(spec)[::8] if r["fp64"] == fp64]
        for vocab in sorted({r["vocab"] for r in reqs}):
            xs, params, seeds, pos, expect = [], [], [], [], []
            for r in (r for r in reqs if r["vocab"] == vocab):
                _, draft = _inputs(r)
                for j in range(r["k"]):
                    if j in r["placeholders"]:
                        continue
                    xs.append(draft[j])
                    params.append(SamplingParams(profile="vllm", temperature=r["temperature"], seed=r["seed"],
                                                 fp64_gumbel=fp64))
                    seeds.append(r["seed"])
                    pos.append(r["pos0"] + j)
                    expect.append((r["draft_tokens"][j], r, j))
            keys = RowKeys(requests=tuple(f"d{i}" for i in range(len(xs))), seeds=np.array(seeds, dtype=object),
                           positions=np.array(pos, dtype=np.int64), steps=np.zeros(len(xs), dtype=np.int64),
                           params=tuple(params))
            got = replay(torch.from_numpy(np.stack(xs)), params, VllmProfile(draft=True), keys).token.tolist()
            wrong += [(r, j, e, g) for (e, r, j), g in zip(expect, got) if e != g]
    assert not wrong, f"{len(wrong)} draft tokens differ, e.g. {wrong[:3]}"


def test_rejection_sample_token_for_token(spec):
    speculative = pytest.importorskip("verinfer.sampling.speculative")
    wrong = []
    reqs = _requests(spec)
    for r in reqs:
        target, draft = _inputs(r)
        got = speculative.rejection_sample(torch.from_numpy(target), None if r["one_hot"] else torch.from_numpy(draft),
                                           r["draft_tokens"], seed=r["seed"], pos0=r["pos0"],
                                           temperature=r["temperature"], fp64=r["fp64"])
        if list(got.tokens) != r["sampled"] or len(got.tokens) != r["num_sampled"] \
                or got.num_accepted != r["num_sampled"] - 1:
            wrong.append((r, list(got.tokens), got.num_accepted))
    assert not wrong, (f"{len(wrong)} of {len(reqs)} requests differ, e.g. "
                       + "; ".join(f"{ {k: v for k, v in r.items() if k not in ('sampled',)} } expected {r['sampled']} "
                                   f"got {tokens} (accepted {acc})" for r, tokens, acc in wrong[:3]))
