"""The one schema of a benchmark record: a line of bench/results/*.jsonl, of `bench.run`'s OUT/results.jsonl and of a
bench's BENCH_OUT file.

A record is a JSON object with every field of `Record` (None where a figure does not apply) and `extras` (whatever else
the bench reports). `normalize` turns a bench's flat dict into that form and checks each field's type; `flat` is the
reverse; `load` reads a file and checks every line.

    bench, impl    what was measured; "zoo" or "anchor" (a plain-JAX baseline of bench/baselines/)
    recipe         the recipe (zoo) or the checkpoint policy (anchor); backend: the MoE dispatch, None if dense
    gpus, mesh     the devices the step ran on, the mesh spec ("fsdp=2") or None
    B, S, L        global batch, sequence length, decoder layers
    step_s, tflops seconds per step (mean of the timed steps), model TFLOP/s per device
    peak_gib, planned_peak_gib, host_temp_gib, planned_host_gib   measured and planned HBM peak and host bytes
    dropped        token copies dropped by capacity dispatch
    jax, flags, date   jax version, XLA_FLAGS and the step's compile options, YYYY-MM-DD
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import pathlib
from typing import Any

IMPLS = ("zoo", "anchor")


@dataclasses.dataclass(frozen=True)
class Record:
    bench: str
    impl: str
    recipe: str | None
    backend: str | None
    gpus: int | None
    mesh: str | None
    B: int | None
    S: int | None
    L: int | None
    step_s: float | None
    tflops: float | None
    peak_gib: float | None
    planned_peak_gib: float | None
    host_temp_gib: float | None
    planned_host_gib: float | None
    dropped: int | None
    jax: str | None
    flags: str | None
    date: str
    extras: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


FIELDS = tuple(f.name for f in dataclasses.fields(Record) if f.name != "extras")
_STR = ("bench", "impl", "recipe", "backend", "mesh", "jax", "flags", "date")
_INT = ("gpus", "B", "S", "L", "dropped")
_FLOAT = ("step_s", "tflops", "peak_gib", "planned_peak_gib", "host_temp_gib", "planned_host_gib")


def check(record: Record) -> Record:
    """ValueError naming the field, unless every field of `record` has its type (and bench, impl, date a value)."""
    def bad(name, why):
        raise ValueError(f"record field {name}={getattr(record, name)!r}: {why}")

    for name in _STR:
        v = getattr(record, name)
        if v is not None and not isinstance(v, str):
            bad(name, "must be a string or null")
    for name in _INT:
        v = getattr(record, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            bad(name, "must be an integer >= 0 or null")
    for name in _FLOAT:
        v = getattr(record, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            bad(name, "must be a finite number or null")
    if not record.bench:
        bad("bench", "every record names its bench")
    if record.impl not in IMPLS:
        bad("impl", f"must be one of {IMPLS}")
    try:
        datetime.date.fromisoformat(record.date)
    except (TypeError, ValueError):
        bad("date", "must be a date YYYY-MM-DD")
    if not isinstance(record.extras, dict) or set(record.extras) & set(FIELDS):
        bad("extras", "must be a dict holding no schema field")
    return record


def normalize(raw: dict, **defaults: Any) -> dict:
    """A record in the schema's form from a bench's flat dict (or an already normalised one): its schema fields,
    `defaults` for those it lacks (else None), the other keys in `extras`. Checked (`check`)."""
    raw = dict(raw)
    extras = dict(raw.pop("extras", None) or {})
    extras.update({k: v for k, v in raw.items() if k not in FIELDS})
    values = {name: raw.get(name, defaults.get(name)) for name in FIELDS}
    return check(Record(**values, extras=extras)).to_dict()


def flat(record: dict) -> dict:
    """A record's fields and extras in one dict (readers that look a key up wherever it lives)."""
    return {**record.get("extras", {}), **{k: v for k, v in record.items() if k != "extras"}}


def load(path: str | pathlib.Path) -> list[dict]:
    """The records of a .jsonl file, each checked: ValueError naming the file and line of one that is not."""
    out = []
    for i, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        missing = [k for k in (*FIELDS, "extras") if k not in record]
        if missing:
            raise ValueError(f"{path}:{i}: not a record of the schema (bench/records.py): missing {missing}")
        extra_keys = sorted(set(record) - {*FIELDS, "extras"})
        if extra_keys:
            raise ValueError(f"{path}:{i}: keys outside the schema at the top level: {extra_keys} (they go in "
                             f"extras)")
        try:
            check(Record(**record))
        except ValueError as e:
            raise ValueError(f"{path}:{i}: {e}") from None
        out.append(record)
    return out


def load_flat(path: str | pathlib.Path) -> list[dict]:
    """`load`, each record `flat`."""
    return [flat(r) for r in load(path)]
