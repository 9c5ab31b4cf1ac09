"""Monte Carlo verification (DiFR appendix B.1): score a claimed token by simulating the sampler.

For a sampler the verifier can run but not invert, the probability of the claimed token is
estimated by running the sampler ``N`` times on the verifier's logits, each time perturbed by the
honest noise model (logit perturbations fitted on honest data, :func:`fit_noise`), and counting how
often it emits the claim. The per-token score is ``-log P_hat`` with add-one smoothing,

    P_hat = (c + 1) / (N + 1),   c = number of the N draws that emit the claimed token,

so a claim never drawn scores ``log(N + 1)`` (the floor of P_hat is ``1 / (N + 1)``; the estimate
cannot resolve probabilities much below ``1 / N``). ``mc_excess`` subtracts the score the sampler's
own draws would get from the same simulation (the plug-in entropy of the draws, their leave-one-out
smoothed surprise), so an honest token scores about 0 on average whatever the row's entropy.

The sampler is a black box: a callable ``sampler(rows, generator) -> slots`` taking a tuple of
perturbed logit tensors ``[R, N, W]`` (R rows, N draws, W candidate tokens; e.g. the target's and the
draft's) and returning the emitted index ``[R, N]`` into W; it draws its own randomness (fresh
Gumbels and uniforms) from ``generator``. Instances: :func:`temperature_sampler` (plain Gumbel-max
sampling, whose probability is known, the sanity case) and :func:`speculative_sampler` (one
draft-and-verify step of the standard rejection sampler, the rule of ``sampling/speculative.py``,
with fresh noise instead of the provider's seeded noise). Without the seed, the simulation can only
judge *which* token was emitted, not whether the provider's randomness produced it; an honest
rejection sampler emits exactly the target's distribution, so for it the score estimates the
(noise-averaged) target probability of the claim whatever the draft model is.

Vocabulary reduction (:func:`candidate_rows`): simulating all V tokens per draw is too slow, so each
row keeps the union of the target's and the draft's top ``top`` tokens and the claim (these get the
noise; the paper also perturbs only the top logits), and the remaining tokens of each model become
one "tail" candidate whose tempered logit is the log-sum-exp of theirs. Gumbel-max sampling over the
buckets gives every kept token exactly its probability, and a rejection sampler run on the bucketed
target and draft emits the bucketed target distribution, so the reduction is exact for both
instances when the noise is off (the tail is not perturbed).

Pure functions over tensors; no model, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np
import torch

Sampler = Callable[[tuple[torch.Tensor, ...], torch.Generator], torch.Tensor]
FAMILIES = ("gaussian", "laplace", "student-t")


# ----------------------------------------------------------------------------------------- noise model
@dataclass(frozen=True)
class NoiseModel:
    """I.i.d. additive logit noise of one family: ``scale`` is the std (gaussian), the diversity b
    (laplace) or the scale of a Student t with ``df`` degrees of freedom; raw-logit units."""

    family: str = "gaussian"
    scale: float = 0.0
    df: float | None = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown noise family {self.family!r}; known: {', '.join(FAMILIES)}")
        if not (self.scale >= 0 and math.isfinite(self.scale)):
            raise ValueError(f"noise scale must be finite and >= 0, got {self.scale}")
        if self.family == "student-t" and not (self.df and self.df > 0):
            raise ValueError(f"student-t noise needs df > 0, got {self.df}")

    @property
    def std(self) -> float:
        """Standard deviation of one perturbation (inf for a t with df <= 2)."""
        if self.family == "gaussian":
            return self.scale
        if self.family == "laplace":
            return self.scale * math.sqrt(2.0)
        return self.scale * math.sqrt(self.df / (self.df - 2)) if self.df > 2 else math.inf

    def sample(self, shape: Sequence[int], generator: torch.Generator, dtype=torch.float32) -> torch.Tensor:
        if self.scale == 0:
            return torch.zeros(shape, dtype=dtype)
        if self.family == "gaussian":
            return torch.randn(shape, generator=generator, dtype=dtype) * self.scale
        u = torch.rand(shape, generator=generator, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
        if self.family == "laplace":
            x = -torch.sign(u - 0.5) * torch.log1p(-2 * (u - 0.5).abs())
        else:  # Student t by inverse CDF (scipy is exact; the draws stay reproducible from the generator)
            from scipy import stats

            x = torch.from_numpy(stats.t.ppf(u.numpy(), self.df))
        return (x * self.scale).to(dtype)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict) -> "NoiseModel":
        return cls(d.get("family", "gaussian"), float(d["scale"]), None if d.get("df") is None else float(d["df"]))


@dataclass(frozen=True)
class NoiseFit:
    """The chosen model and every family's fit: ``{family: {params, loglik, aic}}`` on the data."""

    model: NoiseModel
    fits: dict
    n: int

    def to_dict(self) -> dict:
        return {"model": self.model.to_dict(), "n": self.n, "fits": self.fits}


