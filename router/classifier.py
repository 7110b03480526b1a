"""The difficulty classifier: easy / medium / hard from a question's features (features.py),
with calibrated probabilities, so a policy can trust its `confidence`."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.metrics import confusion_matrix
from sklearn.model_selection import StratifiedKFold, cross_val_score, train_test_split

from router.calibration import ece, fit_calibrated, make_base
from router.data import DIFFICULTIES, Label, RouterError
from router.features import feature_vector


@dataclass(frozen=True)
class Difficulty:
    label: str                  # easy | medium | hard
    probability: float          # calibrated probability of that label


@dataclass(frozen=True)
class ClassifierReport:
    n_train: int
    n_test: int
    counts: dict[str, int]      # labelled questions per difficulty
    accuracy: float             # on the held-out part
    ece: float
    with_embedding: bool        # whether the question embedding is among the features
    cv_log_loss: dict[str, float]   # of each feature set on the training part: the choice's evidence
    labels: list[str]           # rows (truth) and columns (prediction) of the confusion matrix
    confusion: list[list[int]]


@dataclass
class DifficultyClassifier:
    model: object               # fitted CalibratedClassifierCV
    embed_dim: int
    with_embedding: bool = True

    def probabilities(self, question: str, embedding: np.ndarray, scores: list[float]) -> dict[str, float]:
        """Calibrated probability of each difficulty the classifier was trained on."""
        if np.asarray(embedding).size != self.embed_dim:
            raise RouterError(f"the question embedding has {np.asarray(embedding).size} dimensions; this "
                              f"router was trained on {self.embed_dim}")
        row = feature_vector(question, embedding, scores, self.with_embedding)[None]
        return {str(c): float(p) for c, p in zip(self.model.classes_, self.model.predict_proba(row)[0])}

    def predict(self, question: str, embedding: np.ndarray, scores: list[float]) -> Difficulty:
        probs = self.probabilities(question, embedding, scores)
        best = max(probs, key=probs.get)
        return Difficulty(best, probs[best])


def train_classifier(labels: list[Label], embeddings: np.ndarray, seed: int = 0,
                     test_size: float = 0.25) -> tuple[DifficultyClassifier, ClassifierReport]:
    """Fit on a stratified share of the labels and report on the rest; then refit on all of
    them, so the saved model uses every label and the report is honest about it."""
    keep = [i for i, l in enumerate(labels) if l.difficulty is not None]
    if len(keep) < 8:
        raise RouterError(f"{len(keep)} questions have a difficulty label (the small model right, or the large "
                          f"one run); need at least 8")
    x = np.stack([feature_vector(labels[i].question, embeddings[i], labels[i].retrieval_scores) for i in keep])
    y = np.array([labels[i].difficulty for i in keep])
    counts = {d: int((y == d).sum()) for d in DIFFICULTIES}
    try:
        ia, ib = train_test_split(np.arange(len(y)), test_size=test_size, random_state=seed, stratify=y)
    except ValueError as e:        # a class too rare to appear on both sides
        raise RouterError(f"cannot hold out a test share with difficulties {counts}: {e}") from None
    # With or without the embedding: whichever predicts better on the training part alone
    # (cross-validated log loss), so the held-out report stays honest about the choice.
    head = x.shape[1] - embeddings.shape[1]
    losses = {name: cv_log_loss(x[ia][:, :cols], y[ia], seed) for name, cols in (("with_embedding", x.shape[1]),
                                                                                   ("without", head))}
    with_embedding = losses["with_embedding"] <= losses["without"]
    if not with_embedding:
        x = x[:, :head]
    xa, xb, ya, yb = x[ia], x[ib], y[ia], y[ib]
    held = fit_calibrated(xa, ya)
    probs = held.predict_proba(xb)
    predicted = held.classes_[probs.argmax(axis=1)]
    present = [d for d in DIFFICULTIES if counts[d]]
    report = ClassifierReport(len(ya), len(yb), counts, float((predicted == yb).mean()),
                              ece(probs, yb, held.classes_), with_embedding, losses, present,
                              confusion_matrix(yb, predicted, labels=present).tolist())
    return DifficultyClassifier(fit_calibrated(x, y), int(embeddings.shape[1]), with_embedding), report


def cv_log_loss(x: np.ndarray, y: np.ndarray, seed: int) -> float:
    folds = int(min(3, np.unique(y, return_counts=True)[1].min()))
    if folds < 2:
        return 0.0                 # too few to compare: keep every feature (fit_calibrated will say why)
    cv = StratifiedKFold(folds, shuffle=True, random_state=seed)
    scores = cross_val_score(make_base(), x, y, cv=cv, scoring="neg_log_loss")
    return round(float(-scores.mean()), 4)
