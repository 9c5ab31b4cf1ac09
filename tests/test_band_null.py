"""The band verdict's null holds the band's own sampling error (``stats.verdict.band_noise``).

A band is 48 honest sequences, a sample: its pooled statistic misses the honest population's by about
as much as a 25-sequence audit's does. A one-sample bootstrap against it takes the band for the
population and rejects honest audits more often than the FPR whenever the band came out low (issue #42:
a human-eval band 0.003 nats low). Here bands and audits are drawn from one known population many times
over, so the rejection rate of honest audits is the FPR the rule really has.
"""

import numpy as np

from verinfer.stats.evaluation import wilson_interval
from verinfer.stats.verdict import band_noise, band_p_value

ALPHA, DRAWS = 0.05, 999


def sequences(rng: np.random.Generator, n: int) -> np.ndarray:
    """Rows ``[tokens, score sum, exact]``: 32-48 tokens each, a per-sequence mean score that varies
    between sequences (prompts differ) around 0.067 with sd 0.009, as the human-eval bf16 gap does."""
    tokens = rng.integers(32, 49, size=n).astype(float)
    return np.column_stack([tokens, tokens * rng.normal(0.067, 0.009, size=n), np.zeros(n)])


def rejection_rates(pairs: int, seed: int) -> tuple[int, int]:
    """Honest audits (25 sequences) rejected at ALPHA against a new 48-sequence band each: with the band's
    noise in the null, and without (the one-sample bootstrap)."""
    rng = np.random.default_rng(seed)
    with_noise = without = 0
    for _ in range(pairs):
        band, audit = sequences(rng, 48), sequences(rng, 25)
        with_noise += band_p_value(audit, [band], DRAWS, rng, [band_noise(band, DRAWS, rng)]) < ALPHA
        without += band_p_value(audit, [band], DRAWS, rng) < ALPHA
    return with_noise, without


def test_honest_audits_against_small_bands_are_rejected_at_the_fpr_only_with_the_bands_noise():
    pairs = 600
    with_noise, without = rejection_rates(pairs, seed=3)
    ci = wilson_interval(with_noise, pairs)
    assert ci.low <= ALPHA <= ci.high, f"with the band's noise: {with_noise}/{pairs} rejected at FPR {ALPHA}"
    # a one-sided 5% test whose null is too narrow by sqrt(1 + 25/48) rejects about 10% of honest audits
    assert wilson_interval(without, pairs).low > ALPHA, f"one-sample: {without}/{pairs}"


def test_band_noise_is_centred_and_as_wide_as_the_bands_standard_error():
    rng = np.random.default_rng(0)
    band = sequences(rng, 48)
    noise = band_noise(band, 4000, rng)
    means = band[:, 1] / band[:, 0]
    assert abs(noise.mean()) < 0.1 * noise.std()
    assert 0.8 < noise.std() / (means.std() / np.sqrt(len(band))) < 1.2


def test_band_noise_in_chunks_is_one_draw_per_row():
    rng = np.random.default_rng(1)
    band = sequences(rng, 48)
    assert band_noise(band, 1001, rng, chunk=500).shape == (1001,)