def logit_differences(reference: torch.Tensor, other: torch.Tensor, top: int) -> np.ndarray:
    """Per-token logit differences ``other - reference`` on each row's top ``top`` reference tokens
    (the tokens the Monte Carlo perturbs), centred per row: softmax ignores a common shift, so only
    the spread within a row is noise that can change a sampled token. ``reference``/``other``:
    [R, V] logits of the same positions (e.g. a bf16 provider and the fp32 verifier)."""
    if reference.shape != other.shape or reference.ndim != 2:
        raise ValueError(f"need two [rows, vocab] logit tensors of one shape, got {tuple(reference.shape)} "
                         f"and {tuple(other.shape)}")
    idx = reference.float().topk(min(top, reference.shape[1]), dim=-1).indices
    d = (other.double().gather(1, idx) - reference.double().gather(1, idx))
    return (d - d.mean(dim=1, keepdim=True)).numpy().ravel()


def fit_noise(diffs: np.ndarray, families: Sequence[str] = FAMILIES, max_points: int = 200_000,
              seed: int = 0) -> NoiseFit:
    """Maximum-likelihood fit of zero-mean noise families to logit differences; the family with
    the lowest AIC is chosen (scipy.stats: ``norm``, ``laplace``, ``t``, location fixed at 0).
    At most ``max_points`` differences (a seeded subsample) are used."""
    from scipy import stats

    x = np.asarray(diffs, dtype=np.float64).ravel()
    x = x[np.isfinite(x)]
    if x.size < 10:
        raise ValueError(f"need at least 10 finite logit differences to fit a noise model, got {x.size}")
    if x.size > max_points:
        x = np.random.default_rng(seed).choice(x, max_points, replace=False)
    fits, models = {}, {}
    for fam in families:
        if fam == "gaussian":
            _, s = stats.norm.fit(x, floc=0)
            ll, k, model = stats.norm.logpdf(x, 0, s).sum(), 1, NoiseModel("gaussian", float(s))
        elif fam == "laplace":
            _, b = stats.laplace.fit(x, floc=0)
            ll, k, model = stats.laplace.logpdf(x, 0, b).sum(), 1, NoiseModel("laplace", float(b))
        elif fam == "student-t":
            df, _, s = stats.t.fit(x, floc=0)
            ll, k, model = stats.t.logpdf(x, df, 0, s).sum(), 2, NoiseModel("student-t", float(s), float(df))
        else:
            raise ValueError(f"unknown noise family {fam!r}; known: {', '.join(FAMILIES)}")
        fits[fam] = {**model.to_dict(), "std": model.std, "loglik": float(ll), "aic": float(2 * k - 2 * ll)}
        models[fam] = model
    best = min(fits, key=lambda f: fits[f]["aic"])
    return NoiseFit(models[best], fits, int(x.size))


# ------------------------------------------------------------------------------------------- samplers
def _gumbel(shape, generator: torch.Generator) -> torch.Tensor:
    u = torch.rand(shape, generator=generator, dtype=torch.float32).clamp_(min=torch.finfo(torch.float32).tiny)
    return -torch.log(-torch.log(u))


