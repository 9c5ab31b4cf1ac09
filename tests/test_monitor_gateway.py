"""From the gateway to a verdict in the database: ``verinfer serve`` behind ``verinfer gateway``, seeded
chat traffic (the helpers of ``tests/test_gateway_verify.py``), and the same traffic through a
seed-rewriting proxy, recorded into one directory; the monitor judges the honest provider's window
CONSISTENT and the proxied one's INCONSISTENT, with its first flagged trace in the database."""

from __future__ import annotations

from sqlalchemy import create_engine, text

from tests.test_gateway_verify import _through_gateway, calibrator, prompts, served  # noqa: F401 - fixtures
from verinfer.production.exchange import Recording
from verinfer.production.monitor import Judge, Monitor
from verinfer.production.store import open_store


def test_gateway_shards_to_window_verdicts(backend, served, prompts, calibrator, tmp_path):  # noqa: F811
    d = tmp_path / "traffic"
    honest, _, _ = _through_gateway(served["honest"], d, prompts, recording=Recording("engine", "vllm", "smollm2-135m"))
    everything, _, _ = _through_gateway(served["seed-proxy"], d, prompts,
                                        recording=Recording("engine-behind-proxy", "vllm", "smollm2-135m"))
    proxied = [t for t in everything if t.provider == "engine-behind-proxy"]  # the directory holds both runs
    url = f"sqlite:///{tmp_path}/history.db"
    store = open_store(url)
    outcome = Monitor(d, store, backend=backend, window_s=3600,
                      judge=Judge(calibrator, "honest local traces")).run_once()
    store.close()
    assert len(outcome.verified) == 4 and not outcome.failed  # 2 shards per gateway run (4 + 3 records)
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = [r for r in conn.execute(text("SELECT provider, traces, verdict, first_flagged, note FROM windows"))]
    engine.dispose()
    by = {p: [r for r in rows if r.provider == p] for p in ("engine", "engine-behind-proxy")}
    assert {r.provider for r in rows} == set(by)  # windows of one hour: one or two per provider
    assert sum(r.traces for r in by["engine"]) == len(honest) == 7
    assert sum(r.traces for r in by["engine-behind-proxy"]) == len(proxied) == 7
    assert {r.verdict for r in by["engine"]} == {"CONSISTENT"}, [r.note for r in by["engine"]]
    flagged = [r for r in by["engine-behind-proxy"] if r.verdict == "INCONSISTENT"]
    assert flagged and all(r.first_flagged in {t.id for t in proxied} for r in flagged), [r.note for r in rows]

    # No calibration given (the README's monitor block as written): the shipped one `verify` uses for
    # this signature judges the same windows, and each window names it (issue #39 item 1: it said
    # "uncalibrated", verdict NULL).
    url = f"sqlite:///{tmp_path}/defaults.db"
    store = open_store(url)
    Monitor(d, store, backend=backend, window_s=3600, out_dir=tmp_path / "scores-again").run_once()
    store.close()
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = [r for r in conn.execute(text("SELECT provider, verdict, judged_by, note FROM windows"))]
    engine.dispose()
    assert {r.judged_by for r in rows} == {
        "calibration calibration-smollm2-135m-vllm-t1-k50-p0.95-minp0.json (shipped default)"}, [r.note for r in rows]
    assert {r.verdict for r in rows if r.provider == "engine"} == {"CONSISTENT"}, [r.note for r in rows]
    assert "INCONSISTENT" in {r.verdict for r in rows if r.provider == "engine-behind-proxy"}, [r.note for r in rows]
