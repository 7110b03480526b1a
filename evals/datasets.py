"""Question sets an eval runs: SQuAD v1.1 (answered from retrieved paragraphs), GSM8K (the
question alone), users' own JSONL, and a mix of SQuAD and GSM8K.

Data files are read where they lie (../shared/data by default) and never copied: only the
run folder, outside the repository, holds what is derived from them.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from itertools import chain, zip_longest
from pathlib import Path

import msgspec

from retrieval import Document

SQUAD_FILE = "squad-v1.1-dev-part-a.json"
GSM8K_FILE = "gsm8k-train.jsonl"
DATASETS = ("squad", "gsm8k", "jsonl", "mixed")
SPLITS = ("all", "train", "test")


class DatasetError(ValueError):
    """A data file that is missing or malformed; the message names the file (and line)."""


@dataclass(frozen=True)
class Example:
    id: str
    kind: str            # how it is scored: "squad", "gsm8k" or "qa" (a JSONL set; scored like SQuAD)
    question: str
    answers: list[str]   # gold answers; GSM8K: the reference solution, whose number follows "####"
    retrieve: bool       # answered from the run's collection (as /v1/ask with a collection)


@dataclass
class Dataset:
    name: str
    examples: list[Example]
    documents: list[Document] = field(default_factory=list)   # the collection; empty: no retrieval


class _Row(msgspec.Struct):
    """One line of a user's JSONL set."""
    question: str
    answers: list[str]
    context: str | None = None      # a passage holding the answer; all of them make the collection
    id: str | None = None


def load_squad(path: Path) -> tuple[list[Example], list[Document]]:
    """Every paragraph becomes a document of the collection, so retrieval must find a
    question's paragraph among all of them, as it would in service."""
    try:
        articles = json.loads(_read(path))["data"]
        docs, examples = [], []
        for a, article in enumerate(articles):
            title = article["title"].replace("_", " ")
            for p, para in enumerate(article["paragraphs"]):
                docs.append(Document(f"{a:02d}-{p:03d}", para["context"], title))
                examples += [Example(qa["id"], "squad", qa["question"], [x["text"] for x in qa["answers"]], True)
                             for qa in para["qas"]]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DatasetError(f"{path}: not SQuAD v1.1 JSON (data[].paragraphs[].context, .qas[]): {e!r}") from None
    return examples, docs


def load_gsm8k(path: Path) -> list[Example]:
    out = []
    for n, line in _lines(path):
        try:
            row = json.loads(line)
            out.append(Example(f"gsm8k-{n}", "gsm8k", row["question"], [row["answer"]], False))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DatasetError(f"{path} line {n}: expected {{\"question\", \"answer\"}}: {e!r}") from None
    return out


def load_jsonl(path: Path) -> tuple[list[Example], list[Document]]:
    """Rows with a context are answered through retrieval over all the contexts (identical
    ones stored once); rows without one are asked alone."""
    decoder = msgspec.json.Decoder(_Row)
    examples, docs, doc_of = [], [], {}
    for n, line in _lines(path):
        try:
            row = decoder.decode(line)
        except msgspec.DecodeError as e:
            raise DatasetError(f"{path} line {n}: {e} (expected {{\"question\", \"answers\": [...], "
                               f"\"context\"?, \"id\"?}})") from None
        if not row.answers:
            raise DatasetError(f"{path} line {n}: 'answers' is empty")
        if row.context is not None and row.context not in doc_of:
            doc_of[row.context] = f"ctx-{len(docs):05d}"
            docs.append(Document(doc_of[row.context], row.context))
        examples.append(Example(row.id or f"line-{n}", "qa", row.question, row.answers, row.context is not None))
    ids = [e.id for e in examples]
    if len(set(ids)) != len(ids):
        raise DatasetError(f"{path}: ids repeat (e.g. {next(i for i in ids if ids.count(i) > 1)!r}); "
                           "each must be unique")
    return examples, docs


