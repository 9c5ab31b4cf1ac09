"""Engine profiles proven against the engines: transformers, SGLang, llama.cpp.

Fixtures under ``tests/fixtures/engines/`` come from the real engines (commands in
``engines/README.md``); the fast tests here replay them with verinfer's sampler.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from verinfer.sampling.params import SamplingParams
from verinfer.sampling.profiles import RowKeys, get_profile, params_problems
from verinfer.sampling.sampler import replay

FIXTURES = Path(__file__).parent / "fixtures" / "engines"


def _keys(n, seeds, positions=None, steps=None, params=()):
    return RowKeys(requests=tuple(f"r{i}" for i in range(n)), seeds=np.array(seeds, dtype=object),
                   positions=np.asarray(positions if positions is not None else np.zeros(n), dtype=np.int64),
                   steps=np.asarray(steps if steps is not None else np.zeros(n), dtype=np.int64), params=tuple(params))


# --------------------------------------------------------------------------------------------------
# transformers


def _hf_params(batch, row, vocab, seed, **kw):
    return SamplingParams(profile="transformers", seed=seed, stream={"batch_size": batch, "row": row, "vocab": vocab},
                          **kw)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (50, 0.95), (5, 1.0)])
def test_transformers_replays_torch_multinomial_with_hf_warpers(top_k, top_p):
    """HF's own warpers + torch.multinomial on the global generator vs the profile, step by step."""
    from transformers.generation.logits_process import LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

    steps, batch, vocab, seed = 6, 3, 500, 1234
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(steps, batch, vocab, generator=g) * 3
    warpers = LogitsProcessorList(([TopKLogitsWarper(top_k)] if top_k else []) +
                                  ([TopPLogitsWarper(top_p)] if top_p < 1 else []))
    torch.manual_seed(seed)
    engine = torch.stack([torch.multinomial(torch.softmax(warpers(None, logits[k]), -1), 1).squeeze(1)
                          for k in range(steps)])  # [steps, batch]
    profile = get_profile("transformers")
    rows = [(k, r) for k in range(steps) for r in range(batch)]
    params = [_hf_params(batch, r, vocab, seed, temperature=1.0, top_k=top_k or -1, top_p=top_p) for k, r in rows]
    keys = RowKeys(requests=tuple(f"row{r}" for _, r in rows), seeds=np.array([seed] * len(rows), dtype=object),
                   positions=np.array([k for k, _ in rows]), steps=np.array([k for k, _ in rows]), params=tuple(params))
    flat = torch.stack([logits[k, r] for k, r in rows])
    out = replay(flat, params, profile, keys, claimed=engine.reshape(-1))
    assert torch.equal(out.token, engine.reshape(-1))
    assert bool((out.margin == 0).all())
    # The row is part of the stream: swapping rows breaks it (a wrong stream must not pass).
    wrong = [_hf_params(batch, (r + 1) % batch, vocab, seed, temperature=1.0, top_k=top_k or -1, top_p=top_p)
             for _, r in rows]
    swapped = replay(flat, wrong, get_profile("transformers"), RowKeys(**{**keys.__dict__, "params": tuple(wrong)}))
    assert not torch.equal(swapped.token, engine.reshape(-1))


def test_transformers_stream_is_validated():
    ok = _hf_params(4, 1, 49152, 7)
    assert params_problems(ok) == []
    assert any("stream" in p for p in params_problems(SamplingParams(profile="transformers", seed=7)))
    assert any("row" in p for p in params_problems(_hf_params(4, 4, 49152, 7)))
    assert any("unknown" in p for p in params_problems(ok.with_(stream={**ok.stream, "extra": 1})))
    assert any("min_p" in p for p in params_problems(ok.with_(min_p=0.1, top_p=0.9)))
    # A stream as wide as another model's logits is refused by name, not replayed on a wrong layout.
    wide = _hf_params(1, 0, 3001, 7)
    keys = RowKeys(("r",), np.array([7], dtype=object), np.array([3]), np.array([0]), params=(wide,))
    with pytest.raises(ValueError, match="stream.vocab is 3001 but the model's logits have 3000 columns"):
        replay(torch.randn(1, 3000), [wide], get_profile("transformers"), keys)


