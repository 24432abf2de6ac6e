"""bench/baselines: each plain-JAX baseline runs (CPU smoke shapes, SMALL=1), prints one JSON line without an error,
and that line becomes a record of the one schema through the runner's conversion (`bench.anchor_record`)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import records
from bench.anchor_record import to_record
from tests.helpers import ROOT, cpu_env, tiered

CASES = [("plain_jax_llama", "offload_qkv", None, dict(bench="llama405b-slice", S=8192, backend="none")),
         ("plain_jax_deepseek", "mla_moe_offload", None, dict(bench="deepseek-slice", S=4096)),
         ("plain_jax_llama_fsdp", "offload_qkv", 2, dict(bench="llama405b-slice", S=8192, backend="none",
                                                         mesh="fsdp=2"))]


@pytest.mark.parametrize("case", tiered(CASES, fast=CASES[:1]), ids=[c[0] for c in CASES])
def test_a_baseline_runs_and_its_line_is_a_record(case):
    module, policy, devices, fields = case
    env = cpu_env(devices, SMALL="1", NL="2")
    out = subprocess.run([sys.executable, "-m", f"bench.baselines.{module}", policy, "2"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert "error" not in line, line
    assert line["policy"] == policy and line["step_s"] > 0 and line["loss"] > 0
    rec = records.normalize(to_record(line, smoke=True, **fields), date="2026-12-01")
    assert rec["impl"] == "anchor" and rec["recipe"] == policy and rec["L"] == 2
