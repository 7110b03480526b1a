"""Arms: what mode=auto chooses among. An arm is a model, a thinking budget and a context
budget of its own (the small model answers better from fewer passages: docs/evals.md, the
context-budget curve). One model, trained on per-arm labels, predicts each arm's chance of
answering a question right; the policy (router.policy.route_arms) takes the cheapest arm
whose chance is within the tenant's margin of the best one's.

Arm names say what they are: `small`, `large`, `large+think256`, and `large@256` for an arm
that carries a context budget of its own (256 tokens) instead of its model's from the context
curve: a narrow arm, offered at whatever budget its labelling run read. Evals name the labels
of a run's answers the same way (`arm_name`), so a label file can hold arms from several runs.

Each arm has a classifier per kind of question its labels cover: answered from retrieved
passages (SQuAD) or closed-book (GSM8K, where the thinking arms were labelled), and is offered
only for those. One classifier over both kinds extrapolates from the kind it saw most (SQuAD,
where the large model is right twice as often) to the other. Token counts differ as much (a
SQuAD answer is ten tokens, a GSM8K one two hundred), so each kind prices the arm by its own
labels.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
from scipy.special import expit
from sklearn.model_selection import train_test_split

from router.calibration import fit_calibrated
from router.classifier import cv_log_loss
from router.data import Label, RouterError
from router.features import RETRIEVED, feature_vector

NAME = re.compile(r"(?P<model>[a-z0-9_.-]+?)(?:\+think(?P<thinking>\d+))?(?:@(?P<context>\d+))?")
# The arms a trained router may offer besides narrow ones; a router trains those its labels cover.
ARM_NAMES = ("small", "large", "large+think256", "large+think1024")
# Output tokens an arm is assumed to spend when no label says (a proxy label generates nothing).
DEFAULT_OUTPUT_TOKENS = 48
MIN_LABELS = 8
KINDS = {True: "retrieved", False: "closed_book"}


@dataclass(frozen=True)
class Arm:
    name: str
    model: str                       # the engine's model name
    thinking: int = 0                # thinking tokens; 0: no thinking span
    context_budget: int | None = None   # prompt tokens; None: the tenant's (an arm's is capped by it)


def arm_name(model: str, thinking: int = 0, context: int | None = None) -> str:
    return model + (f"+think{thinking}" if thinking else "") + (f"@{context}" if context else "")


def parse_arm(name: str, context_budget: int | None = None) -> Arm:
    """`context_budget`: the model's (from the context curve), unless the name carries its own."""
    m = NAME.fullmatch(name)
    if m is None:
        raise RouterError(f"arm {name!r}: expected MODEL, MODEL+thinkN or either with @TOKENS, e.g. large+think256")
    return Arm(name, m["model"], int(m["thinking"] or 0), int(m["context"]) if m["context"] else context_budget)


def offered(labels: list[Label]) -> list[str]:
    """ARM_NAMES and the narrow arms the labels hold, the narrow ones after `small` (cheapest
    first, as a tie in the policy's cost goes to the earlier arm). The large model on one
    passage (256 tokens of whole chunks) kept 92% of its F1 at half its dollars on the context
    curve; on selected clauses a narrower budget does as well (docs/retrieval.md)."""
    narrow = {parse_arm(n) for l in labels for n in l.arms}
    narrow = sorted((a for a in narrow if a.context_budget is not None), key=lambda a: (a.model, a.context_budget))
    return [ARM_NAMES[0], *(a.name for a in narrow), *ARM_NAMES[1:]]


def retrieved(scores: list[float]) -> bool:
    """The kind of question, as the arms see it: one answered from retrieved passages or a
    closed-book one (nothing searched)."""
    return bool(scores)


@dataclass(frozen=True)
class ArmReport:
    n_train: int
    n_test: int
    with_embedding: bool
    # Per arm and kind of question it covers ("retrieved", "closed_book"): labelled questions,
    # held-out Brier score of P(correct) and the base rate's Brier (always saying the training
    # share), mean prompt and output tokens in its labels.
    arms: dict[str, dict[str, dict]]
    left_out: dict[str, str] = field(default_factory=dict)    # "arm (kind)" -> why it is not offered there


