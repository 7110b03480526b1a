"""A run folder as a committed artifact, so a run of hours (the router's labelling runs) goes on
from where it stopped on a fresh machine, as the proxy scores do. `sluice eval pack RUN DIR`
keeps the run's settings and its records with the dataset's text taken out (each question;
the answers the model wrote, its scores, tokens and log-probabilities stay); `sluice eval
unpack DIR RUN` makes the run folder again, each question read back from the run's own data
files by its id, and the run resumes there as if it had never left (`eval run --out RUN`; the
collection is rebuilt from the data)."""
from __future__ import annotations

import gzip
import shutil
from dataclasses import replace
from pathlib import Path

import msgspec

from evals.records import Record, complete_lines, read_records
from evals.runner import CONFIG_FILE, MODES_FILE, RECORDS_FILE, RunError, load_dataset, read_config

PACKED_RECORDS = "records.jsonl.gz"


def pack(run: Path, out: Path) -> int:
    """Write RUN's settings and records, without question text, into OUT; returns how many
    records. Packing again replaces what OUT held (the run only grows). A run still writing
    may be packed: its torn last line is left out, and left alone."""
    read_config(run)
    records = read_records(run / RECORDS_FILE)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run / CONFIG_FILE, out / CONFIG_FILE)
    if (run / MODES_FILE).exists():
        shutil.copyfile(run / MODES_FILE, out / MODES_FILE)
    records = sorted({(r.mode, r.id): r for r in records}.values(), key=lambda r: (r.mode, r.id))
    encoder = msgspec.json.Encoder()
    # mtime 0: the same records pack to the same bytes, so an unchanged run changes no file.
    with open(out / PACKED_RECORDS, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        for r in records:
            f.write(encoder.encode(replace(r, question="")) + b"\n")
    return len(records)


def unpack(packed: Path, run: Path) -> int:
    """Make RUN from a packed run: its settings, and its records with their questions put back
    from the data. Refused where RUN already holds records (a run of its own would be mixed
    with the packed one); returns how many records."""
    if not (packed / PACKED_RECORDS).exists():
        raise RunError(f"{packed}: not a packed run (no {PACKED_RECORDS}; `sluice eval pack RUN {packed}` makes one)")
    if complete_lines(run / RECORDS_FILE):
        raise RunError(f"{run} already holds records; unpack into a new folder, or resume it as it is")
    config = read_config(packed)
    questions = {e.id: e.question for e in load_dataset(config).examples}
    with gzip.open(packed / PACKED_RECORDS, "rb") as f:
        records = [msgspec.json.decode(line, type=Record) for line in f if line.strip()]
    unknown = [r.id for r in records if r.id not in questions]
    if unknown:
        raise RunError(f"{packed}: {len(unknown)} record(s) answer questions this run's data does not hold "
                       f"(first: {unknown[0]}); were the data files {', '.join(config.files)} replaced?")
    run.mkdir(parents=True, exist_ok=True)
    for name in (CONFIG_FILE, MODES_FILE):
        if (packed / name).exists():
            shutil.copyfile(packed / name, run / name)
    encoder = msgspec.json.Encoder()
    (run / RECORDS_FILE).write_bytes(b"".join(encoder.encode(replace(r, question=questions[r.id])) + b"\n"
                                              for r in records))
    return len(records)
