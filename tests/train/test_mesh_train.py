"""The main job under a mesh: `python -m recipes.train --mesh ...` on fake CPU devices (each run a subprocess: the
device count is fixed when JAX starts).

- Llama tiny under fsdp=4 x tp=2 (8 devices) and DeepSeek-V3 tiny under fsdp=2 x ep=4 (8 devices; capacity
  dispatch with capacity_factor 4, so nothing drops and the result does not depend on the mesh) log the losses of
  `--mesh fsdp=1` (one device) over 3 steps: float32, relative error < 1e-5 (sums reduce in another order).
- A checkpoint written under fsdp=4 (4 devices) resumes under fsdp=2 x tp=2 (4 devices) and its step 3 has the
  loss of the uninterrupted one-device run (same tolerance); the record names the mesh it was written on.
- Llama tiny under fsdp=2 with --grad-accum 2 and --opt-state host logs the one-device losses (same tolerance).
- Bad meshes exit 2 before compiling, naming both numbers.
- Under fsdp=4 x tp=2 the main job plans its peak from its own compiled sharded step (tests/train/mesh_peaks.py).
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from tests.helpers import cpu_env

pytestmark = pytest.mark.multidevice

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOL = 1e-5
LLAMA = ["--model", "llama3", "--preset", "tiny", "--recipe", "qkv_offload", "--batch", "8", "--seq", "16",
         "--steps", "3", "--log-every", "1"]
DEEPSEEK = ["--model", "deepseek_v3", "--preset", "tiny", "--recipe", "mla_moe_offload", "--batch", "8", "--seq",
            "16", "--steps", "3", "--log-every", "1", "--set", "moe_backend=capacity", "--set", "capacity_factor=4.0"]


def train(args, devices: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recipes.train", *map(str, args)], env=cpu_env(devices), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def losses(metrics) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, open(metrics))}


def assert_close(got: dict[int, float], want: dict[int, float]):
    assert set(got) == set(want), (got, want)
    for k in want:
        assert abs(got[k] - want[k]) <= TOL * abs(want[k]), (k, got[k], want[k])


@pytest.fixture(scope="module")
def llama_one_device(tmp_path_factory):
    d = tmp_path_factory.mktemp("one")
    out = train(LLAMA + ["--mesh", "fsdp=1", "--metrics", d / "m.jsonl"], 1)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return losses(d / "m.jsonl")


@pytest.mark.slow   # the main job under meshes: the fsdp=4 -> fsdp=2,tp=2 resume test
def test_llama_fsdp_x_tp_logs_the_losses_of_one_device(tmp_path, llama_one_device):
    out = train(LLAMA + ["--mesh", "fsdp=4,tp=2", "--metrics", tmp_path / "m.jsonl"], 8)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "mesh dp=1,fsdp=4,tp=2,ep=1 over 8 device(s)" in out.stdout
    assert_close(losses(tmp_path / "m.jsonl"), llama_one_device)
    assert len(llama_one_device) == 3 and llama_one_device[3] < llama_one_device[1]
    # model TFLOP/s are per device (MFU holds them to one device's peak): the same model FLOPs per token, over 8
    from flax import nnx

    from zoo.models.registry import family
    fam = family("llama3")
    cfg = fam.config("tiny")
    want = fam.flops_per_token(cfg, fam.build(cfg, rngs=nnx.Rngs(0)), 16)
    for r in map(json.loads, open(tmp_path / "m.jsonl")):
        assert 8 * r["model_tflops"] * 1e12 / r["tokens_per_s"] == pytest.approx(want, rel=1e-6), r


@pytest.mark.slow   # DeepSeek-V3 under ep: test_expert_parallel.py's ep=2 step
def test_deepseek_fsdp_x_ep_logs_the_losses_of_one_device(tmp_path):
    got = {}
    for mesh, devices in (("fsdp=1", 1), ("fsdp=2,ep=4", 8)):
        out = train(DEEPSEEK + ["--mesh", mesh, "--metrics", tmp_path / f"{devices}.jsonl"], devices)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        got[mesh] = losses(tmp_path / f"{devices}.jsonl")
    assert len(got["fsdp=1"]) == 3
    assert_close(got["fsdp=2,ep=4"], got["fsdp=1"])


@pytest.mark.slow
def test_checkpoint_written_under_fsdp4_resumes_under_fsdp2_tp2(tmp_path, llama_one_device):
    run = LLAMA + ["--ckpt-dir", tmp_path / "ckpt", "--ckpt-every", 2, "--metrics", tmp_path / "m.jsonl"]
    out = train(run + ["--mesh", "fsdp=4", "--stop-after", 2], 4)
    assert out.returncode == 0 and "last checkpoint: 2" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    record = json.load(open(tmp_path / "ckpt" / "2" / "record" / "metadata"))
    assert record["mesh"] == "dp=1,fsdp=4,tp=1,ep=1" and "mesh" not in record["run"]
    out = train(run + ["--mesh", "fsdp=2,tp=2", "--resume"], 4)
    assert out.returncode == 0 and "at step 2" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    assert_close(losses(tmp_path / "m.jsonl"), llama_one_device)


@pytest.mark.parametrize("mesh,devices,message", [
    ("tp=3", 1, "the product of the axes is 3, but there are 1 devices"),
    ("fsdp=2,pp=1", 1, "unknown axis 'pp'"),
    ("tp=8", 8, "tp=8 does not divide LlamaConfig.num_heads=4"),
    ("fsdp=8", 8, None),   # batch 4 over 8 data shards
])
def test_bad_meshes_exit_2_naming_both_numbers(mesh, devices, message, tmp_path):
    args = LLAMA + ["--mesh", mesh, "--ckpt-dir", tmp_path / "ckpt"]
    if message is None:
        args += ["--batch", "4"]
        message = "the batch 4 is not divisible by dp x fsdp x ep = 8"
    out = train(args, devices)
    assert out.returncode == 2 and message in out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
    assert "compiled" not in out.stdout and not (tmp_path / "ckpt").exists()


def test_micro_batches_and_host_state_under_fsdp_match_one_device(llama_one_device, tmp_path):
    """fsdp=2 with --grad-accum 2 (micro-batches of 4, 2 rows per device) and --opt-state host (the moments'
    shards in pinned host memory) logs the losses of the one-device run of whole batches in HBM."""
    out = train(LLAMA + ["--mesh", "fsdp=2", "--grad-accum", "2", "--opt-state", "host", "--metrics",
                         tmp_path / "m.jsonl"], 2)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert_close(losses(tmp_path / "m.jsonl"), llama_one_device)


@pytest.mark.slow   # a mesh's case of the main job's compiled peak (tests/train/test_fit.py has one device's)
def test_the_main_job_plans_its_peak_from_its_compiled_sharded_step():
    """fsdp=4 x tp=2 on 8 fake devices (tests/train/mesh_peaks.py): the job's plan is its own compiled step's, per
    device, and the planner compiles the same program."""
    out = subprocess.run([sys.executable, "-m", "tests.train.mesh_peaks"], env=cpu_env(8), cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout[-3000:] + out.stderr[-3000:]