def temperature_sampler(temperature: float) -> Sampler:
    """Plain sampling at ``temperature`` (Gumbel-max over ``logits / T``) from ``rows[0]``."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")

    def sample(rows: tuple[torch.Tensor, ...], generator: torch.Generator) -> torch.Tensor:
        x = rows[0] / temperature
        return (x + _gumbel(x.shape, generator)).argmax(dim=-1)

    return sample


def speculative_sampler(temperature: float) -> Sampler:
    """One draft-and-verify step of the standard rejection sampler (vLLM's rule,
    ``sampling/speculative.py``), with fresh randomness: the draft proposes ``d`` by Gumbel-max over
    ``draft / T``; the target accepts it iff ``log p(d) > log u + log q(d)`` (u uniform); otherwise
    the token is the Gumbel-max of the residual ``log max(p - q, 0)``. ``rows = (target, draft)``.

    Every output token of a speculative trace is such a step's first token or a bonus token (plain
    sampling from the target); both emit the target's distribution, so one rule serves every
    position and no mode metadata is needed."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")

    def sample(rows: tuple[torch.Tensor, ...], generator: torch.Generator) -> torch.Tensor:
        target, draft = rows
        p = torch.log_softmax(target / temperature, dim=-1)
        q = torch.log_softmax(draft / temperature, dim=-1)
        d = (q + _gumbel(q.shape, generator)).argmax(dim=-1, keepdim=True)
        u = torch.rand(d.shape, generator=generator, dtype=torch.float32)
        accept = p.gather(-1, d) > torch.log(u) + q.gather(-1, d)
        with torch.no_grad():
            ratio = torch.exp(q - p)
            residual = torch.where(ratio < 1, p + torch.log1p(-ratio.clamp(max=1)), torch.full_like(p, -math.inf))
        r = (residual + _gumbel(residual.shape, generator)).argmax(dim=-1, keepdim=True)
        return torch.where(accept, d, r).squeeze(-1)

    return sample


# ---------------------------------------------------------------------------------- candidate tokens
@dataclass
class Candidates:
    """Reduced rows for the simulation: per model ``[R, W]`` raw logits of the candidate tokens
    (duplicates ``-inf``) with the tail bucket last, which entries get noise, and the claim's slot."""

    rows: tuple[torch.Tensor, ...]
    perturb: torch.Tensor  # [R, W] bool
    claimed_slot: torch.Tensor  # [R] int64
    tokens: torch.Tensor  # [R, W - 1] vocabulary id of each non-tail slot


def candidate_rows(logits: Sequence[torch.Tensor], claimed: torch.Tensor, top: int,
                   temperature: float) -> Candidates:
    """Each row's candidates: the union of every model's top ``top`` tokens and the claim, plus one
    tail bucket per model (see the module docstring). ``logits``: raw ``[R, V]`` per model."""
    raws = [x.float() for x in logits]
    R, V = raws[0].shape
    claimed = claimed.long().view(-1, 1)
    k = min(top, V)
    idx = torch.cat([x.topk(k, dim=-1).indices for x in raws] + [claimed], dim=1)
    idx, _ = idx.sort(dim=1)
    dup = torch.zeros_like(idx, dtype=torch.bool)
    dup[:, 1:] = idx[:, 1:] == idx[:, :-1]
    rows = []
    for x in raws:
        vals = x.gather(1, idx).masked_fill(dup, -math.inf)
        keep_vals = (x.double().gather(1, idx) / temperature).masked_fill(dup, -math.inf)
        total = torch.logsumexp(x.double() / temperature, dim=-1)
        frac = torch.exp(torch.logsumexp(keep_vals, dim=-1) - total).clamp(max=1.0)
        tail = ((total + torch.log1p(-frac)) * temperature).float()
        rows.append(torch.cat([vals, tail[:, None]], dim=1))
    first = (idx == claimed) & ~dup
    slot = first.float().argmax(dim=1)
    perturb = torch.cat([~dup, torch.zeros(R, 1, dtype=torch.bool)], dim=1)
    return Candidates(tuple(rows), perturb, slot, idx)


# --------------------------------------------------------------------------------------- estimation
@dataclass
class Estimate:
    """Per row: draws that emitted the claim, draws in all, and the scores built from them."""

    count: np.ndarray
    n_draws: int
    nll: np.ndarray  # -log((count + 1) / (n + 1))
    excess: np.ndarray  # nll minus the draws' own mean smoothed surprise (plug-in entropy)

    @property
    def probability(self) -> np.ndarray:
        return (self.count + 1) / (self.n_draws + 1)


