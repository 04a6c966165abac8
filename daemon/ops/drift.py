"""Input drift and output entropy over the most recent requests.

Drift: is the line still sending pictures like the ones the model was trained on?

Every answered request carries the 64-bin histogram of its input intensities, computed by
the worker (bin = pixel >> 2, on the device for GPU workers). The model's metadata carries
the training set's histogram over the same bins. The main process keeps the last `window`
request histograms in a ring and reports

    score = KL(P || Q) = sum_i P_i * ln(P_i / Q_i)        in nats, >= 0

    P = smooth( mean over the window of h_r / sum(h_r) )   each request weighs the same,
                                                           whatever its resolution
    Q = smooth( training histogram / its sum )
    smooth(p) = (1 - LAMBDA) * p + LAMBDA / 64             LAMBDA = 1e-3

The direction is "how surprising is what we see now, under what we trained on". Smoothing
by mixing with the uniform distribution keeps every bin positive, so an intensity the
training set never showed (a blown-out frame) gives a large but finite score: the score is
bounded by ln(64 / LAMBDA) ~ 11.1 nats.

What the numbers mean on the real data (`/work/shared/data`, train histogram vs held-out
`val` images): val ~ 0.005; val inverted ~ 0.55; val brightened (1.8x + 60) ~ 2.0. The
score is that of the *mixture* in the window, so it crosses `drift.threshold` (0.15) when
enough of the window has shifted: for inverted frames about 55 % of it (30 % gives ~0.05). Choose
`drift.window` as the number of recent parts that must look different before you want to
know. With few requests in the window the estimate is noisy and biased upwards (one
picture's histogram is peakier than a population's); `samples` says how full it is.

The reference is the training *mix* of products. A window holding one product type only
is compared with that mix: held-out SD-900 inclusions alone score ~0.29, patches ~0.25,
magnetic tiles ~0.01-0.13. A line that runs a single product wants a reference histogram of
that product (a model trained for it, or a per-class reference: not done yet).

Entropy: the worker reports per request the mean binary entropy of the probability map in
bits (`-p log2 p - (1-p) log2 (1-p)` averaged over pixels; 0 = fully confident, 1 = coin
flips; see `scratchd.model.scratchnet`). `EntropyMonitor` averages it over the last `window`
answered requests. Out-of-distribution input moves it: the model loses its confidence on
frames unlike its training set (entropy up), and saturates on blank or blown-out frames
(entropy towards 0).

Both monitors live in the main process and are fed from the one place that accounts each
completed request; nothing here is shared with workers, so no lock is needed.
"""

from __future__ import annotations

import math

import numpy as np

from scratchd.ipc.layout import HISTOGRAM_BINS as BINS

LAMBDA = 1e-3


def smooth(p: np.ndarray) -> np.ndarray:
    """Mix a distribution over BINS with the uniform one, so that every bin is positive."""
    return (1.0 - LAMBDA) * p + LAMBDA / BINS


def kl_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """KL(p || q) in nats of two distributions over BINS, after smoothing both."""
    ps, qs = smooth(p), smooth(q)
    # KL is never negative; rounding can make identical distributions give -1e-17.
    return max(0.0, float(np.sum(ps * np.log(ps / qs))))


def normalise(histogram: np.ndarray, what: str) -> np.ndarray:
    """A non-negative 64-bin histogram (counts or frequencies) as a distribution."""
    h = np.asarray(histogram, dtype=np.float64)
    if h.shape != (BINS,):
        raise ValueError(f"{what}: expected {BINS} bins, got shape {h.shape}")
    total = h.sum()
    if not np.isfinite(total) or total <= 0 or (h < 0).any():
        raise ValueError(f"{what}: a histogram needs non-negative counts with a positive sum")
    return h / total


class DriftMonitor:
    """The last `window` input histograms and their KL divergence from the training one."""

    def __init__(
        self,
        reference: np.ndarray,
        window: int = 500,
        threshold: float = 0.15,
        min_samples: int = 100,
    ) -> None:
        if window < 1:
            raise ValueError(f"drift.window must be >= 1, got {window}")
        self.reference = normalise(reference, "training histogram")
        self.window = window
        self.threshold = threshold
        self.min_samples = min(max(min_samples, 1), window)
        self._ring = np.zeros((window, BINS), dtype=np.float64)
        self._next = 0
        self._samples = 0
        self._score: float | None = 0.0

    @property
    def samples(self) -> int:
        """How many requests the current estimate covers (at most `window`)."""
        return self._samples

    @property
    def warming_up(self) -> bool:
        """Fewer than `min_samples` requests in the window: the score is not yet a mix."""
        return self._samples < self.min_samples

    def observe(self, histogram: np.ndarray) -> None:
        """Add one request's input histogram (counts), evicting the oldest when full.

        The per-request path is one copy into the ring; normalising waits for `score()`.
        A histogram with no counts (impossible from a real image) is kept but ignored.
        """
        h = np.asarray(histogram)
        if h.shape != (BINS,) or (h.dtype.kind != "u" and not (h >= 0).all()):
            normalise(h, "request histogram")  # raises, naming what is wrong
        slot = self._next
        self._ring[slot] = h
        self._next = (slot + 1) % self.window
        self._samples = min(self._samples + 1, self.window)
        self._score = None

    def score(self) -> float:
        """KL(window || training) in nats; 0.0 before the first request."""
        if self._score is None:
            rows = self._ring[: self._samples]
            totals = rows.sum(axis=1)
            valid = (totals > 0) & np.isfinite(totals)
            if not valid.any():
                return 0.0
            mean = (rows[valid] / totals[valid, None]).mean(axis=0)
            self._score = kl_divergence(mean, self.reference)
        return self._score

    def snapshot(self) -> dict[str, float | int | bool]:
        score = self.score()
        return {
            "score": round(score, 5),
            "threshold": self.threshold,
            "over_threshold": not self.warming_up and score > self.threshold,
            "window": self.window,
            "samples": self._samples,
            "warming_up": self.warming_up,
        }


class EntropyMonitor:
    """Rolling mean of the per-request output entropy (bits) over the last `window` answers."""

    def __init__(self, window: int = 500, min_samples: int = 100) -> None:
        if window < 1:
            raise ValueError(f"entropy window must be >= 1, got {window}")
        self.window = window
        self.min_samples = min(max(min_samples, 1), window)
        self._ring = np.zeros(window, dtype=np.float64)
        self._next = 0
        self._samples = 0

    def observe(self, entropy_bits: float) -> None:
        if not math.isfinite(entropy_bits) or entropy_bits < 0:
            raise ValueError(f"entropy must be finite and >= 0 bits, got {entropy_bits}")
        self._ring[self._next] = entropy_bits
        self._next = (self._next + 1) % self.window
        self._samples = min(self._samples + 1, self.window)

    def mean(self) -> float:
        """0.0 before the first answer."""
        return float(self._ring[: self._samples].mean()) if self._samples else 0.0

    @property
    def warming_up(self) -> bool:
        """Fewer than `min_samples` answers in the window."""
        return self._samples < self.min_samples

    def snapshot(self) -> dict[str, float | int | bool]:
        return {
            "bits": round(self.mean(), 5),
            "window": self.window,
            "samples": self._samples,
            "warming_up": self.warming_up,
        }
