"""Running a diagnosis: one prefill of the traces with the reference model, every sampler candidate
replayed block by block on its logits (``scoring/diagnosis.py``), then, when model bands are asked
for, one prefill per derived model replayed with the claimed sampler. A derived model whose prefill
does not compute what its decode computes (an fp8 KV cache: scales fitted on the prompt pass, the
current token read fresh) is replayed by its own KV-cache decode instead, fed the traces' tokens.

Each block of logits is dropped once every candidate has been replayed on it, so memory does not
grow with the tokens diagnosed; the only per-token state kept is the claim's log-likelihood (one
float per token), which the model bands are compared against.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from verinfer.chat_templates import DESCRIBED, TEMPLATES, renderable, rendered
from verinfer.files import check_outputs, write_atomic
from verinfer.models.backend import Backend
from verinfer.models.fp8_kv import Fp8KVBackend
from verinfer.sampling.profiles import Profile, get_profile
from verinfer.sampling.sampler import picks_at_offsets, replay
from verinfer.scoring.diagnosis import (
    ALPHA, CLAIM, EPS, HONEST_OFF_BOUNDARY, SIGMA, BugTally, Candidate, Diagnosis, Tally, candidate_grid,
    effective_margin, off_boundary, penalized, rank, shifted, token_loglik,
)
from verinfer.scoring.fit import (
    DROP, FIT_ROWS, MAX_FITS, SCREEN_ROWS, Family, Fit, bracket, family_of, fit_family, model_coarse, model_refined,
    near_set,
)
from verinfer.scoring.scores import signature
from verinfer.scoring.shape import Shape
from verinfer.scoring.traces import check_traces
from verinfer.scoring.token_difr import _keys
from verinfer.simulate.generate import Request, decode_batch
from verinfer.simulate.variants import get_variant, list_variants
from verinfer.trace import Trace, TraceError, read_traces

DEFAULT_BANDS = ("bf16", "w8-channel", "w4-g128", "fp8-kv")
MAX_SHIFT = 512  # the longest hidden system or prefix message searched for, in tokens
SHIFT_ROWS = 64  # rows the offset search screens every offset on
SHIFT_FINALISTS = 16  # the best screened offsets, counted again on every row of the first block


def model_side_variants() -> list[str]:
    """Catalogue variants that change only the model (usable as bands), honest ones first."""
    return [v.name for v in list_variants() if v.transform is not None and v.sampling is None and v.hook is None
            and v.prompt is None and v.spec_rule is None]


def resolve_bands(spec: str | Sequence[str] | None) -> list[str]:
    """``None``/"" (none), ``default``, ``catalogue`` or comma-separated model-side variant names."""
    if not spec:
        return []
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for name in (n.strip() for n in names):
        if name == "default":
            out += DEFAULT_BANDS
        elif name == "catalogue":
            out += model_side_variants()
        else:
            try:
                v = get_variant(name)
            except KeyError:
                raise ValueError(f"--variants: unknown model variant {name!r} (model-side variants: "
                                 f"{', '.join(model_side_variants())})") from None
            if v.transform is None or v.sampling or v.hook or v.prompt or v.spec_rule:
                raise ValueError(f"--variants: {name!r} does not change the model (model-side variants: "
                                 f"{', '.join(model_side_variants())})")
            out.append(name)
    return list(dict.fromkeys(out))


def _score(logits, items, steps, traces, profiles, sigma, eps, shift: int = 0):
    """Replay one block under one candidate (all its traces share one profile): exact matches, raw
    logit ranks of the claims, its picks, effective margins and log-likelihoods. The sampler's own
    ``replay``, without the verifier's other score columns, which a diagnosis does not read. ``shift``
    moves every row's position (the candidate's prompts that many tokens longer)."""
    name = traces[items[0]].sampling.profile
    profile = profiles.setdefault(name, get_profile(name))
    claimed = _claimed(logits, items, steps, traces)
    keys = _keys(traces, items, steps).moved(shift)
    out = replay(logits, [traces[i].sampling for i in items], profile, keys, claimed=claimed)
    margin = effective_margin(out.margin.cpu().numpy(), out.filter_distance.cpu().numpy())
    cols = {"exact_match": (out.token == claimed).cpu().numpy(), "logit_rank": out.logit_rank.cpu().numpy(),
            "pick": out.token, "depth_shift": out.depth_shift.cpu().numpy(),
            "filtered": torch.isinf(out.margin).cpu().numpy()}
    return cols, margin, token_loglik(margin, sigma, eps)


def _claimed(logits: torch.Tensor, items: np.ndarray, steps: np.ndarray, traces: Sequence[Trace]) -> torch.Tensor:
    return torch.tensor([traces[i].output_token_ids[k] for i, k in zip(items, steps)], dtype=torch.long,
                        device=logits.device)


def search_shift(logits: torch.Tensor, items: np.ndarray, steps: np.ndarray, traces: Sequence[Trace],
                 max_shift: int = MAX_SHIFT, rows: int = SHIFT_ROWS, finalists: int = SHIFT_FINALISTS) -> dict | None:
    """The prompt-length offset that best reproduces the traces' tokens, for engines whose noise is keyed by
    absolute position (``Profile.position_keyed``): a provider that put a hidden system or prefix message of
    ``d`` tokens before the claimed prompt drew every token at position + ``d``, so replaying at + ``d``
    gives back its noise, and its tokens wherever the hidden text did not change the logits past the
    margin (SGLang hashes a token's sorted rank, so a changed logit order also moves its noise: fewer).
    Screens every offset in [-(shortest prompt - 1), ``max_shift``] on ``rows`` rows of a block spread over
    it, then the ``finalists`` best and 0 on every row of the block, sampling only; returns the offset
    with the most exact rows there, the claim's count and the runner-up's (how sharply the offset is
    identified), or None when the traces' sampler is not position-keyed (or greedy)."""
    params = [traces[i].sampling for i in items]
    profile = get_profile(params[0].profile)
    if not profile.position_keyed or any(p.is_greedy or p.seed is None for p in params):
        return None

    def exact_rows(offsets: list[int], pick: np.ndarray) -> tuple[list[int], int]:
        whole = len(pick) == len(items)  # the block itself, not a copy (512 MiB at 262k entries)
        x = logits if whole else logits[torch.as_tensor(pick, device=logits.device)]
        sub = [params[i] for i in pick.tolist()]
        claimed, keys = _claimed(x, items[pick], steps[pick], traces), _keys(traces, items[pick], steps[pick])
        picks = picks_at_offsets(x, sub, profile, keys, offsets)
        if not bool((picks[0] >= 0).any()):  # no filtered row (no top-k): each offset replayed in full
            picks = torch.stack([replay(x, sub, profile, keys.moved(d)).token
                                 for d in offsets])
        return (picks == claimed).sum(1).tolist(), int((picks[0] >= 0).sum())

    low = -min(max_shift, min(len(t.prompt_token_ids) for t in traces) - 1)
    offsets = list(range(low, max_shift + 1))
    screen = np.unique(np.linspace(0, len(items) - 1, min(rows, len(items))).round().astype(np.int64))
    first, _ = exact_rows(offsets, screen)
    ranked = [d for _, d in sorted(zip(first, offsets), key=lambda t: (-t[0], abs(t[1])))]
    final = sorted({0, *ranked[:finalists]})
    counts, used = exact_rows(final, np.arange(len(items)))
    exact = dict(zip(final, counts))
    best = max(exact, key=lambda d: (exact[d], -abs(d)))
    runner_up = max((d for d in exact if d != best), key=lambda d: exact[d], default=best)
    return {"best": best, "exact": exact[best], "claim_exact": exact[0], "runner_up": runner_up,
            "runner_up_exact": exact[runner_up], "rows": used, "screened_rows": len(screen),
            "searched": len(offsets) - 1, "range": [low, max_shift]}


def fit_families(logits: torch.Tensor, items: np.ndarray, steps: np.ndarray, traces: Sequence[Trace],
                 grid_ll: dict[Candidate, float], claim_ll: float, sigma: float,
                 eps: float) -> list[tuple[Fit, dict[str, Profile], tuple]]:
    """Fit the sampler families whose best grid candidate beats the claim on these rows (the diagnosis's
    first) by more than an interval's drop (``scoring.fit``), the ``MAX_FITS`` best of them: each fit, the
    profiles its replays used (the fitted candidate's from here on) and its replay of the rows ((cols,
    margins, log-likelihoods), the fitted candidate's tally on them). ``grid_ll``: each grid candidate's
    log-likelihood on the rows, ``claim_ll`` the claim's."""
    claim = traces[items[0]].sampling
    leaders: dict[Family, tuple[float, float]] = {}
    members: dict[Family, list[float]] = {}
    for c, ll in grid_ll.items():
        family = family_of(c)
        if family is None:
            continue
        v = family.value_of(c)
        members.setdefault(family, []).append(v)
        if family.low <= v <= family.high and ll > leaders.get(family, (None, -np.inf))[1]:
            leaders[family] = (v, ll)
    chosen = sorted((f for f, (_, ll) in leaders.items() if ll > claim_ll + DROP), key=lambda f: -leaders[f][1])
    screen = np.unique(np.linspace(0, len(items) - 1, min(SCREEN_ROWS, len(items))).round().astype(np.int64))
    out = []
    for family in chosen[:MAX_FITS]:
        profiles: dict[str, Profile] = {}
        kept: dict[float, tuple] = {}

        def loglik(values: list[float], final: bool, family: Family = family, profiles=profiles, kept=kept):
            rows = np.arange(len(items)) if final else screen
            x = logits if final else logits[torch.as_tensor(rows, device=logits.device)]
            sums = []
            for v in values:
                c = family.candidate(v)
                if family.penalty:
                    lg, tr = penalized(x, _histories(traces, items[rows], steps[rows]), *c.penalty), traces
                else:
                    lg, tr = x, _as_candidate(traces, c)
                scored = _score(lg, items[rows], steps[rows], tr, profiles, sigma, eps)
                if final:
                    kept[family.value_of(c)] = scored
                sums.append((float(scored[2].sum()), int(scored[0]["exact_match"].sum())))
            return sums

        start = leaders[family][0]
        fit = fit_family(family, start, bracket(family, claim, members[family], start), loglik)
        fit = replace(fit, rows=len(items), screened=fit.screened + len(members[family]))
        out.append((fit, profiles, kept[fit.value]))
    return out


def _first_traces(traces: Sequence[Trace], offsets: np.ndarray) -> int:
    """How many of the first traces hold ``SCREEN_ROWS`` rows (all when fewer): what a search screens on."""
    return min(int(np.searchsorted(offsets[1:], SCREEN_ROWS)) + 1, len(traces))


def _screen(members: Sequence[str], build: Callable[[str], tuple[Backend, list[Trace]]], sigma: float, eps: float,
            token_budget: int, row_block: int) -> dict[str, tuple[float, int]]:
    """Each member's log-likelihood and exact tokens, replayed with the claimed sampler: ``build(name)`` gives
    the model that computes its logits and the traces as that member served them."""
    scored: dict[str, tuple[float, int]] = {}
    for name in members:
        band, own = build(name)
        profiles, sums = {}, [0.0, 0]

        def add(items: np.ndarray, steps: np.ndarray, logits: torch.Tensor, own=own, profiles=profiles, sums=sums):
            cols, _, ll = _score(logits, items, steps, own, profiles, sigma, eps)
            sums[0], sums[1] = sums[0] + float(ll.sum()), sums[1] + int(cols["exact_match"].sum())

        band_logits(band, own, token_budget, row_block, add)
        scored[name] = (sums[0], sums[1])
    return scored


def _searched(scored: dict[str, tuple[float, int]], claim: float, n: int, offsets: np.ndarray) -> dict:
    """A search's outcome: the best member when it beats the claim by more than ``DROP``, its 95% set, and
    what was screened on how many traces and rows."""
    best, near = near_set(list(scored), *zip(*scored.values()))
    tried = scored[best][0] > claim + DROP
    return {"tried": tried, "best": best if tried else None, "near": list(near) if tried else [],
            "screened": len(scored), "traces": n, "rows": int(offsets[n]), "claim_loglik": claim,
            "loglik": {name: v[0] for name, v in scored.items()}}


def search_model(backend: Backend, traces: Sequence[Trace], claim_ll: np.ndarray, offsets: np.ndarray,
                 sigma: float, eps: float, token_budget: int, row_block: int) -> dict | None:
    """The derived model (RTN weights by bits, grouping and rounding; the first N layers; one layer removed;
    an fp8 KV cache) that best reproduces the first traces (those holding the first ``SCREEN_ROWS`` rows),
    each a prefill (an fp8 KV cache: a decode) of its own replayed with the claimed sampler (``scoring.fit``:
    a first level, then around its best when that beats the claim by more than ``DROP``): the best, its 95%
    set, and what was screened. None when the backend is no transformers model."""
    config = getattr(getattr(backend, "model", None), "config", None)
    if config is None:
        return None
    layers = int(config.get_text_config().num_hidden_layers)
    n = _first_traces(traces, offsets)
    subset, claim = list(traces[:n]), float(claim_ll[:offsets[n]].sum())

    def score(names: Sequence[str]) -> dict[str, tuple[float, int]]:
        return _screen(names, lambda name: (get_variant(name).build(backend), subset), sigma, eps, token_budget,
                       row_block)

    coarse = model_coarse(layers)
    scored = score(coarse)
    found = _searched(scored, claim, n, offsets)
    if found["tried"]:
        scored.update(score([m for m in model_refined(found["best"], coarse, layers) if m not in scored]))
        found = _searched(scored, claim, n, offsets)
    return found


def retemplated(traces: Sequence[Trace], tokenizer, name: str) -> list[Trace]:
    """The traces with their messages rendered by chat template ``name`` as the prompts (``chat_templates``)."""
    return [replace(t, prompt_token_ids=rendered(tokenizer, t.messages, name)) for t in traces]


def search_template(backend: Backend, traces: Sequence[Trace], claim_ll: np.ndarray, offsets: np.ndarray,
                    sigma: float, eps: float, token_budget: int, row_block: int) -> dict | None:
    """The chat template (``chat_templates.TEMPLATES``) whose rendering of the messages best reproduces the
    first traces (those holding the first ``SCREEN_ROWS`` rows), each a prefill of the reference on those
    prompts replayed with the claimed sampler at their positions: the best, when it beats the claim by more
    than ``DROP``, its 95% set, and what was screened. None when a trace records no text messages to render."""
    if not all(renderable(t.messages) for t in traces):
        return None
    n = _first_traces(traces, offsets)
    subset, claim = list(traces[:n]), float(claim_ll[:offsets[n]].sum())
    own: dict[str, list[Trace]] = {}
    for name in TEMPLATES:
        try:
            served = retemplated(subset, backend.tokenizer, name)
        except ValueError:  # a template the tokenizer cannot render (no chat template of its own)
            continue
        if any(s.prompt_token_ids != t.prompt_token_ids for s, t in zip(served, subset)):
            own[name] = served
    if not own:
        return None
    return _searched(_screen(list(own), lambda name: (backend, own[name]), sigma, eps, token_budget, row_block),
                     claim, n, offsets)


def _as_candidate(traces: Sequence[Trace], c: Candidate) -> list[Trace]:
    """The traces as candidate ``c`` would have sampled them (its parameters in place of the claim's)."""
    return [replace(t, sampling=p) for t, p in zip(traces, c.params([t.sampling for t in traces]))]


def _histories(traces: Sequence[Trace], items: np.ndarray, steps: np.ndarray) -> list[tuple[list[int], list[int]]]:
    """Each row's (prompt ids, output ids before it): what a penalty sees (``diagnosis.penalized``)."""
    return [(traces[i].prompt_token_ids, traces[i].output_token_ids[:k]) for i, k in zip(items, steps)]


def _forget(traces: Sequence[Trace], items: np.ndarray, steps: np.ndarray,
            profile_sets: Sequence[dict[str, Profile]]) -> None:
    """Release per-request sampler state of traces whose last row was in the block."""
    last = steps == np.array([len(traces[i].output_token_ids) - 1 for i in items])
    for i in np.unique(items[last]):
        for profiles in profile_sets:
            for p in profiles.values():
                p.forget(traces[i].id)


class _Forced:
    """A decode's token hook that feeds each row its trace's token and hands each step's logits on
    (``on_block(items, steps, logits)``): the provider's own decode loop, teacher-forced."""

    def __init__(self, traces: Sequence[Trace], on_block: Callable[[np.ndarray, np.ndarray, torch.Tensor], None]):
        self.index = {t.id: i for i, t in enumerate(traces)}
        self.traces, self.on_block = traces, on_block

    def __call__(self, logits, tokens, requests, step):
        items = np.array([self.index[r.id] for r in requests])
        live = np.array([step < len(self.traces[i].output_token_ids) for i in items])
        if live.any():
            self.on_block(items[live], np.full(int(live.sum()), step), logits[torch.as_tensor(live)])
        return torch.tensor([self.traces[i].output_token_ids[step] if ok else t
                             for i, ok, t in zip(items, live, tokens.tolist())], dtype=torch.long)


def decode_replay(band: Backend, traces: Sequence[Trace], on_block) -> None:
    """The logits ``band``'s KV-cache decode computes for the traces' tokens, step by step, as one
    left-padded batch of every trace (``simulate.generate.decode_batch``, the provider simulator's
    loop): for models whose prefill is not their decode (``Fp8KVBackend``). A provider that batched
    the requests otherwise fitted its per-batch fp8 scales (``tensor``, ``head``) on other rows."""
    order = sorted(range(len(traces)), key=lambda i: len(traces[i].prompt_token_ids))  # as generate() batches
    batch = [Request(traces[i].id, tuple(traces[i].prompt_token_ids), traces[i].sampling) for i in order]
    longest = max(len(t.output_token_ids) for t in traces)
    decode_batch(band, batch, longest, band.stop_ids(), {}, token_hook=_Forced(traces, on_block))


def band_logits(band: Backend, traces: Sequence[Trace], token_budget: int, row_block: int,
                on_block: Callable[[np.ndarray, np.ndarray, torch.Tensor], None]) -> None:
    """Hand ``on_block(items, steps, logits)`` the logits a derived model computes for the traces' tokens: its
    prefill, or, for a model whose prefill is not its decode (``Fp8KVBackend``), its decode (``decode_replay``)."""
    if isinstance(band, Fp8KVBackend):
        return decode_replay(band, traces, on_block)
    sequences = [t.prompt_token_ids + t.output_token_ids for t in traces]
    starts = [len(t.prompt_token_ids) for t in traces]
    for block in band.prefill(sequences, starts, token_budget=token_budget, row_block=row_block, on_device=True):
        on_block(block.items.numpy(), block.steps.numpy(), block.logits)


def diagnose_traces(backend: Backend, traces: Sequence[Trace], candidates: Sequence[Candidate],
                    sigma: float = SIGMA, eps: float = EPS, alpha: float = ALPHA,
                    honest_rate: float = HONEST_OFF_BOUNDARY, token_budget: int = 4096, row_block: int = 512,
                    on_rows: Callable[[int], None] | None = None, search_prompt: bool = True,
                    fit_sampler: bool = True, search_models: bool = True, flagged: bool = False,
                    search_templates: bool = True) -> Diagnosis:
    """Tally every candidate over the traces and rank them (``diagnosis.rank``).

    Sampler candidates share the reference prefill; each ``band`` candidate costs a prefill of the
    catalogue variant's model derived from ``backend`` (``simulate.variants``), replayed with the
    claimed sampler. With ``search_prompt``, the prompt-length offset that best reproduces the first
    block's tokens (``search_shift``) joins the candidates when it beats the claim there. With
    ``fit_sampler``, each sampler family whose grid value beats the claim on the first ``FIT_ROWS`` rows
    (the first blocks) is fitted there (``fit_families``), and its fitted value, with an interval,
    replaces its grid values. With ``search_templates``, when no candidate explains the tokens (a prompt
    offset leaves the other text's tokens unexplained), or when they are ``flagged`` (by the calibrated
    verdict) and no candidate beats the claim nor a band explains them, the chat template whose rendering
    of the messages best reproduces the first traces (``search_template``) joins the candidates, replayed
    over every trace. With ``search_models``, when still nothing explains the tokens (nor a prompt offset,
    nor a band), or they are flagged and nothing beats the claim, the derived model that best reproduces
    the first traces (``search_model``) joins them, replayed over every trace like a band.
    """
    traces = list(traces)
    claimed = [t.sampling for t in traces]
    sampler = [c for c in candidates if c.band is None and c.replays and c != CLAIM]
    bugs = [c for c in candidates if not c.replays]
    bands = [c for c in candidates if c.band is not None]
    as_traces = {c: _as_candidate(traces, c) for c in sampler if not c.penalty}
    tallies = {c: BugTally() if c.bug else Tally() for c in [CLAIM, *candidates]}
    profile_sets: dict[Candidate, dict[str, Profile]] = {c: {} for c in [CLAIM, *sampler, *bands]}
    offsets = np.concatenate([[0], np.cumsum([len(t.output_token_ids) for t in traces])])
    claim_ll = np.zeros(int(offsets[-1]))  # the claim's log-likelihood per token, which later replays beat or not
    sequences = [t.prompt_token_ids + t.output_token_ids for t in traces]
    starts = [len(t.prompt_token_ids) for t in traces]

    search: dict | None = None
    fits: list[Fit] = []
    shape = Shape()
    fitting, pending = fit_sampler, []

    def fit_on(rows: list[tuple[np.ndarray, np.ndarray, torch.Tensor, np.ndarray]]) -> None:
        """Fit the families on these rows (``fit_families``); each fitted value replaces its grid values."""
        items, steps = np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows])
        logits = rows[0][2] if len(rows) == 1 else torch.cat([r[2] for r in rows])
        ll0 = np.concatenate([r[3] for r in rows])
        grid_ll = {c: tallies[c].loglik for c in sampler if c.axis != "prompt"}
        for fit, profiles, (cc, m, ll) in fit_families(logits, items, steps, traces, grid_ll, tallies[CLAIM].loglik,
                                                       sigma, eps):
            fits.append(fit)
            for c in [c for c in sampler if fit.family.value_of(c) is not None]:
                sampler.remove(c), tallies.pop(c), profile_sets.pop(c), as_traces.pop(c, None)
            c = fit.candidate
            if fit.is_claim(claimed[0]):
                continue
            sampler.append(c), tallies.setdefault(c, Tally()).add(cc["exact_match"], m, ll, ll0, eps)
            profile_sets[c] = profiles
            if not c.penalty:
                as_traces[c] = _as_candidate(traces, c)

    for block in backend.prefill(sequences, starts, token_budget=token_budget, row_block=row_block, on_device=True):
        items, steps = block.items.numpy(), block.steps.numpy()
        if search_prompt:
            search_prompt, search = False, search_shift(block.logits, items, steps, traces)
            if search is not None and search.setdefault("tried", search["exact"] > search["claim_exact"]):
                c = shifted(search["best"])
                sampler.append(c), profile_sets.setdefault(c, {})
                as_traces[c], tallies[c] = traces, Tally()
        cols, m0, ll0 = _score(block.logits, items, steps, traces, profile_sets[CLAIM], sigma, eps)
        tallies[CLAIM].add(cols["exact_match"], m0, ll0, ll0, eps)
        shape.add(cols["exact_match"], ll0, cols["depth_shift"], cols["filtered"], float(np.log(eps)))
        claim_ll[offsets[items] + steps] = ll0
        if bugs:
            only_bug = off_boundary(ll0, (cols["pick"] == block.logits.argmax(-1)).cpu().numpy(), eps)
        for c in bugs:
            tallies[c].add_bug(c.bug, cols["exact_match"], m0, ll0, cols["logit_rank"], only_bug, eps)
        history = _histories(traces, items, steps) if any(c.penalty for c in sampler) else []
        for c in sampler:
            if c.penalty:
                logits, cand_traces = penalized(block.logits, history, *c.penalty), traces
            else:
                logits, cand_traces = block.logits, as_traces[c]
            cc, m, ll = _score(logits, items, steps, cand_traces, profile_sets[c], sigma, eps, c.shift or 0)
            tallies[c].add(cc["exact_match"], m, ll, ll0, eps)
        if fitting:  # the first FIT_ROWS rows (blocks kept until then; a copy only when a block is smaller)
            pending.append((items, steps, block.logits if len(items) >= FIT_ROWS else block.logits.clone(), ll0))
            if sum(len(p[0]) for p in pending) >= FIT_ROWS:
                fitting = False
                fit_on(pending)
                pending.clear()
        _forget(traces, items, steps, list(profile_sets.values()))
        if on_rows:
            on_rows(len(items))

    if fitting and pending:  # fewer rows than FIT_ROWS in all
        fit_on(pending)
        pending.clear()

    def replay_band(c: Candidate, own: Sequence[Trace] | None = None) -> None:
        """Candidate ``c``'s model (the reference for a template: ``own``, the traces as it rendered them)
        over every trace."""
        band, own = (backend, own) if own is not None else (get_variant(c.band).build(backend), traces)

        def score_band(items: np.ndarray, steps: np.ndarray, logits: torch.Tensor) -> None:
            cols, m, ll = _score(logits, items, steps, own, profile_sets[c], sigma, eps)
            tallies[c].add(cols["exact_match"], m, ll, claim_ll[offsets[items] + steps], eps)
            _forget(traces, items, steps, [profile_sets[c]])
            if on_rows:
                on_rows(len(items))

        band_logits(band, own, token_budget, row_block, score_band)

    for c in bands:
        replay_band(c)
    found = template = None
    def unanswered(d: Diagnosis) -> bool:
        """Flagged by the verdict, yet no candidate beats the claim and no band given explains the tokens."""
        return flagged and not d.claim_rejected and not any(r.explains for r in d.ranked if r.candidate.band)

    so_far = rank(dict(tallies), alpha, {}, honest_rate)
    if search_templates and (not any(r.explains for r in so_far.ranked) or unanswered(so_far)):
        template = search_template(backend, traces, claim_ll, offsets, sigma, eps, token_budget, row_block)
        if template and template["tried"]:  # the messages rendered otherwise reproduce the tokens
            c = Candidate(f"prompts rendered by {DESCRIBED[template['best']]}", "prompt", template=template["best"],
                          near=tuple(template["near"]))
            tallies[c], profile_sets[c] = Tally(), {}
            replay_band(c, retemplated(traces, backend.tokenizer, c.template))
            so_far = rank(dict(tallies), alpha, {}, honest_rate)
    if search_models and (not so_far.explained or unanswered(so_far)):
        found = search_model(backend, traces, claim_ll, offsets, sigma, eps, token_budget, row_block)
        if found and found["tried"]:  # a deviation no candidate explains: which derived model does
            c = Candidate(f"model {found['best']}", "model", band=found["best"], near=tuple(found["near"]))
            for given in [b for b in bands if b.band == c.band]:
                bands.remove(given), tallies.pop(given)
            bands.append(c)
            tallies[c], profile_sets[c] = Tally(), {}
            replay_band(c)
    screened = ((search["searched"] - 1 if search and search["tried"] else 0) + sum(f.screened - 1 for f in fits)
                + sum(s["screened"] - 1 for s in (found, template) if s and s["tried"]))
    settings = {"sigma": sigma, "eps": eps, "honest_off_boundary": honest_rate, "traces": len(traces),
                "tokens": int(offsets[-1]), "bands": [c.band for c in bands], "prompt_shift": search,
                "fits": [f.to_dict() for f in fits], "model_search": found, "template_search": template,
                "screened": screened}
    result = rank(tallies, alpha, settings, honest_rate, screened)
    result.shape = shape
    return result


