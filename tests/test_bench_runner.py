"""bench.run: every scenario's jobs name a known bench or anchor and pass that bench's own argument parser (in the
GPU form and the smoke form) without running; one smoke job runs end to end into results.jsonl and summary.md."""
from __future__ import annotations

import argparse
import runpy
import subprocess
import sys
import warnings
from unittest import mock

import pytest

from bench import records, run
from tests.helpers import ROOT, cpu_env


class _Parsed(Exception):
    pass


def _parses(argv: tuple[str, ...]) -> None:
    """Run `python -m MODULE ...`'s argument parsing only: parse_args raises once the arguments are accepted."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        real(self, args, namespace)
        raise _Parsed

    with mock.patch.object(sys, "argv", [argv[1], *argv[2:]]), \
            mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop), warnings.catch_warnings():
        # a module the suite already imported (recipes.train) is run again as __main__: runpy says so, harmlessly
        warnings.filterwarnings("ignore", "'.*' found in sys.modules after import of package", RuntimeWarning)
        try:
            runpy.run_module(argv[1], run_name="__main__", alter_sys=False)
        except _Parsed:
            return
        except SystemExit as e:
            pytest.fail(f"{' '.join(argv)}: the bench refused its arguments (exit {e.code})")
    pytest.fail(f"{' '.join(argv)}: parsed no arguments")


def _filled(argv):
    return tuple(x.replace("{work}", "/tmp/w").replace("{out}", "/tmp/o") for x in argv)


@pytest.mark.parametrize("name", list(run.SCENARIOS))
def test_every_job_names_a_known_bench_and_its_arguments_parse(name):
    jobs = run.SCENARIOS[name].jobs
    assert jobs, name
    assert len({j.name for j in jobs}) == len(jobs), f"{name}: job names repeat"
    for job in jobs:
        for form in (job, run.smoke(job)):
            if form.argv[0] == "-m":
                assert form.program in run.BENCHES + run.ANCHORS, (name, job.name, form.program)
                _parses(_filled(form.argv))
            else:   # a script from ANCHOR_DIR
                assert form.argv[0].startswith("{anchor}/"), (name, job.name, form.argv)
            if form.program in run.ANCHORS or form.argv[0].startswith("{anchor}/"):
                assert form.anchor is not None, f"{job.name}: a baseline's line needs its record fields"
        assert form.timeout_s >= form.est_s > 0
        assert job.gpus is None or len(job.gpus.split(",")) == job.devices, job.name
        if job.program in run.ANCHORS:
            assert job.flags in run.ANCHOR_FLAGS.values(), job.name


def test_the_shell_drivers_runs_are_scenarios():
    """The two-GPU runs pin both GPUs; the refused run expects exit 2; the optimizer-state runs carry their pool."""
    assert {j.gpus for j in run.SCENARIOS["fsdp"].jobs} == {"0,1", "0"}
    assert {j.gpus for j in run.SCENARIOS["deepseek-ep2"].jobs} == {"0,1"}
    assert [j.gpus for j in run.SCENARIOS["deepseek-ep2-one"].jobs] == ["0"]
    opt = run.SCENARIOS["opt-state"].jobs
    assert [j.expect_rc for j in opt] == [2, 0, 0, 0, 0]
    assert all(j.env["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] == "80" and j.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == ".95"
               for j in opt)


def test_a_smoke_job_runs_end_to_end(tmp_path):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "bench.run", "stream-probe", str(out), "--smoke", "--only", "device"],
                       cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    recs = records.load(out / "results.jsonl")          # in the one schema
    assert len(recs) == 1
    rec = records.flat(recs[0])
    assert rec["job"] == "stream-probe-device-plain" and rec["scenario"] == "stream-probe"
    assert rec["bench"] == "stream-probe" and rec["variant"] == "device" and rec["step_s"] > 0, rec
    assert "--xla_gpu_per_fusion_autotune_cache_dir" in rec["flags"]
    assert (out / "logs" / "stream-probe-device-plain.log").exists()
    assert "stream-probe-device-plain" in (out / "summary.md").read_text()


def test_the_reporter_renders_every_committed_record():
    """Every file of bench/results/ renders (old records lack fields; a row says why it has no figures)."""
    from bench import report

    files = sorted((ROOT / "bench" / "results").glob("*.jsonl"))
    assert files
    for path in files:
        recs = report.rows(str(path))
        text = report.summary(recs)
        assert text.count("\n| ") >= len([r for r in recs if r.get("bench") != "loss-curve"]), path.name


# bench modules no scenario runs: each says who uses it
TOOLS = {"bench.plots": "draws the benchmark pages' plots from bench/results (docs/benchmarks/index.md)",
         "bench.deviceless": "compiles the 8B's step for the H200 on the CPU, no GPU needed "
                             "(docs/benchmarks/longest-context.md)"}


def test_every_bench_module_is_reached_from_a_scenario():
    """Every module of bench/ is run by a scenario's job (an ANCHOR_DIR script is its copy in bench/baselines),
    imported by one that is (or by the runner), or a tool of TOOLS: a probe run once and left behind fails here."""
    import ast

    def imports(module: str) -> set[str]:
        path = ROOT / (module.replace(".", "/") + ".py")
        if not path.exists():
            path = path.with_suffix("") / "__init__.py"
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bench"):
                found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("bench")}
        return {m for m in found if (ROOT / (m.replace(".", "/") + ".py")).exists()}

    jobs = [j for s in run.SCENARIOS.values() for j in s.jobs]
    programs = [j.program if j.argv[0] == "-m" else "bench.baselines." + j.program.removesuffix(".py") for j in jobs]
    reached, todo = set(), ["bench.run", *TOOLS, *(p for p in programs if p.startswith("bench."))]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += imports(module)
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "bench").rglob("*.py")
               if p.name != "__init__.py" and "shims" not in p.parts}
    assert modules - reached == set(), "bench modules no scenario reaches: delete them or run them from a scenario"


SMI_BY_HAND = ("timestamp, clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], temperature.gpu, "
               "clocks_event_reasons.active\n") + """\
