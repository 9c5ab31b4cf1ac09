"""The dashboard as a person sees it, in headless Chromium (Debian's ``/usr/bin/chromium``) driven by
Playwright with that executable (never a downloaded browser). A real monitor verifies honest traffic,
then a wrong-seed shard: the timeline has a point for every window, the state turns INCONSISTENT with
the change marked, one alert reaches a local receiver, a click on the flagged window's cell opens its
drill-down with divergent tokens highlighted, and a provider-controlled ``<script>`` never runs. A
missing Chromium fails the test (never a skip).

``VERINFER_SCREENSHOTS=DIR`` also keeps the screenshots there (the README's come from this test:
``VERINFER_SCREENSHOTS=docs python -m pytest tests/test_dashboard_browser.py``).
"""

from __future__ import annotations

import datetime as dt
import io
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from playwright.sync_api import sync_playwright

from tests.audit_servers import asgi_in_thread
from tests.test_dashboard import receiver
from verinfer import api
from verinfer.production import views
from verinfer.production.alerts import Alerter
from verinfer.production.dashboard import create_app
from verinfer.production.monitor import Judge, Monitor
from verinfer.production.store import open_store
from verinfer.stats.calibration import Calibrator
from verinfer.trace import Trace, write_traces

T0 = dt.datetime(2026, 3, 1, 12, 0, 0)
EVIL_ID = "wrong-<script>document.title='pwned'</script>"  # a provider-controlled trace id
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture
def page():
    """A Playwright page in Debian's headless Chromium."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "headless Chromium is needed to check the dashboard (Debian package 'chromium')"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=FLAGS, headless=True)
        yield browser.new_page(viewport={"width": 1200, "height": 1100})
        browser.close()


def dom(page, url: str) -> str:
    page.goto(url)
    return page.content()


def screenshot(page, path: Path) -> np.ndarray:
    from PIL import Image

    png = page.screenshot(path=str(path))
    keep = os.environ.get("VERINFER_SCREENSHOTS")
    if keep:
        shutil.copy(path, Path(keep) / path.name)
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)


def timed(traces: list[Trace], start: dt.datetime, step_s: float) -> list[Trace]:
    return [Trace(**{**t.__dict__, "provider": "acme",
                     "meta": {"request_time": (start + dt.timedelta(seconds=i * step_s)).isoformat() + "Z"}})
            for i, t in enumerate(traces)]


@pytest.fixture(scope="module")
def traffic(backend, tmp_path_factory):
    """Honest traces, wrong-seed traces claiming the honest seeds, and a calibration on other honest ones."""
    honest = api.generate("chitchat", n=6, max_tokens=12, seed=1000, backend=backend)
    other = api.generate("chitchat", n=4, max_tokens=12, seed=9000, backend=backend)
    wrong = [Trace(**{**t.__dict__, "id": f"wrong-{i}" if i else EVIL_ID,
                      "sampling": t.sampling.with_(seed=h.sampling.seed)}) for i, (t, h) in enumerate(zip(other, honest))]
    cal = api.generate("chitchat", n=8, max_tokens=16, seed=7000, backend=backend)
    out = tmp_path_factory.mktemp("cal") / "calibration.json"
    api.calibrate(api.verify(cal, backend=backend), batch_sizes=(1,), out=out)
    return honest, wrong, out


def test_dashboard_in_chromium_follows_a_verdict_change(backend, traffic, page, tmp_path):
    honest, wrong, calibration = traffic
    d, store = tmp_path / "traces", open_store(f"sqlite:///{tmp_path}/history.db")
    write_traces(timed(honest, T0, 30), d / "honest.parquet")  # 3 one-minute windows, 2 traces each
    monitor = Monitor(d, store, window_s=60, backend=backend, judge=Judge(Calibrator.load(calibration), str(calibration)))
    assert len(monitor.run_once().verified) == 1
    with receiver() as (hook, got, _), asgi_in_thread(create_app(store), "") as base:
        alerter = Alerter(views.read_engine(store), hook, tmp_path / "alerts.json", lambda i: f"{base}/window/{i}")
        assert alerter.poll() == []
        html = dom(page, f"{base}/?refresh=0")
        assert "verinfer: verification in production" in html
        assert len(set(re.findall(r'<circle class="pt[^"]*" data-window="(\d+)"', html))) == 3
        assert page.locator("circle.pt").count() >= 3  # rendered SVG points, as the browser laid them out
        assert re.findall(r'data-provider="acme" data-state="(\w+)"', html) == ["CONSISTENT"]
        assert 'class="change"' not in html and html.count('<rect class="band"') >= 3  # calibration bands drawn

        write_traces(timed(wrong, T0 + dt.timedelta(minutes=3), 30), d / "wrong.parquet")  # 2 more windows
        assert len(monitor.run_once().verified) == 1
        html = dom(page, f"{base}/?refresh=0")
        ids = re.findall(r'<rect class="cell cell-(\w+)" data-window="(\d+)"', html)
        assert [v for v, _ in ids] == ["CONSISTENT"] * 3 + ["INCONSISTENT"] * 2
        assert len(set(re.findall(r'<circle class="pt[^"]*" data-window="(\d+)"', html))) == 5
        assert re.findall(r'data-provider="acme" data-state="(\w+)"', html) == ["INCONSISTENT"]
        assert re.findall(r'class="change-label"[^>]*>→ (\w+)<', html) == ["INCONSISTENT"]
        shot = screenshot(page, tmp_path / "dashboard.png")
        red = ((shot[..., 0] > 180) & (shot[..., 1] < 110) & (shot[..., 2] < 100)).sum()
        green = ((shot[..., 1] > 150) & (shot[..., 0] < 120) & (shot[..., 2] < 130)).sum()
        assert red > 100 and green > 100, (red, green)  # the verdict strip and state badges are drawn

        [alert] = alerter.poll()
        assert alerter.wait_idle(60)
        alerter.close()
        assert got == [alert] and alert["verdict"] == "INCONSISTENT" and alert["previous"] == "CONSISTENT"
        flagged = int(ids[3][1])
        assert alert["link"] == f"{base}/window/{flagged}" and alert["p_value"] < 0.01

        page.locator(f'rect.cell[data-window="{flagged}"]').click()  # the drill-down, as a person opens it
        page.wait_for_url(f"**/window/{flagged}")
        drill = page.content()
        assert drill.count('class="trace-row"') == 2 and page.locator("mark.div").count() >= 3
        assert re.search(r'id="verdict">INCONSISTENT<', drill)
        assert page.title() != "pwned" and "<script" not in drill and "wrong-&lt;script&gt;" in drill  # escaped, never run
        page.set_viewport_size({"width": 1400, "height": 800})  # nothing wider than the window (it overflowed)
        assert page.evaluate("document.documentElement.scrollWidth") <= 1400
        page.set_viewport_size({"width": 1200, "height": 800})
        screenshot(page, tmp_path / "dashboard-window.png")
        calm = dom(page, f"{base}/window/{ids[0][1]}")
        assert calm.count('class="trace-row"') == 2 and page.locator("mark.div").count() == 0  # honest: none
    store.close()