def prepare(traces: str | Path | Sequence[Trace], out: str | Path | None = None, sigma: float | None = None,
            alpha: float | None = None, bands: str | Sequence[str] | None = None):
    """Everything checked before a model loads: (traces, their source name, sigma, alpha, band names)."""
    source = str(traces) if isinstance(traces, (str, Path)) else "traces"
    check_outputs([out], [traces if isinstance(traces, (str, Path)) else None])
    sigma, alpha = SIGMA if sigma is None else sigma, ALPHA if alpha is None else alpha
    if not sigma > 0:
        raise ValueError(f"--sigma must be > 0, got {sigma}")
    if not 0 < alpha < 1:
        raise ValueError(f"--alpha must be in (0, 1), got {alpha}")
    band_names = resolve_bands(bands)
    trace_list = read_traces(traces) if isinstance(traces, (str, Path)) else list(traces)
    if not trace_list:
        raise TraceError(f"{source}: no traces to diagnose")
    for n, t in enumerate(trace_list, 1):
        if t.sampling.speculative:
            raise TraceError(f"{source}: record {n} (id {t.id!r}): diagnose does not replay speculative decoding")
    return trace_list, source, sigma, alpha, band_names


def reference_model(trace_list: Sequence[Trace], model: str | None, source: str) -> str:
    """The model to replay with: ``model``, else the one model the traces claim."""
    claimed = sorted({t.model for t in trace_list})
    if model is None and len(claimed) > 1:
        raise ValueError(f"{source}: traces claim several models ({', '.join(claimed)}); "
                         "pass --model (Python: model=)")
    return model or claimed[0]