@pytest.fixture(scope="module")
def backend():
    from verinfer.api import load_model

    return load_model("smollm2-135m", "float32")


def _read(path):
    from verinfer.trace import read_traces

    return list(read_traces(path))


def test_transformers_generate_fixture_replays_exactly(backend):
    """Traces of the real ``model.generate`` (left-padded batch of 4, greedy and two seeded configs)."""
    from dataclasses import replace

    from verinfer.api import verify

    traces = _read(FIXTURES / "transformers" / "generate_b4_t16.jsonl")
    assert {t.sampling.profile for t in traces} == {"greedy", "transformers"}
    # The same unfiltered outputs claimed under the wrong batch row must be caught (one prefill for all).
    wrong = [replace(t, id=t.id + "-wrong-row", sampling=t.sampling.with_(
                 stream={**t.sampling.stream, "row": (t.sampling.stream["row"] + 1) % 4}))
             for t in traces if t.sampling.profile == "transformers" and t.sampling.top_k <= 0]
    cols = verify(traces + wrong, backend=backend).columns
    bad = np.array([i.endswith("-wrong-row") for i in cols["trace_id"]])
    assert cols["exact_match"][~bad].all() and (cols["margin"][~bad] == 0).all()
    assert cols["exact_match"][bad].mean() < 0.9


# --------------------------------------------------------------------------------------------------
# SGLang


def test_sglang_hash_matches_sglang_kernel():
    from verinfer.sampling.profiles.sglang import hashes

    golden = json.loads((FIXTURES / "sglang" / "golden.json").read_text())
    for h in golden["hashes"]:
        assert int(hashes([h["seed"]], [h["pos"]], np.array([0]), np.array([h["col"]]), 49152)[0]) == h["hash"]


def test_sglang_noise_edges():
    from verinfer.sampling.profiles.sglang import gumbel_from_hash

    g = gumbel_from_hash(np.array([0, 1, 2**31, 2**32 - 2, 2**32 - 1], dtype=np.uint32))
    assert g[0] == pytest.approx(-np.log(np.finfo(np.float64).max))  # u = 0: log clamped at the f64 minimum
    assert g[-1] == pytest.approx(-np.log(2.0**-32))  # u = 1: capped, not +inf
    assert np.all(np.diff(g) > 0) and np.isfinite(g).all()


@pytest.mark.parametrize("case", range(6))
def test_sglang_replays_sglang_sampler(case):
    """Tokens sampled by SGLang's own functions (Triton interpreter on CPU) replay exactly."""
    golden = json.loads((FIXTURES / "sglang" / "golden.json").read_text())
    c = golden["cases"][case]
    logits = torch.tensor(c["logits"], dtype=torch.float32)
    n = logits.shape[0]
    params = [SamplingParams(profile="sglang", temperature=c["temperature"], top_k=c["top_k"], top_p=c["top_p"], seed=s)
              for s in c["seeds"]]
    assert all(params_problems(p) == [] for p in params)
    keys = _keys(n, c["seeds"], positions=c["positions"], params=params)
    out = replay(logits, params, get_profile("sglang"), keys, claimed=torch.tensor(c["tokens"]))
    assert out.token.tolist() == c["tokens"]
    if c["sorted"]:  # the noise column is the sorted rank: hashing token ids instead must not pass
        from verinfer.sampling.profiles.sglang import SglangProfile

        class IdColumns(SglangProfile):
            def gumbel_cols(self, keys, rows, cols, kept):
                return cols

        as_ids = replay(logits, params, IdColumns(), keys)
        assert as_ids.token.tolist() != c["tokens"]


def test_sglang_problems():
    p = SamplingParams(profile="sglang", seed=42, top_k=20)
    assert params_problems(p) == []
    assert any("min_p" in m for m in params_problems(p.with_(min_p=0.1)))
    assert any("sorted" in m for m in params_problems(p.with_(stream={"sorted": False})))
    assert params_problems(p.with_(top_k=-1, stream={"sorted": True})) == []