2026/12/03 13:22:02.358, 345 MHz, 3201 MHz, 79.63 W, 35, 0x0000000000000001
2026/12/03 13:22:35.369, 1650 MHz, 3201 MHz, 648.98 W, 46, 0x0000000000000004
2026/12/03 13:22:47.371, 1980 MHz, 3201 MHz, 498.37 W, 47, 0x0000000000000000
2026/12/03 13:22:50.371, 1600 MHz, 3201 MHz, 690.00 W, 47, 0x0000000000000004
"""
SMI_SAMPLED = """timestamp, clocks.sm [MHz], power.draw [W], power.limit [W], clocks_throttle_reasons.active
2026/12/03 13:22:02.358, 345 MHz, 79.63 W, 700.00 W, 0x0000000000000001
2026/12/03 13:22:05.358, [N/A], [N/A], 700.00 W, [N/A]
"""


def test_the_gpu_clock_summary_counts_loaded_samples_and_the_power_cap(tmp_path):
    """bench.gpu_clocks.summarise: under load (over 300 W) the mean SM clock, the mean draw and the share of samples
    held at the power cap (bit 0x4), from a log written by hand (its own column names) or by the sampler; a log with
    no loaded sample says only its counts."""
    from bench import gpu_clocks
    (tmp_path / "a.csv").write_text(SMI_BY_HAND)
    assert gpu_clocks.summarise(str(tmp_path / "a.csv")) == {
        "samples": 4, "loaded": 3, "sm_mhz": round((1650 + 1980 + 1600) / 3, 1),
        "power_w": round((648.98 + 498.37 + 690.0) / 3, 1), "power_capped": round(2 / 3, 3)}
    (tmp_path / "b.csv").write_text(SMI_SAMPLED)
    assert gpu_clocks.summarise(str(tmp_path / "b.csv")) == {"samples": 2, "loaded": 0}
    (tmp_path / "c.csv").write_text("")
    assert gpu_clocks.summarise(str(tmp_path / "c.csv")) is None