@dataclass
class ArmModel:
    """P(correct) per arm from one question's features: one calibrated classifier per arm and
    kind of question, all on the same feature vector, so one embedding and one feature row
    serve every arm.

    Each classifier is scaling, logistic regression and a sigmoid calibration: all linear up to
    the last step, so serving folds them into one matrix (`_fold`) and scores every arm with one
    matrix-vector product, a few microseconds, where sklearn's predict_proba costs about a
    millisecond per arm. Tested equal to predict_proba."""
    arms: tuple[Arm, ...]
    models: dict[tuple[str, bool], object]         # (arm name, retrieved) -> fitted CalibratedClassifierCV
    # arm name -> {retrieved: mean (prompt, output) tokens in its labels}, for each kind of
    # question (`retrieved`) it has a classifier of: the kinds it is offered for
    tokens: dict[str, dict[bool, tuple[float, float]]]
    embed_dim: int
    with_embedding: bool
    folded: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None   # weights, bias, a, b per model

    def __post_init__(self) -> None:
        if self.folded is None:
            self.folded = _fold(list(self.models.values()))

    def predict(self, question: str, embedding: np.ndarray, scores: list[float]) -> dict[str, float]:
        if np.asarray(embedding).size != self.embed_dim:
            raise RouterError(f"the question embedding has {np.asarray(embedding).size} dimensions; this "
                              f"router was trained on {self.embed_dim}")
        p = self.predict_rows(feature_vector(question, embedding, scores, self.with_embedding)[None])
        return {name: float(v[0]) for name, v in p.items() if not np.isnan(v[0])}

    def predict_rows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """P(correct) per arm and row, by the arm's classifier of the row's kind; NaN where it
        has none."""
        w, c, a, b = self.folded
        rows = np.asarray(rows, np.float64)
        p = expit(-(a * (rows @ w.T + c) + b))         # sklearn's sigmoid calibration
        # Per arm, its classifier's column for retrieved rows and for closed-book ones (the
        # last column, all NaN, where it has none).
        p = np.concatenate([p, np.full((len(rows), 1), np.nan)], axis=1)
        kind = rows[:, RETRIEVED] > 0
        return {arm.name: np.where(kind, p[:, on_retrieved], p[:, closed_book])
                for arm, (on_retrieved, closed_book) in zip(self.arms, self._columns)}

    @cached_property
    def _columns(self) -> list[tuple[int, int]]:
        index = {key: i for i, key in enumerate(self.models)}
        return [(index.get((arm.name, True), -1), index.get((arm.name, False), -1)) for arm in self.arms]

    def output_tokens(self, name: str, retrieved: bool) -> float:
        """The output an arm's labels spent on average on this kind of question, thinking included."""
        return self.tokens[name][retrieved][1]

    def with_budgets(self, budgets: dict[str, int]) -> ArmModel:
        """The same model with context budgets per engine model (from the context-budget curve),
        for the arms that do not name their own."""
        return replace(self, arms=tuple(parse_arm(a.name, budgets.get(a.model, a.context_budget)) for a in self.arms))


def _p_true(model, rows: np.ndarray) -> np.ndarray:
    return model.predict_proba(rows)[:, list(model.classes_).index(True)]


def _fold(models: list) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per model (fit_calibrated's: one calibrated StandardScaler + LogisticRegression on
    classes [False, True]): the weights and bias of its decision function on raw features,
    and its calibration's a and b."""
    w, c, a, b = [], [], [], []
    for model in models:
        (calibrated,) = model.calibrated_classifiers_
        scaler, lr = calibrated.estimator[0], calibrated.estimator[-1]
        if list(model.classes_) != [False, True] or len(calibrated.calibrators) != 1:
            raise RouterError("an arm's classifier is not a binary calibrated model")
        weights = lr.coef_[0] / scaler.scale_
        w.append(weights)
        c.append(lr.intercept_[0] - scaler.mean_ @ weights)
        a.append(calibrated.calibrators[0].a_)
        b.append(calibrated.calibrators[0].b_)
    return np.array(w), np.array(c), np.array(a), np.array(b)


def arm_tokens(outcomes: dict[str, list]) -> dict[str, tuple[float, float]]:
    """Mean prompt and output tokens per arm, from its labels. A proxy label knows its prompt
    but generates nothing: an arm labelled only by the proxy takes the output of the arm of
    the same model and thinking at another context budget, else DEFAULT_OUTPUT_TOKENS."""
    def mean(xs: list) -> float | None:
        return float(np.mean(xs)) if xs else None
    arms = {name: parse_arm(name) for name in outcomes}
    generated: dict[tuple[str, int], list[int]] = {}       # (model, thinking) -> every output seen
    for name, os in outcomes.items():
        generated.setdefault((arms[name].model, arms[name].thinking), []).extend(
            o.output for o in os if o.output is not None)
    out = {}
    for name, os in outcomes.items():
        arm = arms[name]
        output = mean([o.output for o in os if o.output is not None]) or mean(generated[arm.model, arm.thinking])
        out[name] = (mean([o.prompt for o in os if o.prompt]) or 0.0,
                     output if output is not None else float(DEFAULT_OUTPUT_TOKENS + arm.thinking))
    return out


