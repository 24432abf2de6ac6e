"""One-off: convert bench/results/*.jsonl written before the record schema (bench/records.py) into it, in place.

    python -m bench.migrate_records            # converts; a file already in the schema is left as it is

What it changes, per line (every value is kept: a key outside the schema moves into `extras`):
- a plain-JAX baseline's own line (`shape`, `policy`, no `bench`): bench from its shape ("405b" ->
  "llama405b-slice", "8b" -> "llama8b-slice", "ds-slice" -> "deepseek-slice"), impl "anchor", recipe = policy,
  S = the baseline's sequence (8192 Llama, 4096 DeepSeek), backend "ragged_dot" for DeepSeek (its dispatch);
- impl "zoo-main-job" / "zoo-sgd-bench" -> "zoo" with extras.program "main-job" / "sgd-bench"; impl "tokamax"
  (kernel tile timings) -> "zoo" with backend "tokamax"; "einsum (capacity dispatch)" -> "zoo", backend
  "capacity"; no impl -> "anchor" for a line with `policy` or `anchor`, else "zoo";
- `policy` -> recipe, `tflops_per_device` -> tflops (the FSDP baseline's figure is per device), backend "none" ->
  null; a missing date is the file name's; gpus, where not recorded, the product of the mesh, else null.
Files of per-step metrics lines (the main job's `--metrics`, no `bench`) are not records: they move to
bench/results/archive/.
"""
from __future__ import annotations

import json
import math
import pathlib
import re

from bench import records

RESULTS = pathlib.Path(__file__).parent / "results"
ANCHOR_BENCH = {"405b": ("llama405b-slice", 8192, None), "8b": ("llama8b-slice", 8192, None),
                "ds-slice": ("deepseek-slice", 4096, "ragged_dot")}
PROGRAM = {"zoo-main-job": "main-job", "zoo-sgd-bench": "sgd-bench"}


def _mesh_size(mesh: str) -> int:
    return math.prod(int(part.split("=")[1]) for part in mesh.split(","))


def migrate(raw: dict, file_date: str) -> dict:
    if set(raw) >= {*records.FIELDS, "extras"}:
        return records.normalize(raw)
    r = dict(raw)
    if "bench" not in r and r.get("shape") in ANCHOR_BENCH:
        r["bench"], s, backend = ANCHOR_BENCH[r["shape"]]
        r.setdefault("S", s)
        r.setdefault("backend", backend)
        r.setdefault("impl", "anchor")
        r.setdefault("dropped", 0)
    impl = r.get("impl")
    if impl in PROGRAM:
        r["impl"], r["program"] = "zoo", PROGRAM[impl]
    elif impl == "tokamax":
        r["impl"] = "zoo"
        r.setdefault("backend", "tokamax")
    elif impl == "einsum (capacity dispatch)":
        r["impl"] = "zoo"
        r.setdefault("backend", "capacity")
    elif impl is None:
        r["impl"] = "anchor" if ("policy" in r or "anchor" in r) else "zoo"
    if "policy" in r and r.get("recipe") is None:
        r["recipe"] = r.pop("policy")
    if "tflops_per_device" in r and r.get("tflops") is None:
        r["tflops"] = r.pop("tflops_per_device")
    if r.get("backend") == "none":
        r["backend"] = None
    r.setdefault("date", file_date)
    if r.get("gpus") is None and r.get("mesh"):
        r["gpus"] = _mesh_size(r["mesh"])
    return records.normalize(r)


def main() -> None:
    archive = RESULTS / "archive"
    for path in sorted(RESULTS.glob("*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if lines and all("bench" not in r and "step" in r for r in lines):
            archive.mkdir(exist_ok=True)
            path.rename(archive / path.name)
            print(f"{path.name}: per-step metrics, moved to archive/")
            continue
        file_date = re.search(r"\d{4}-\d{2}-\d{2}", path.name).group(0)
        out = [migrate(r, file_date) for r in lines]
        path.write_text("".join(json.dumps(r) + "\n" for r in out))
        print(f"{path.name}: {len(out)} records")


if __name__ == "__main__":
    main()