def simulate(sampler: Sampler, rows: Sequence[torch.Tensor], noise: Sequence[NoiseModel | None],
             perturb: torch.Tensor | None, n_draws: int, generator: torch.Generator) -> torch.Tensor:
    """``n_draws`` runs of ``sampler`` per row on independently perturbed copies of ``rows``
    (each ``[R, W]``; model i gets ``noise[i]`` on the entries ``perturb`` marks, all finite ones if
    None). Returns the emitted slots ``[R, n_draws]``."""
    if len(noise) != len(rows):
        raise ValueError(f"need one noise model per logit row tensor: {len(noise)} for {len(rows)}")
    sims = []
    for x, nm in zip(rows, noise):
        x = x.float()[:, None, :].expand(-1, n_draws, -1)
        if nm is not None and nm.scale > 0:
            eps = nm.sample(x.shape, generator)
            mask = torch.isfinite(x) if perturb is None else (perturb[:, None, :] & torch.isfinite(x))
            x = torch.where(mask, x + eps, x)
        sims.append(x)
    return sampler(tuple(sims), generator)


def estimate(sampler: Sampler, rows: Sequence[torch.Tensor], claimed_slot: torch.Tensor,
             noise: Sequence[NoiseModel | None], n_draws: int = 1023, generator: torch.Generator | None = None,
             perturb: torch.Tensor | None = None, bucket: int | None = None) -> Estimate:
    """Monte Carlo estimate of P(sampler emits ``claimed_slot``) per row, and the scores.

    ``bucket``: a slot that stands for many tokens (the tail of :func:`candidate_rows`). In the
    draws' own surprise (``excess``), a draw landing there counts as a rare token the other draws
    never hit: surprise ``log n`` (accurate when every tail token has probability well below
    ``1 / n``, as with a large vocabulary and ``top`` >= 64 at n ~ 1000; otherwise ``excess`` is
    biased upward for honest tokens, which a test pins down in that regime only)."""
    if n_draws < 1:
        raise ValueError(f"n_draws must be >= 1, got {n_draws}")
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    slots = simulate(sampler, rows, noise, perturb, n_draws, g)
    W = rows[0].shape[-1]
    counts = torch.zeros(slots.shape[0], W, dtype=torch.float64)
    counts.scatter_add_(1, slots, torch.ones_like(slots, dtype=torch.float64))
    c = counts.gather(1, claimed_slot.long().view(-1, 1)).squeeze(1).numpy()
    nll = -np.log((c + 1) / (n_draws + 1))
    # each draw judged against the other n - 1 draws with the same smoothing: (c_w - 1 + 1) / n
    share = counts / n_draws
    surprise = -torch.log(share.clamp(min=1e-300))
    if bucket is not None:
        surprise[:, bucket] = math.log(n_draws)
    own = (share * surprise).sum(dim=1).numpy()
    return Estimate(c.astype(np.int64), n_draws, nll, nll - own)


def score_rows(sampler: Sampler, logits: Sequence[torch.Tensor], claimed: torch.Tensor,
               noise: Sequence[NoiseModel | None], temperature: float, n_draws: int = 1023, top: int = 128,
               seed: int = 0, chunk: int = 16) -> dict[str, np.ndarray]:
    """Monte Carlo scores for rows of full logits: ``logits`` raw ``[R, V]`` per model (target
    first), ``claimed`` [R] token ids. Rows are simulated ``chunk`` at a time (memory ~ chunk x
    n_draws x 2 top floats per tensor); the draws are reproducible from ``seed``.

    Columns: ``mc_nll`` (-log P_hat, add-one smoothed), ``mc_excess`` (mc_nll minus the draws' own
    mean surprise), ``mc_count`` (draws emitting the claim)."""
    R = claimed.shape[0]
    if any(x.shape[0] != R for x in logits):
        raise ValueError(f"every logits tensor needs {R} rows (one per claimed token)")
    g = torch.Generator().manual_seed(int(seed))
    out = {"mc_nll": np.empty(R), "mc_excess": np.empty(R), "mc_count": np.empty(R, np.int64)}
    for lo in range(0, R, chunk):
        sl = slice(lo, min(lo + chunk, R))
        cand = candidate_rows([x[sl] for x in logits], claimed[sl], top, temperature)
        est = estimate(sampler, cand.rows, cand.claimed_slot, noise, n_draws, g, cand.perturb,
                       bucket=cand.rows[0].shape[1] - 1)
        out["mc_nll"][sl], out["mc_excess"][sl], out["mc_count"][sl] = est.nll, est.excess, est.count
    return out


__all__ = ["Candidates", "Estimate", "FAMILIES", "NoiseFit", "NoiseModel", "Sampler", "candidate_rows", "estimate",
           "fit_noise", "logit_differences", "score_rows", "simulate", "speculative_sampler",
           "temperature_sampler"]