# --------------------------------------------------------------------------------------------------
# llama.cpp (inverse CDF)


def test_mt19937_and_canonical_double():
    from verinfer.sampling.mt19937 import canonical_doubles, mt19937_outputs

    assert int(mt19937_outputs(5489, 10000)[-1]) == 4123659995  # the C++ standard's check value for mt19937
    o = np.array([0, 0, 2**32 - 1, 2**32 - 1, 123, 2**31], dtype=np.uint64)
    u = canonical_doubles(o)
    assert u[0] == 0.0 and u[1] == np.nextafter(1.0, 0.0) and u[2] == (123 + 2.0**63) / 2.0**64


def _llama_dist_reference(x: np.ndarray, u: float, top_k: int, top_p: float) -> int:
    """llama.cpp's chain at T = 1 written out from its documented behaviour (profile docstring)."""
    ids = np.arange(x.size)
    if top_k > 0 or top_p < 1:
        ids = np.argsort(-x, kind="stable")
        if top_k > 0:
            ids = ids[:top_k]
        if top_p < 1:
            p = np.exp(x[ids] - x[ids].max())
            cum = np.cumsum((p / p.sum()).astype(np.float32), dtype=np.float32)
            ids = ids[:int(np.argmax(cum >= top_p)) + 1]
    p = np.exp((x[ids] - x[ids].max()).astype(np.float32)).astype(np.float64)
    return int(ids[int(np.searchsorted(np.cumsum(p), u * p.sum()))])


@pytest.mark.parametrize("top_k,top_p", [(-1, 1.0), (40, 0.95), (-1, 0.9)])
def test_llama_cpp_inverse_cdf_replay(top_k, top_p):
    from verinfer.sampling.mt19937 import canonical_doubles, mt19937_outputs

    n, vocab, seed = 12, 400, 77
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(3)) * 3
    params = [SamplingParams(profile="llama.cpp", top_k=top_k, top_p=top_p, seed=seed) for _ in range(n)]
    assert params_problems(params[0]) == []
    keys = _keys(n, [seed] * n, positions=np.arange(n), steps=np.arange(n), params=params)
    u = canonical_doubles(mt19937_outputs(seed, 2 * n))
    expect = torch.tensor([_llama_dist_reference(logits[r].numpy(), u[r], top_k, top_p) for r in range(n)])
    out = replay(logits, params, get_profile("llama.cpp"), keys, claimed=expect)
    assert torch.equal(out.token, expect)
    assert bool((out.margin == 0).all()) and bool((out.ipt_distance == 0).all())
    wrong = expect.clone()
    wrong[0] = out.token[0] + 1 if top_k < 0 and top_p == 1 else int(logits[0].argmin())
    bad = replay(logits, params, get_profile("llama.cpp"), keys, claimed=wrong)
    assert bad.margin[0] > 0 and bad.gumbel_rank[0] > 0


def test_llama_cpp_problems_and_score_column():
    from verinfer.scoring.token_difr import SCORE_COLUMNS, score_block
    from verinfer.trace import Trace

    p = SamplingParams(profile="llama.cpp", seed=5, top_k=40, top_p=0.95)
    assert params_problems(p) == []
    assert any("temperature" in m for m in params_problems(p.with_(temperature=0.8)))
    assert any("uint32" in m for m in params_problems(p.with_(seed=2**32 - 1)))
    assert "ipt_distance" in SCORE_COLUMNS
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 2
    keys = _keys(2, [5, 5], steps=[0, 1], params=[p, p])
    tokens = replay(logits[:2], [p, p], get_profile("llama.cpp"), keys).token.tolist()
    traces = [Trace("a", "m", [1, 2], tokens, p), Trace("b", "m", [1, 2], [7, 8], SamplingParams(profile="vllm", seed=3))]
    cols = score_block(logits, np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1]), traces, {})
    assert list(cols["ipt_distance"][:2]) == [0.0, 0.0] and np.isnan(cols["ipt_distance"][2:]).all()


