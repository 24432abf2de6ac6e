"""bench/results: every committed record is in the one schema (bench/records.py), and the schema refuses what it
should (a missing field, a field of the wrong type, an unknown impl)."""
from __future__ import annotations

import json

import pytest

from bench import records
from tests.helpers import ROOT

RESULTS = ROOT / "bench" / "results"


def test_every_committed_record_is_in_the_schema():
    files = sorted(RESULTS.glob("*.jsonl"))
    assert files
    total = 0
    for path in files:
        recs = records.load(path)        # raises naming the file and line of a record that is not
        assert recs, path.name
        total += len(recs)
    assert total >= 250


def test_normalize_moves_other_keys_to_extras_and_flat_restores_them():
    rec = records.normalize({"bench": "x", "impl": "zoo", "date": "2026-12-01", "B": 2, "setting": "zoo"})
    assert rec["extras"] == {"setting": "zoo"} and rec["B"] == 2 and rec["step_s"] is None
    assert set(rec) == {*records.FIELDS, "extras"}
    assert records.flat(rec)["setting"] == "zoo"
    assert records.normalize(rec) == rec          # idempotent


@pytest.mark.parametrize("bad, message", [
    ({"impl": "tokamax"}, r"impl='tokamax': must be one of \('zoo', 'anchor'\)"),
    ({"B": 2.5}, r"B=2.5: must be an integer"),
    ({"step_s": "fast"}, r"step_s='fast': must be a finite number"),
    ({"date": "yesterday"}, r"date='yesterday': must be a date"),
    ({"bench": None}, r"bench=None: every record names its bench"),
])
def test_the_schema_refuses_a_wrong_field(bad, message):
    with pytest.raises(ValueError, match=message):
        records.normalize({"bench": "x", "impl": "zoo", "date": "2026-12-01", **bad})


def test_load_names_the_line_of_a_record_outside_the_schema(tmp_path):
    good = records.normalize({"bench": "x", "impl": "zoo", "date": "2026-12-01"})
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({"bench": "x", "step_s": 1.0}) + "\n")
    with pytest.raises(ValueError, match=r"r.jsonl:2: not a record of the schema"):
        records.load(path)


def test_the_benchmark_plots_are_drawn_from_the_records(tmp_path):
    """bench.plots draws the four PNGs of the benchmark pages from bench/results alone (here into a temporary
    folder; the committed ones are under docs/benchmarks/img/)."""
    pytest.importorskip("matplotlib")
    from bench import plots
    plots.main(["--out", str(tmp_path)])
    names = ("offload_cost", "capacity", "planner", "scaling")
    assert all((tmp_path / f"{n}.png").stat().st_size > 10_000 for n in names)
    assert all((ROOT / "docs" / "benchmarks" / "img" / f"{n}.png").exists() for n in names)