def diagnose(trace_list: Sequence[Trace], backend: Backend, source: str = "traces", bands: Sequence[str] = (),
             sigma: float = SIGMA, alpha: float = ALPHA, out: str | Path | None = None, skip_invalid: bool = False,
             allow_model_mismatch: bool = False, on_rows: Callable[[int], None] | None = None,
             search_models: bool = True, flagged: bool = False) -> Diagnosis:
    """Check the traces against the reference, diagnose them over the whole candidate grid and
    write the diagnosis as JSON to ``out`` (atomically) when given. Traces claiming several
    sampling settings are refused: a diagnosis names one configuration."""
    kept, skipped = check_traces(trace_list, backend, source, skip_invalid, allow_model_mismatch)
    sampling = signature(kept, backend.model_id, backend.dtype_name)["sampling"]
    if len(sampling) > 1:
        raise ValueError(f"{source}: traces claim {len(sampling)} sampling settings; diagnose one at a time "
                         f"(first two: {sampling[0]}, {sampling[1]})")
    result = diagnose_traces(backend, kept, candidate_grid(kept[0].sampling, bands), sigma=sigma, alpha=alpha,
                             on_rows=on_rows, search_models=search_models, flagged=flagged)
    result.settings.update({"model": backend.model_id, "dtype": backend.dtype_name, "claimed": sampling[0],
                            "source": source, "skipped": skipped})
    if out is not None:
        write_atomic(out, json.dumps(result.to_dict(), indent=2) + "\n")
    return result