def train_arms(labels: list[Label], embeddings: np.ndarray, seed: int = 0,
               test_size: float = 0.25) -> tuple[ArmModel | None, ArmReport]:
    """One classifier per arm (of `offered`) and kind of question that at least MIN_LABELS
    labels cover with both outcomes; None when fewer than two arms are left (nothing to choose
    between). The held-out share is by question, the same for every arm; the saved model
    refits on all labels."""
    x_all = np.stack([feature_vector(l.question, e, l.retrieval_scores) for l, e in zip(labels, embeddings)])
    ids = np.array([l.id for l in labels])
    _, test_ids = train_test_split(ids, test_size=test_size, random_state=seed) if len(ids) > 3 else (ids, ids[:0])
    test = set(test_ids.tolist())
    head = x_all.shape[1] - embeddings.shape[1]
    kind = [retrieved(l.retrieval_scores) for l in labels]
    # Per arm and kind of question, the labels to learn from: at least MIN_LABELS, both outcomes.
    per_arm, left_out = {}, {}
    names = offered(labels)
    for name in names:
        for k in (True, False):
            rows = [(i, l.arms[name]) for i, l in enumerate(labels) if name in l.arms and kind[i] == k]
            y = np.array([o.correct for _, o in rows], bool)
            if not rows:
                continue
            if len(rows) < MIN_LABELS or min(y.sum(), (~y).sum()) < 2:
                left_out[f"{name} ({KINDS[k]})"] = f"{len(rows)} labels, {int(y.sum())} right: too few to learn it"
                continue
            per_arm[name, k] = ([i for i, _ in rows], y, [o for _, o in rows])
    tokens: dict[str, dict[bool, tuple[float, float]]] = {}
    for k in (True, False):
        for name, t in arm_tokens({n: os for (n, kk), (_, _, os) in per_arm.items() if kk == k}).items():
            tokens.setdefault(name, {})[k] = t
    if len({name for name, _ in per_arm}) < 2:
        return None, ArmReport(0, 0, False, {}, left_out)
    # The embedding's hundreds of dimensions earn their place only if they predict better on
    # the training share (cross-validated, summed over arms), as for the difficulty classifier.
    def summed_loss(cols: int) -> float:
        total = 0.0
        for idx, y, _ in per_arm.values():
            train = np.array([ids[i] not in test for i in idx])
            total += cv_log_loss(x_all[np.array(idx)[train]][:, :cols], y[train], seed)
        return total
    with_embedding = summed_loss(x_all.shape[1]) <= summed_loss(head)
    x = x_all if with_embedding else x_all[:, :head]
    models, report = {}, {}
    n_train = n_test = 0
    for (name, k), (idx, y, outcomes) in per_arm.items():
        held = np.array([ids[i] in test for i in idx])
        entry = {"labels": len(idx), "right": int(y.sum())}
        if held.any() and (~held).any() and len(np.unique(y[~held])) == 2 and np.bincount(y[~held]).min() >= 2:
            p = _p_true(fit_calibrated(x[idx][~held], y[~held]), x[idx][held])
            entry |= {"held_out": int(held.sum()), "brier": round(float(np.mean((p - y[held]) ** 2)), 4),
                      "brier_base_rate": round(float(np.mean((y[~held].mean() - y[held]) ** 2)), 4)}
        n_train, n_test = max(n_train, int((~held).sum())), max(n_test, int(held.sum()))
        models[name, k] = fit_calibrated(x[idx], y)
        prompt, output = tokens[name][k]
        report.setdefault(name, {})[KINDS[k]] = entry | {"prompt_tokens": round(prompt, 1),
                                                         "output_tokens": round(output, 1)}
    arms = tuple(parse_arm(n) for n in names if n in report)
    return (ArmModel(arms, models, tokens, int(embeddings.shape[1]), with_embedding),
            ArmReport(n_train, n_test, with_embedding, report, left_out))
