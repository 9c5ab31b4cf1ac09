"""The audit report says what it shows: prompt text beside the id, which p-value is raw and which is
Holm-adjusted, and "1 doubling look" in the singular (issue #31, item 7)."""

from __future__ import annotations

import contextlib
import html

import pytest

from verinfer.stats.verdict import doubling_looks, look_sizes


def test_looks_are_counted_in_words():
    assert [doubling_looks(n) for n in (1, 2, 5)] == ["1 doubling look", "2 doubling looks", "5 doubling looks"]
    assert len(look_sizes(1)) == 1  # a one-batch verdict has one look


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """A real greedy audit of an honest and a 4-bit provider on loopback (2 prompts, 4 tokens)."""
    import torch

    from verinfer.auditing.bands import find_bands
    from verinfer.auditing.client import Endpoint
    from verinfer.auditing.plan import AuditSpec
    from verinfer.auditing.reference import LocalReference
    from verinfer.auditing.report import write_reports
    from verinfer.auditing.run import run_audit
    from verinfer.models.backend import Backend
    from verinfer.prompts import load_prompts
    from verinfer.serve import ServeConfig, serve_in_thread

    torch.set_num_threads(1)
    backend = Backend.load("smollm2-135m")
    prompts = load_prompts("chitchat", 2, seed=3, distinct=True)
    spec = AuditSpec(mode="greedy", max_tokens=4)
    out = tmp_path_factory.mktemp("audit")
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(serve_in_thread(backend, ServeConfig(misconfig=mis, max_batch=2)))
                for name, mis in (("honest", ()), ("w4", ("w4",)))}
        result = run_audit([Endpoint(n, u, backend.model_id, None) for n, u in urls.items()], prompts, spec,
                           LocalReference(backend), out, bands=find_bands(backend.model_id, spec.signature()))
    json_path, html_path = write_reports(result, backend.tokenizer)
    return prompts, json_path.read_text(), html_path.read_text()


def test_report_shows_prompt_text_and_labels_both_p_values(report):
    prompts, doc, page = report
    for p in prompts:
        question = p.messages[-1][1]
        assert question[:60] in html.unescape(page)
    assert "raw p-value (this provider alone)" in page
    assert "Holm-adjusted p-value (over 2 providers; the one the verdict uses)" in page
    assert page.count('class="prompt-text"') == 2 * len(prompts)  # every row of both providers
    assert '"prompt_text"' in doc



def test_seedless_methods_count_one_look_in_the_singular():
    """A 2-prompt rank audit has one look: its method says "1 doubling look", as every mode's does."""
    import numpy as np

    from verinfer.auditing.rank import rank_verdict

    v = rank_verdict(np.array([0.3, 0.6]), np.array([5, 5]), 16)
    assert "(1 doubling look of prompts," in v.method and "1 doubling looks" not in v.method
