"""What the router reports about a probabilistic model on held-out data, and how it fits
one: the same recipe for the difficulty classifier and the confidence model."""
from __future__ import annotations

import numpy as np
from sklearn.calibration import CalibratedClassifierCV
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from router.data import RouterError


def fit_calibrated(x: np.ndarray, y: np.ndarray, method: str = "sigmoid"):
    """Scaled logistic regression whose probabilities are calibrated by cross-validation;
    small and fast, so a request pays microseconds for it. Every class needs 2 examples."""
    values, counts = np.unique(y, return_counts=True)
    if len(values) < 2:
        raise RouterError(f"all {len(y)} training labels are {values[0]!r}: nothing to learn to tell apart")
    folds = int(min(3, counts.min()))
    if folds < 2:
        rare = ", ".join(f"{v!r}" for v, c in zip(values, counts) if c < 2)
        raise RouterError(f"too few labels of {rare} (need at least 2 of each class) to calibrate")
    # ensemble=False: one model (calibrated on cross-validated predictions), not one per fold,
    # so a request pays for one predict instead of three.
    return CalibratedClassifierCV(make_base(), method=method, cv=folds, ensemble=False).fit(x, y)


def make_base():
    """The uncalibrated model: scaled, regularized logistic regression."""
    return make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, C=0.5))


def ece(probs: np.ndarray, y: np.ndarray, classes: np.ndarray, bins: int = 10) -> float:
    """Expected calibration error of the top class: |accuracy - confidence| per confidence
    bin, weighted by the bin's share of examples."""
    top = probs.max(axis=1)
    right = classes[probs.argmax(axis=1)] == y
    edges = np.linspace(0, 1, bins + 1)
    which = np.clip(np.digitize(top, edges[1:-1]), 0, bins - 1)
    return float(sum(abs(right[which == b].mean() - top[which == b].mean()) * (which == b).mean()
                     for b in range(bins) if (which == b).any()))
