"""The shipped default calibrations (issue #28 item 3): one pooled fp32 + bf16 null per sampler profile
that ``verinfer generate`` samples with, each saying what it covers, chosen by ``verify`` for traces of
its profile and generate's default sampling; honest traces judged CONSISTENT by it, a wrong seed not."""

import pytest

from verinfer import api
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.profiles import params_problems, profile_names
from verinfer.simulate.generate import placed
from verinfer.stats.calibration import Calibrator, min_batches
from verinfer.stats.shipped import DATA_DIR, calibration_filename, find_calibration, no_default

# generate's default sampling (cli/main.py generate, api.generate)
DEFAULT = dict(temperature=1.0, top_k=50, top_p=0.95, min_p=0.0)
# every profile generate accepts with a seed and its default sampling (greedy has no sampling null)
# (with the place in its batch that generate records for a transformers request)
SEEDED = [p for p in profile_names()
          if p != "greedy" and not params_problems(placed(SamplingParams(profile=p, seed=1, **DEFAULT), 1, 0, 1))]


def claim(profile: str, **changes) -> dict:
    return {"model": "smollm2-135m", "dtype": "float32",
            "sampling": [SamplingParams(profile=profile, **{**DEFAULT, **changes}).signature()]}


def test_the_seeded_profiles_are_the_engines_generate_samples_with():
    assert {"vllm", "vllm-v1", "vllm-cpu", "sglang", "llama.cpp", "transformers"} <= set(SEEDED)
    assert "greedy" not in SEEDED


@pytest.mark.parametrize("profile", SEEDED)
def test_every_profile_ships_a_pooled_calibration_that_names_its_coverage(profile):
    path = find_calibration(claim(profile))
    assert path is not None and path.parent == DATA_DIR, f"no shipped calibration for {profile}"
    assert path.name == calibration_filename("smollm2-135m", claim(profile)["sampling"][0])
    cal = Calibrator.load(path)
    assert cal.signature == claim(profile)
    cov = cal.coverage
    assert cov["precisions"] == ["bfloat16", "float32"] and cov["profiles"] == [profile]
    assert set(cov["tokens"]) == {"bfloat16", "float32"} and min(cov["tokens"].values()) > 0
    assert sum(cov["tokens"].values()) == cal.n_tokens_["margin"]
    assert "experiments/default_calibrations.py" in cov["built_by"]
    assert cal.resample is None and cal.fpr == 0.01  # disjoint batches: the order-statistic guarantee
    assert all(k >= min_batches(cal.fpr) for _, k in cal.thresholds_.values())
    n = cal.n_tokens_["margin"]  # every size of 10, 20, 50, 100 that the honest tokens fill as disjoint batches
    assert cal.batch_sizes == tuple(s for s in (10, 20, 50, 100) if s * min_batches(cal.fpr) <= n)
    assert 100 in cal.batch_sizes, f"{profile}: {n} honest tokens do not fill batches of 100"
    if profile == "vllm":  # generate's default profile: about 10,000 honest tokens per precision
        assert min(cov["tokens"].values()) >= 9_000, cov["tokens"]
    assert cal.sides is not None  # the sampler-shape null, one group per precision
    assert path.stat().st_size < 64_000  # small files


def test_only_the_claimed_settings_find_a_calibration():
    for changes in ({"temperature": 0.7}, {"top_k": 40}, {"top_p": 0.9}, {"min_p": 0.05}):
        assert find_calibration(claim("vllm", **changes)) is None
    assert find_calibration({**claim("vllm"), "dtype": "bfloat16"}) is None
    assert find_calibration({**claim("vllm"), "model": "other"}) is None
    two = claim("vllm")
    two["sampling"] += claim("sglang")["sampling"]
    assert find_calibration(two) is None


def test_no_default_says_why_and_what_to_run():
    line = no_default(claim("sglang", temperature=0.7, top_k=20))
    assert "\n" not in line and line.startswith("uncalibrated:")
    assert "sglang T=0.7 top-k 20" in line and "T=1 top-k 50 top-p 0.95 min-p 0 for" in line
    assert "verinfer generate --model smollm2-135m --profile sglang --temperature 0.7 --top-k 20" in line
    assert "--precisions fp32,bf16" in line and "--calibration cal.json" in line
    assert "--dtype float32" in no_default({**claim("vllm"), "dtype": "bfloat16"})
    assert "none ships for model 'other'" in no_default({**claim("vllm"), "model": "other"})


