"""`python -m recipes.train.plan`, the planner's command line: the study's integers in --json, the table, --recipe
auto (with a device kind's measured link), bad input as usage errors naming the flags, --set values by the field's
type, --max-batch, the compiled peak and the measured link, --mesh, and the families added as packages (Qwen3,
Qwen3-MoE). What it prints is `zoo.plan.plan`'s (tests/plan/ check the planner itself)."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

import zoo
from recipes.llama3 import RECIPES as LLAMA_RECIPES
from recipes.train import plan as plan_cli
from tests.helpers import ROOT, assert_unbroken
from zoo.models import registry
from zoo.plan import Training

GiB = 1 << 30
LLAMA_TINY = zoo.models.LlamaConfig.preset("tiny")
PLAN = ("-m", "recipes.train.plan", "--model", "llama3", "--preset", "llama3_1_405b", "--recipe", "qkv_offload",
        "--batch", "2", "--seq", "8192")


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_cli_json_has_the_study_integers():
    r = _run(*PLAN, "--json", env={zoo.plan.POOL_ENV: "64"})
    assert r.returncode == 0, r.stderr
    assert "RuntimeWarning" not in r.stderr
    out = json.loads(r.stdout)
    assert out["stacks"][0]["host_bytes_per_layer"] == 603_979_776
    assert out["totals"]["host_bytes"] == 76_101_451_776
    assert out["offload"] == ["query_proj", "key_proj", "value_proj"]
    assert any("pinned host pool" in w for w in out["warnings"])


def test_cli_table_renders_whole_into_a_file(tmp_path):
    """`... > plan.txt`: the tables at their natural width (whatever COLUMNS says) and the warning on one line."""
    log = tmp_path / "plan.txt"
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, *PLAN], cwd=ROOT, stdout=f, stderr=subprocess.PIPE, text=True,
                           timeout=300, env={**os.environ, "COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    out = log.read_text()
    for text in ("query_proj", "512.0 MiB", "32.0 MiB", "576.0 MiB", "70.9 GiB", "not a residual"):
        assert text in out, text
    assert_unbroken(out, "│ layers │", "│ parameters (405,853,388,800)", "│ peak HBM of the step, estimate",
                    "warning: host memory 70.9 GiB is over XLA's pinned host pool ... before launch, or offload less")


def test_cli_auto_and_bad_input(capsys, monkeypatch):
    """--recipe auto through the command line (in this process: what it prints is all it does)."""
    monkeypatch.setenv("COLUMNS", "200")
    tiny = ["--model", "llama3", "--preset", "tiny", "--batch", "2", "--seq", "8"]
    assert plan_cli.main(tiny + ["--recipe", "auto", "--hbm", "1", "--link", "55", "--flops", "800"]) == 0
    out = capsys.readouterr().out
    assert "chosen:" in out and "kept in HBM" in out
    # Planning for a device kind with a measured link and a datasheet rate needs only the budget, as the main job's
    # --recipe auto (the flags' other spellings are the main job's: --hbm-limit, --peak-tflops).
    assert plan_cli.main(tiny + ["--recipe", "auto", "--device", "H200", "--hbm-limit", "1"]) == 0
    out = capsys.readouterr().out
    # recompute priced at the Llama step's measured rate on the H200 (the family's step_rates), not the datasheet's
    rate = zoo.plan.links.step_rate("H200", LLAMA_TINY).tflops
    assert "chosen:" in out and "55.3 GB/s" in out and f"{rate:g} TFLOP/s executed" in out


@pytest.mark.parametrize("args, needles", [
    (("--recipe", "auto", "--hbm", "1"), ("--recipe auto needs --link, --flops",)),
    (("--shard", "3"), ("--shard 3", "--batch 2")),
    (("--model", "gpt2"), ("--model 'gpt2' is not in the zoo; choose one of: deepseek_v3, llama3, qwen3, qwen3_moe",)),
    (("--model", "llama4"), ("--model 'llama4' is not in the zoo (did you mean llama3?); choose one of: deepseek_v3, "
                             "llama3, qwen3, qwen3_moe",)),
    (("--preset", "huge"), ("--preset 'huge' is not a llama3 preset; choose one of: ", "llama3_1_405b")),
    (("--preset", "tyni"), ("--preset 'tyni' is not a llama3 preset (did you mean tiny?); choose one of: ",)),
    (("--mesh", "fdsp=2"), ("unknown axis 'fdsp' (did you mean fsdp?)",)),
    (("--resume",), ("unrecognized arguments: --resume; `python -m recipes.train.plan --help` lists the flags",)),
    (("--recipe", "qkv"), ("--recipe 'qkv'", "qkv_offload")),
    (("--set", "tie_embeddings=maybe"), ("--set tie_embeddings=maybe", "must be a bool")),
    (("--set", "num_layer=3"), ("--set num_layer=3", "not a field of LlamaConfig")),
    (("--hbm", "-1"), ("--hbm", "positive")),
    (("--recipe", "context_tiles"), ("--recipe context_tiles cuts the sequence into 16 tiles", "--seq 8 is not",
                                     "give --seq 16, or --recipe context_save")),
])
def test_cli_errors_name_the_flags(args, needles, capsys):
    """Bad input is a usage error (exit 2) that names the flags, not Python keywords."""
    with pytest.raises(SystemExit) as e:
        plan_cli.main(["--model", "llama3", "--preset", "tiny", "--batch", "2", "--seq", "8", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err   # one line, no usage block
    for needle in needles:
        assert needle in err, (needle, err)


def test_cli_set_values_take_the_field_type(capsys):
    assert plan_cli.main(["--model", "llama3", "--preset", "tiny", "--batch", "2", "--seq", "8", "--recipe", "full",
                          "--set", "tie_embeddings=false", "--set", "num_layers=3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stacks"][0]["num_layers"] == 3
    three = dataclasses.replace(LLAMA_TINY, num_layers=3)
    untied, tied = (zoo.plan.plan(dataclasses.replace(three, tie_embeddings=t), LLAMA_RECIPES["full"], batch=2,
                                  seq=8).state.num_params for t in (False, True))
    assert tied < untied == out["model_state"]["num_params"]  # "false" is False: the LM head is its own


# -- --max-batch (zoo.plan.largest_batch: tests/plan/test_capacity.py) ------------------------------------------
def _peak(cfg, recipe, batch, seq):
    return zoo.plan.plan(cfg, recipe, batch=batch, seq=seq, peak="estimate",
                         training=Training(optimizer="sgd")).peak_bytes


def test_the_command_line_prints_the_largest_batch(capsys):
    seq, recipe = 64, LLAMA_RECIPES["full"]
    llama = registry.family("llama3").config("tiny")
    budget = _peak(llama, recipe, 2, seq) * 1.001 / GiB
    assert plan_cli.main(["--model", "llama3", "--preset", "tiny", "--recipe", "full", "--seq", str(seq),
                          "--optimizer", "sgd", "--max-batch", "--hbm", repr(budget)]) == 0
    out = capsys.readouterr().out
    assert "largest batch that fits: 2" in out
    rows = [line.split() for line in out.splitlines()[2:]]
    assert {int(r[0]): r[3] for r in rows} == {1: "yes", 2: "yes", 4: "no"}
    assert [f"{r[1]} {r[2]}" for r in rows] == [zoo.plan.fmt_bytes(_peak(llama, recipe, b, seq)) for b in (1, 2, 4)]
    assert plan_cli.main(["--model", "llama3", "--preset", "tiny", "--seq", "16"]) == 0   # --batch: train's 8
    assert "batch 8, seq 16" in capsys.readouterr().out
    with pytest.raises(SystemExit):   # --max-batch needs a budget on the CPU
        plan_cli.main(["--model", "llama3", "--preset", "tiny", "--seq", "16", "--max-batch"])
    assert "error: --hbm is needed" in capsys.readouterr().err   # the flag, not zoo.plan's hbm_gib


# -- the peak (zoo.plan.peak: tests/plan/test_peak.py) ----------------------------------------------------------
def test_the_plan_command_line_reports_the_peak_and_the_measured_link(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")   # one table row per line
    tiny = ["--model", "llama3", "--preset", "tiny", "--batch", "2", "--seq", "16"]
    assert plan_cli.main(tiny + ["--recipe", "qkv_offload", "--peak", "compile", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    d = out["peak"]["detail"]
    assert out["peak_source"] == "compiled for cpu"
    assert out["peak_bytes"] == d["argument"] + d["output"] - d["alias"] + d["temp"]
    assert plan_cli.main(tiny + ["--recipe", "auto", "--hbm", "1", "--flops", "800", "--device", "H200"]) == 0
    text = " ".join(capsys.readouterr().out.split())   # rich wraps lines at the terminal's width
    assert "overlap d2h 0.634 / h2d 0.475 (measured on H200" in text and "estimate (planned for H200 on cpu)" in text
    assert plan_cli.main(tiny + ["--recipe", "qkv_offload"]) == 0
    text = capsys.readouterr().out   # the flag, where Python reads `peak='compile'` (Plan.peak_source)
    assert "estimate (not compiled on the CPU: --peak compile does)" in text and "peak='compile'" not in text


# -- --mesh (zoo.plan.plan(parallel=Parallelism(mesh=...)): tests/plan/test_mesh_plan.py) ------------------------
def test_cli_mesh_prints_per_device_json_and_refuses_shard_with_mesh(capsys):
    """The plan of a mesh needs no devices (planned from shapes: this process's one CPU device plans fsdp=8)."""
    base = ["--model", "llama3", "--preset", "tiny", "--recipe", "qkv_offload", "--batch", "8", "--seq", "16"]
    assert plan_cli.main(base + ["--mesh", "fsdp=8", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = zoo.plan.plan(LLAMA_TINY, LLAMA_RECIPES["qkv_offload"], batch=8, seq=16).to_dict()
    assert got["mesh"] == "dp=1,fsdp=8,tp=1,ep=1"
    assert got["model_state"]["params"] * 8 == want["model_state"]["params"]
    assert got["totals"]["host_bytes"] * 8 == want["totals"]["host_bytes"]
    with pytest.raises(SystemExit) as e:
        plan_cli.main(base + ["--mesh", "fsdp=8", "--shard", "8"])
    assert e.value.code == 2 and "not both" in capsys.readouterr().err


# -- the families added as packages (their plans: tests/models/qwen3*/) -------------------------------------------
def test_the_planner_plans_the_qwen3_8b(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")   # the width of a pipe's output, as `python -m` prints to one
    assert plan_cli.main(["--model", "qwen3", "--preset", "qwen3_8b", "--recipe", "qkv_offload", "--batch", "1",
                          "--seq", "8192"]) == 0
    out = capsys.readouterr().out
    assert "parameters (8,190,735,360)" in out
    assert "1x8192x32x128" in out and "36 layers" in out


def test_the_planner_plans_qwen3_moe(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert plan_cli.main(["--model", "qwen3_moe", "--preset", "tiny", "--recipe", "qkv_moe_offload", "--batch", "2",
                          "--seq", "64"]) == 0
    out = capsys.readouterr().out
    assert "moe_mlpwi_0" in out and "query_proj" in out


def test_max_seq_prints_the_longest_and_refuses_what_does_not_apply(capsys):
    argv = ["--model", "llama3", "--preset", "tiny", "--set", "num_layers=1", "--recipe", "full", "--hbm", "1000",
            "--max-seq", "4096", "--peak", "estimate"]
    assert plan_cli.main(argv) == 0
    printed = capsys.readouterr()
    assert printed.out.startswith("llama3 tiny: longest sequence that fits: 4096 (the longest tried: may fit longer)")
    # each length on stderr as it is planned (a long step compiles for minutes before the answer)
    assert [line.split(":")[0] for line in printed.err.splitlines()] == ["planned 1024", "planned 2048", "planned 4096"]
    assert printed.err.splitlines()[-1].startswith("planned 4096: peak ") and ", fits (estimate" in printed.err
    with pytest.raises(SystemExit) as e:
        plan_cli.main(argv + ["--max-batch"])
    assert e.value.code == 2 and "give one of them" in capsys.readouterr().err