def sample(examples: list[Example], n: int | None, seed: int) -> list[Example]:
    """n examples drawn without replacement, in a seeded random order (all of them when n is None)."""
    rng = random.Random(seed)
    return rng.sample(examples, len(examples) if n is None else min(n, len(examples)))


def in_split(example: Example, split: str) -> bool:
    """A fixed half of every dataset is `train`, the other `test`, decided by the question's id
    alone: a router trained on a train run never sees a test run's questions, whatever their
    sizes and seeds."""
    if split == "all":
        return True
    return ("train", "test")[hashlib.blake2b(example.id.encode(), digest_size=1).digest()[0] & 1] == split


def interleave(a: list[Example], b: list[Example], ratio: tuple[int, int] = (1, 1)) -> list[Example]:
    """ratio[0] of a, then ratio[1] of b, and again; the longer list's rest at the end."""
    chunks = lambda xs, r: [xs[i:i + r] for i in range(0, len(xs), r)] if r else []
    return [x for pair in zip_longest(chunks(a, ratio[0]), chunks(b, ratio[1]), fillvalue=[]) for x in chain(*pair)]


def parse_mix(text: str) -> tuple[int, int]:
    """'2:1' -> (2, 1): SQuAD questions to GSM8K problems in a mixed workload."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise DatasetError(f"mix {text!r}: expected SQUAD:GSM8K, two whole numbers such as 2:1") from None
    if a < 0 or b < 0 or a + b == 0:
        raise DatasetError(f"mix {text!r}: the parts must be non-negative and not both 0")
    return a, b


def files_for(name: str, path: str | None, data: str) -> list[Path]:
    """The files a dataset reads: `path` when given, else its standard name under `data`."""
    if name not in DATASETS:
        raise DatasetError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    if name == "jsonl" and path is None:
        raise DatasetError("dataset jsonl needs --path FILE")
    if name == "mixed":
        if path is not None:
            raise DatasetError(f"dataset mixed reads {SQUAD_FILE} and {GSM8K_FILE} from --data, not --path")
        files = [Path(data) / SQUAD_FILE, Path(data) / GSM8K_FILE]
    else:
        files = [Path(path) if path else Path(data) / {"squad": SQUAD_FILE, "gsm8k": GSM8K_FILE}[name]]
    for f in files:
        if not f.is_file():
            raise DatasetError(f"{f}: no such file")
    return files


def load(name: str, files: list[Path], n: int | None, seed: int, split: str = "all",
         mix: tuple[int, int] = (1, 1)) -> Dataset:
    """The dataset's sample: the same arguments always give the same questions in the same
    order, which is what lets an interrupted run resume. The collection holds every document
    of the file whatever the split: retrieval must find a question's passage among all."""
    if split not in SPLITS:
        raise DatasetError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    part = lambda examples: [e for e in examples if in_split(e, split)]
    if name == "squad":
        examples, docs = load_squad(files[0])
        return Dataset(name, sample(part(examples), n, seed), docs)
    if name == "gsm8k":
        return Dataset(name, sample(part(load_gsm8k(files[0])), n, seed))
    if name == "jsonl":
        examples, docs = load_jsonl(files[0])
        return Dataset(name, sample(part(examples), n, seed), docs)
    squad, docs = load_squad(files[0])     # mixed: SQuAD and GSM8K interleaved by `mix`
    gsm8k = load_gsm8k(files[1])
    squad, gsm8k = part(squad) if mix[0] else [], part(gsm8k) if mix[1] else []
    n_squad = None if n is None else -(-n * mix[0] // sum(mix))
    n_gsm8k = None if n is None else n - n_squad
    return Dataset(name, interleave(sample(squad, n_squad, seed), sample(gsm8k, n_gsm8k, seed), mix), docs)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: cannot read: {e}") from None


def _lines(path: Path):
    """(line number from 1, line) for each non-blank line."""
    return [(n, line) for n, line in enumerate(_read(path).splitlines(), 1) if line.strip()]