@pytest.fixture(scope="module")
def prompts():
    from verinfer.prompts import load_prompts

    return load_prompts("chitchat", 8, seed=2812)


def check_transformers_places(traces: list, backend, tmp_path) -> None:
    """generate records each transformers request's place in its batch (``sampling.stream``: the
    generate call's rows, its row, the logits' width), the place survives a trace file, and it matters:
    the same traces claiming the next row of their batch are not replayed (the caller checked that
    the recorded places replay every token)."""
    from verinfer.trace import read_traces, write_traces

    write_traces(traces, tmp_path / "hf.jsonl")
    back = read_traces(tmp_path / "hf.jsonl")
    places = [(t.sampling.stream["batch_size"], t.sampling.stream["row"]) for t in back]
    assert all(b in (16, 8) and 0 <= r < b for b, r in places) and len({r for _, r in places}) > 1, places
    assert {t.sampling.stream["vocab"] for t in back} == {backend.vocab_size}
    moved = back[:3]
    for t in moved:  # each claims the next row of its batch: another row of the generator's draws
        s = t.sampling.stream
        t.sampling = t.sampling.with_(stream={**s, "row": (s["row"] + 1) % s["batch_size"]})
    summary = api.verify(moved, backend=backend, default_calibration=False).summary
    assert summary.tokens >= 30 and summary.exact_match_rate < 0.9, summary.exact_match_rate


def test_honest_traces_of_every_profile_are_consistent_under_its_default_and_a_wrong_seed_is_not(backend, prompts,
                                                                                                 tmp_path):
    # One generate call for every profile's requests (8 prompts each, 56 in batches of 16 by prompt length:
    # each decode step serves all profiles at once), then each profile's traces judged as verify judges them.
    from verinfer.simulate.generate import build_requests, generate

    requests = [r for p in SEEDED for r in build_requests(
        backend, prompts, SamplingParams(profile=p, seed=52_000, **DEFAULT), id_prefix=f"{p}/")]
    made = generate(backend, requests, max_new_tokens=24, batch_size=16)
    for profile in SEEDED:
        traces = [t for t in made if t.id.startswith(f"{profile}/")]
        honest = api.verify(traces, backend=backend).summary
        name = calibration_filename("smollm2-135m", claim(profile)["sampling"][0])
        assert honest.calibration == f"{name} (shipped default)", profile
        assert honest.tokens > 100 and honest.verdict is not None, (profile, honest.note)  # batches that can reject
        assert honest.exact_match_rate == 1.0, profile  # fp32 generate -> verify replays every token
        assert honest.consistent is True, (profile, honest.verdict.text)
        if profile == "transformers":
            check_transformers_places(traces, backend, tmp_path)
        for t in traces:  # each request claims the seed of another one
            t.sampling = t.sampling.with_(seed=t.sampling.seed + 1)
        wrong = api.verify(traces, backend=backend).summary
        assert wrong.calibration == honest.calibration and wrong.consistent is False, (profile, wrong.verdict.text)


def test_honest_bf16_traces_are_consistent_under_the_default(backend, prompts):
    traces = api.generate(prompts, n=len(prompts), dtype="bfloat16", seed=53_000, max_tokens=50, batch_size=8)
    summary = api.verify(traces, backend=backend).summary
    assert summary.calibration.endswith("(shipped default)") and summary.consistent is True, summary.verdict


def test_verify_says_in_one_line_when_no_shipped_calibration_fits(backend, prompts):
    # api.generate takes the transformers profile (it records each request's place in its batch)
    traces = api.generate(prompts[:2], n=2, profile="transformers", temperature=0.7, seed=54_000, max_tokens=8,
                          batch_size=2, backend=backend)
    assert [t.sampling.stream["batch_size"] for t in traces] == [2, 2]
    summary = api.verify(traces, backend=backend).summary
    assert summary.verdict is None and summary.calibration is None
    assert summary.note == no_default(claim("transformers", temperature=0.7)) and "--temperature 0.7" in summary.note
    off = api.verify(traces, backend=backend, default_calibration=False).summary
    assert off.note.startswith("uncalibrated: pass a calibration file")