def test_llama_cpp_replays_the_engines_own_logits():
    """Rows logged from real llama-cpp-python 0.3.36 (its logits and sampled token): exact replay.

    Top-k 50 / top-p 0.95 rows keep their 64 largest logits (the rest cannot be kept); unfiltered
    rows are whole (the CDF runs over the full vocabulary in id order).
    """
    data = np.load(FIXTURES / "llama_cpp" / "engine_logits.npz")
    vocab = 49152
    kinds = data["kind"].tolist()
    rows, params = [], []
    it, jf = 0, 0
    for kind, seed in zip(kinds, data["seed"].tolist()):
        if kind == "topk":
            row = torch.full((vocab,), float("-inf"))
            row[torch.from_numpy(data["top_ids"][it].astype(np.int64))] = torch.from_numpy(data["top_vals"][it])
            params.append(SamplingParams(profile="llama.cpp", top_k=50, top_p=0.95, seed=int(seed)))
            it += 1
        else:
            row = torch.from_numpy(data["full"][jf])
            params.append(SamplingParams(profile="llama.cpp", seed=int(seed)))
            jf += 1
        rows.append(row)
    n = len(rows)
    keys = _keys(n, data["seed"].tolist(), steps=data["step"].tolist(), params=params)
    claimed = torch.from_numpy(data["token"].astype(np.int64))
    out = replay(torch.stack(rows), params, get_profile("llama.cpp"), keys, claimed=claimed)
    assert n > 150 and kinds.count("full") >= 4
    assert torch.equal(out.token, claimed) and bool((out.ipt_distance == 0).all())
    shifted = _keys(n, data["seed"].tolist(), steps=(data["step"] + 1).tolist(), params=params)  # off by one draw
    assert (replay(torch.stack(rows), params, get_profile("llama.cpp"), shifted).token != claimed).sum() > 10


def test_llama_cpp_engine_traces_against_the_fp32_reference(backend, tmp_path):
    """Real llama.cpp outputs (Q4_1 weights, quantized activations) scored on verinfer's fp32 model:
    the right seed sits far closer to the replayed CDF than a wrong one (the IPT score separates)."""
    from dataclasses import replace

    import pyarrow.parquet as pq

    from verinfer.api import verify

    traces = _read(FIXTURES / "llama_cpp" / "generate_t24.jsonl")
    wrong = [replace(t, id=t.id + "-wrong-seed", sampling=t.sampling.with_(seed=t.sampling.seed + 1000))
             for t in traces if t.sampling.profile == "llama.cpp"]
    verify(traces + wrong, backend=backend, scores=tmp_path / "s.parquet")
    cols = {k: np.asarray(v) for k, v in pq.read_table(tmp_path / "s.parquet").to_pydict().items()}
    ids = cols["trace_id"]
    greedy = np.array(["greedy" in i for i in ids])
    bad = np.array([i.endswith("-wrong-seed") for i in ids])
    seeded = ~greedy & ~bad
    assert cols["exact_match"][greedy].mean() > 0.9
    assert np.isnan(cols["ipt_distance"][greedy]).all() and not np.isnan(cols["ipt_distance"][seeded]).any()
    assert np.mean(cols["ipt_distance"][seeded]) * 5 < np.mean(cols["ipt_distance"][bad])
    assert cols["exact_match"][seeded].mean() > cols["exact_match"][bad].mean() + 0.2


def test_vllm_v1_cuda_profile_end_to_end(backend):
    """Generated by the simulator with the CUDA stream computed on the CPU, verified through the public
    API: every token exact; claimed as the CPU stream, the same tokens diverge."""
    from verinfer import api

    traces = api.generate("chitchat", n=3, profile="vllm-v1-cuda", temperature=1.0, top_k=0, top_p=1.0, seed=7,
                          max_tokens=12, backend=backend)
    assert {t.sampling.profile for t in traces} == {"vllm-v1-cuda"}
    assert api.verify(traces, backend=backend).summary.exact_match_rate == 1.0
    for t in traces:
        t.sampling = t.sampling.with_(profile="vllm-v1")
    assert api.verify(traces, backend=backend).summary.exact_match_rate < 0.9
