"""The benchmark runner: every measurement of bench/ as a scenario, a list of jobs (a bench module or plain-JAX
anchor script, its recipe, backend, mesh, XLA setting, the GPUs it runs on, its time estimate), run one process
per job, most important first, stopping before a deadline.

    python -m bench.run SCENARIO [ANCHOR_DIR] OUT_DIR [--deadline 540] [--only REGEX] [--smoke] [--list]

The plain-JAX baselines are `bench.baselines` (impl "anchor" in the records); ANCHOR_DIR (default `.anchor`) is
where a job given as `{anchor}/SCRIPT` finds its script. Each job runs in its own process
(XLA reads its flags once) with a timeout; a setting is the process's `XLA_FLAGS` plus the compile options of the
zoo's step (`BENCH_OPTIONS`; `zoo`: the library's own choice, `zoo.compile_options`). Jobs compared with each other
run on the same GPU, in sequence (two GPUs of one machine may share a PCIe switch, so only one queue offloads a lot
at a time where the ratio matters); a scenario with a job on several GPUs runs all its jobs in one queue. A job
starts only if its estimate fits before the deadline. `NCCL_NVLS_ENABLE=0` for every job (NVLink multicast off).

Writes OUT_DIR/results.jsonl (every record of every job in the schema of `bench.records`, with the job's `job`,
`scenario`, `setting`, `gpu_index`, `wall_s` in its extras), OUT_DIR/logs/JOB.log, OUT_DIR/work/JOB/ (a job's own
files: the main job's train.log and metrics) and OUT_DIR/summary.md (`bench.report`). `--smoke`: the same jobs on
tiny shapes on the CPU (fake devices for a mesh), which checks the scenario and the benches, not the figures.
`--list`: the jobs, not run.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.metadata
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time

from bench import records

LHS = "--xla_gpu_enable_latency_hiding_scheduler=true"
AUTOTUNE_CACHE = "--xla_gpu_per_fusion_autotune_cache_dir=/tmp/zoo-autotune"  # later compiles reuse the tuning
CB_OFF = "--xla_gpu_enable_command_buffer="
DOUBLE_BUFFER = "--xla_gpu_enable_while_loop_double_buffering=true"
PIPELINED = "--xla_gpu_enable_pipelined_host_offloading=true"
# setting -> (XLA_FLAGS, BENCH_OPTIONS: the zoo step's compile options as JSON; None: the library's choice)
SETTINGS = {
    "zoo": (LHS, None),
    "defaults": (LHS, "{}"),
    "concurrent": (LHS, json.dumps({"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"})),
    "cb_off_flags": (f"{LHS} {CB_OFF}", "{}"),
    "double_buffer": (f"{LHS} {DOUBLE_BUFFER}", None),
    "pipelined": (f"{LHS} {PIPELINED}", None),
    "pipelined_db": (f"{LHS} {PIPELINED} {DOUBLE_BUFFER}", None),
}
# the plain-JAX anchors' settings: XLA_FLAGS only (they compile with XLA's default options)
ANCHOR_FLAGS = {"lhs": LHS, "cb_off": f"{LHS} {CB_OFF}", "cb_off_db": f"{LHS} {CB_OFF} {DOUBLE_BUFFER}",
                "pipelined": f"{LHS} {PIPELINED}", "double_buffer": f"{LHS} {DOUBLE_BUFFER}"}
STREAM_ANNOTATION = "--xla_gpu_experimental_stream_annotation=true"
SELECTIVE_MEMCPY = "--xla_gpu_experimental_enable_selective_memcpy_overlap=true"

# The benches a job may run (`python -m bench.X`, or `recipes.train` itself), and the anchor scripts.
BENCHES = ("bench.overlap_slice", "bench.llama_slice", "bench.deepseek_slice", "bench.main_job_8b",
           "bench.capacity_sweep", "bench.step_cost", "bench.stream_probe", "bench.tokamax_tiles",
           "bench.profile_step", "bench.loss_curve", "bench.stack_depth", "bench.ctx_slice", "bench.plan_probe",
           "recipes.train")
ANCHORS = ("bench.baselines.plain_jax_llama", "bench.baselines.plain_jax_llama_fsdp",
           "bench.baselines.plain_jax_deepseek", "plain_jax_llama_ctx.py")
TAKES_SMOKE = ("bench.overlap_slice", "bench.llama_slice", "bench.deepseek_slice", "bench.main_job_8b",
               "bench.plan_probe", "bench.ctx_slice", "bench.capacity_sweep", "bench.step_cost", "bench.loss_curve",
               "bench.stack_depth")


@dataclasses.dataclass(frozen=True)
class Job:
    """One process. `argv` follows the Python executable: `-m MODULE ...` or `{anchor}/SCRIPT ...`; `{anchor}`,
    `{out}` and `{work}` (OUT_DIR/work/JOB) in `argv` and `env` are filled in at run time. `gpus`: the GPU
    indices it must run on ("0", "0,1"; None: any one), `devices` how many it needs. `anchor`: the schema fields
    of a plain-JAX anchor's record (its JSON line is turned into a record by `bench.anchor_record`). `expect_rc`:
    the exit status that means the job did what it should (2: the main job refused a step before launch).
    `requires`: a file an earlier job writes (skipped without it); `files`: files written before it starts.
    `smoke_argv` replaces the generic smoke form (`smoke`); `gpu_only`: skipped in smoke form."""
    name: str
    argv: tuple[str, ...]
    flags: str
    est_s: float
    timeout_s: float
    env: dict = dataclasses.field(default_factory=dict)
    ident: dict = dataclasses.field(default_factory=dict)
    gpus: str | None = None
    devices: int = 1
    anchor: dict | None = None
    expect_rc: int = 0
    requires: str | None = None
    files: dict = dataclasses.field(default_factory=dict)
    smoke_argv: tuple[str, ...] | None = None
    gpu_only: bool = False

    @property
    def program(self) -> str:
        """The bench module or the anchor script this job runs."""
        return self.argv[1] if self.argv[0] == "-m" else os.path.basename(self.argv[0])


@dataclasses.dataclass(frozen=True)
class Scenario:
    what: str            # what it measures, one line
    jobs: tuple[Job, ...]


# ------------------------------------------------------------------------------------------------ job builders

def _setting_env(setting: str, plan_peak: bool = False) -> tuple[str, dict]:
    """XLA_FLAGS and the env of a zoo bench under `setting`; without `plan_peak` the record's planned figures skip
    the compile of the planner's peak (the settings' sweeps compare steps, not the prediction)."""
    flags, options = SETTINGS[setting]
    return flags, {**({} if plan_peak else {"BENCH_PLAN_PEAK": "none"}),
                   **({} if options is None else {"BENCH_OPTIONS": options})}


def zoo(recipe, shape="405b", layers=3, batch=2, setting="zoo", extra=(), est=75, gpu=None) -> Job:
    """bench.overlap_slice: a Llama slice of the 405B (or 8B) preset, 4 timed steps."""
    flags, env = _setting_env(setting)
    chunks = extra[extra.index("--mlp-chunks") + 1] if "--mlp-chunks" in extra else "1"
    return Job(f"zoo-{shape}-L{layers}-B{batch}-{recipe}-{setting}" + ("" if chunks == "1" else f"-mlp{chunks}"),
               ("-m", "bench.overlap_slice", recipe, "--shape", shape, "--layers", str(layers), "--batch", str(batch),
                "--steps", "4", *extra), flags, est, 200, env=env,
               ident={"bench": f"llama{shape}-slice", "impl": "zoo", "recipe": recipe, "setting": setting}, gpus=gpu)


def llama(recipe, batch=2, mesh=None, steps=None, est=110, timeout=170, gpu=None) -> Job:
    """bench.llama_slice: the 405B preset cut to 3 layers, seq 8192, optionally sharded over `mesh`."""
    devices = 1 if mesh is None else _mesh_size(mesh)
    return Job(f"llama405b-B{batch}-{recipe}" + (f"-{mesh}" if mesh else ""),
               ("-m", "bench.llama_slice", recipe, "--batch", str(batch),
                *(("--mesh", mesh) if mesh else ()), *(("--steps", str(steps)) if steps else ())),
               LHS, est, timeout, ident={"bench": "llama405b-slice", "impl": "zoo", "recipe": recipe,
                                         "setting": "zoo"},
               gpus=gpu or (None if devices == 1 else ",".join(map(str, range(devices)))), devices=devices)


def deepseek(recipe, backend="capacity", batch=4, setting="zoo", extra=(), est=75, timeout=200, gpu=None,
             name=None, env=None, requires=None, files=None, plan_peak=True) -> Job:
    """bench.deepseek_slice: DeepSeek-V3 cut to 1 dense + 3 MoE layers, 16 experts, seq 4096, 4 timed steps."""
    flags, senv = _setting_env(setting, plan_peak)
    mesh = extra[extra.index("--mesh") + 1] if "--mesh" in extra else None
    devices = 1 if mesh is None else _mesh_size(mesh)
    name = name or (f"deepseek-{backend}-B{batch}-{recipe}" + ("" if setting == "zoo" else f"-{setting}")
                    + (f"-{mesh}" if mesh else ""))
    return Job(name, ("-m", "bench.deepseek_slice", recipe, "--backend", backend, "--batch", str(batch),
                      "--steps", "4", *extra), flags, est, timeout, env={**senv, **(env or {})},
               ident={"bench": "deepseek-slice", "impl": "zoo", "recipe": recipe, "setting": setting},
               gpus=gpu or (None if devices == 1 else ",".join(map(str, range(devices)))), devices=devices,
               requires=requires, files=files or {})


def anchor(policy, shape="405b", layers=3, batch=2, flags="lhs", est=60, timeout=150, gpu=None) -> Job:
    """bench.baselines.plain_jax_llama: the plain-JAX Llama baseline (no embedding or head), seq 8192."""
    return Job(f"anchor-{shape}-L{layers}-B{batch}-{policy}-{flags}",
               ("-m", "bench.baselines.plain_jax_llama", policy, str(batch)), ANCHOR_FLAGS[flags], est, timeout,
               env={"SHAPE": shape, "NL": str(layers)},
               ident={"bench": f"llama{shape}-slice", "impl": "anchor", "recipe": policy, "setting": flags},
               anchor={"bench": f"llama{shape}-slice", "S": 8192, "backend": "none"}, gpus=gpu)


def anchor_fsdp(policy, est=60, timeout=75) -> Job:
    """bench.baselines.plain_jax_llama_fsdp on two GPUs: the 405B layer, 3 layers, batch 2 per GPU."""
    return Job(f"anchor-fsdp-405b-L3-{policy}", ("-m", "bench.baselines.plain_jax_llama_fsdp", policy, "2"), LHS, est,
               timeout, env={"SHAPE": "405b", "NL": "3"},
               ident={"bench": "llama405b-slice", "impl": "anchor", "recipe": policy, "setting": "lhs"},
               anchor={"bench": "llama405b-slice", "S": 8192, "backend": "none", "mesh": "fsdp=2"}, gpus="0,1",
               devices=2)


def anchor_deepseek(policy, batch=4, est=70, timeout=110, gpu=None) -> Job:
    """bench.baselines.plain_jax_deepseek: the plain-JAX DeepSeek baseline, 3 MoE layers of 16 experts, ragged_dot
    dispatch."""
    return Job(f"anchor-deepseek-B{batch}-{policy}", ("-m", "bench.baselines.plain_jax_deepseek", policy, str(batch)),
               LHS, est, timeout, env={"E": "16", "NL": "3"},
               ident={"bench": "deepseek-slice", "impl": "anchor", "recipe": policy, "setting": "lhs"},
               anchor={"bench": "deepseek-slice", "S": 4096, "backend": "ragged_dot"}, gpus=gpu)


def ctx(recipe, seq, layers, family="llama3", est=45, timeout=150, gpu="0", batch=1) -> Job:
    """bench.ctx_slice: the zoo's decoder stack alone (8B-shaped Llama layers, 32B-shaped Qwen3 layers, or the
    DeepSeek slice's), batch 1 unless `batch`."""
    return Job(f"ctx-{family}-S{seq // 1024}K-L{layers}" + (f"-B{batch}" if batch > 1 else "") + f"-{recipe}",
               ("-m", "bench.ctx_slice", recipe, "--family", family, "--seq", str(seq), "--layers", str(layers),
                "--batch", str(batch)),
               LHS, est, timeout, ident={"bench": f"{family}-ctx-slice", "impl": "zoo", "recipe": recipe,
                                         "setting": "zoo"}, gpus=gpu)


def anchor_ctx(policy, seq, layers, est=40, timeout=150, gpu="0") -> Job:
    """plain_jax_llama_ctx.py: the plain-JAX long-context baseline (8B-shaped layers, batch 1); command buffers off
    for the policies that offload, as the zoo's step compiles them."""
    flags = "cb_off" if "offload" in policy else "lhs"
    return Job(f"anchor-ctx-S{seq // 1024}K-L{layers}-{policy}", ("{anchor}/plain_jax_llama_ctx.py", policy, "1"),
               ANCHOR_FLAGS[flags], est, timeout, env={"SEQ": str(seq), "NL": str(layers)},
               ident={"bench": "llama3-ctx-slice", "impl": "anchor", "recipe": policy, "setting": flags},
               anchor={"bench": "llama3-ctx-slice", "S": seq, "backend": "none"}, gpus=gpu)


def main_job(recipe, extra=(), steps=12, est=110, timeout=200, gpu=None, name=None, env=None) -> Job:
    """bench.main_job_8b main: `python -m recipes.train` on the 8B preset cut to 8 layers, AdamW."""
    return Job(name or f"main-job-8b-{recipe}",
               ("-m", "bench.main_job_8b", "main", "--recipe", recipe, "--steps", str(steps), "--workdir", "{work}",
                "--timeout", str(timeout - 20), *extra), LHS, est, timeout, env=env or {},
               ident={"bench": "main-job-8b", "impl": "zoo", "program": "main-job", "recipe": recipe, "setting": "zoo",
                      "log": "{work}/train.log"}, gpus=gpu)


def sgd_twin(recipe, est=60, timeout=90, gpu=None) -> Job:
    """bench.main_job_8b sgd: the same model under the benches' SGD step (bf16 parameters, no clipping)."""
    return Job(f"sgd-8b-{recipe}", ("-m", "bench.main_job_8b", "sgd", "--recipe", recipe), LHS, est, timeout,
               ident={"bench": "main-job-8b", "impl": "zoo", "program": "sgd-bench", "recipe": recipe,
                      "setting": "zoo"}, gpus=gpu)


def capacity(recipe, start, est=240, timeout=300, gpu=None) -> Job:
    """bench.capacity_sweep: the planner's largest batch, then the real step at it and at twice it."""
    return Job(f"capacity-{recipe}", ("-m", "bench.capacity_sweep", recipe, "--start", str(start), "--backend",
                                      "capacity", "--deadline", str(timeout - 10)), LHS, est, timeout,
               env={"JAX_COMPILATION_CACHE_DIR": "{work}/jit-cache"},
               ident={"bench": "capacity-sweep", "impl": "zoo", "recipe": recipe, "setting": "zoo"}, gpus=gpu)


def profile(recipe, flags="lhs", gpu=None, est=120, timeout=170) -> Job:
    """bench.profile_step: a profiled step of the 405B slice (3 layers, batch 2) and the trace's summary."""
    return Job(f"profile-405b-{recipe}-{flags}", ("-m", "bench.profile_step", recipe, "--shape", "405b",
                                                  "--layers", "3", "--out", "{work}/trace"),
               ANCHOR_FLAGS[flags], est, timeout,
               ident={"bench": "profile", "impl": "zoo", "recipe": recipe, "setting": flags}, gpus=gpu,
               smoke_argv=("-m", "bench.profile_step", recipe, "--shape", "tiny", "--layers", "2", "--seq", "64",
                           "--out", "{work}/trace"))


def stream_probe(variant, flags="", label="plain") -> Job:
    """bench.stream_probe: a chain of matmuls whose outputs go to the host and back, under XLA's stream options."""
    return Job(f"stream-probe-{variant}-{label}", ("-m", "bench.stream_probe", variant, "--out", "{work}/trace"),
               flags, 45, 90, ident={"bench": "stream-probe", "setting": label}, gpus="0",
               smoke_argv=("-m", "bench.stream_probe", variant, "--n", "2", "--m", "128", "--k", "128", "--out",
                           "{work}/trace"))


def probe(recipes, seq=None, longest=None, est=120, timeout=300) -> Job:
    """bench.plan_probe: the 8B's step (32 layers, batch 1, state on the host) compiled for the GPU at `seq` under
    each recipe of `recipes`, or zoo.plan.longest_seq's answer up to `longest`; nothing runs."""
    what = ("--longest", str(longest)) if longest else ("--seq", str(seq))
    return Job(f"plan-probe-{'longest-' if longest else ''}{(longest or seq) // 1024}K-{'-'.join(recipes)}",
               ("-m", "bench.plan_probe", *what, *(a for r in recipes for a in ("--recipe", r))), LHS, est, timeout,
               env=_LONG_ENV, ident={"bench": "plan-probe", "impl": "zoo", "recipe": recipes[0], "setting": "zoo"},
               gpus="0", smoke_argv=("-m", "bench.plan_probe", "--seq", "256", "--recipe", recipes[0], "--smoke"))


def _mesh_size(mesh: str) -> int:
    n = 1
    for axis in mesh.split(","):
        n *= int(axis.split("=")[1])
    return n


# --------------------------------------------------------------------------------------------------- scenarios

_PROF = ("--hlo", "--profile", "{work}/trace")
_CH = {n: ("--mlp-chunks", str(n)) for n in (2, 4, 8)}
_PGLE = ("--pgle",)
_CAPACITY_START = {"full": 16, "save_mla_moe": 8, "mla_moe_offload": 8, "lowrank_wa_offload": 8}
_EP2 = ("--mesh", "ep=2", "--experts", "32")
_OPT_STATE_ENV = {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".95", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "80"}
# The longest contexts: the allocator's share of the GPU raised, and a pinned pool for the state (60 GiB) and the
# offloaded layer inputs, within the machine's 128 GiB of RAM.
_LONG_ENV = {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".95", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "110"}
_HOST_STATE = ("--opt-state", "host", "--opt-dtype", "bfloat16", "--param-dtype", "bfloat16", "--params", "host")


def long_job(recipe, seq, layers=32, steps=3, est=300, timeout=420, extra=()) -> Job:
    """The main job on the 8B preset at `seq` (batch 1), bf16 parameters with their float32 master and AdamW's bf16
    moments in pinned host memory."""
    sets = ("--train-arg=--set=max_seq_len=" + str(seq),) if seq > 131072 else ()
    return main_job(recipe, ("--layers", str(layers), "--batch", "1", "--seq", str(seq), *_HOST_STATE, *sets, *extra),
                    steps=steps, est=est, timeout=timeout, gpu="0",
                    name=f"main-job-8b-L{layers}-S{seq // 1024}K-{recipe}", env=_LONG_ENV)
_TILES = "{out}/tiles.json"
_NO_TILES = "{out}/no-tiles.json"
_NO_TILES_FILE = {_NO_TILES: "{}"}   # an empty tile table: tokamax's own configuration (zoo.layers.grouped_matmul)


def _sweep_deepseek(recipe, **kw) -> Job:
    return deepseek(recipe, plan_peak=False, **kw)


SCENARIOS: dict[str, Scenario] = {
    "settings": Scenario(
        "offload against saving and recomputing under XLA settings: the 405B slice's ratios on GPU 0 (each pair on "
        "one chip), the settings, depth and the DeepSeek slice on GPU 1, the plain-JAX anchor beside them",
        (zoo("qkv_offload", gpu="0"), zoo("save_qkv", gpu="0"),
         zoo("minimal_offload", extra=_PROF, est=90, gpu="0"), zoo("minimal", gpu="0"), zoo("full", gpu="0"),
         anchor("offload_minimal", flags="cb_off", gpu="0"), anchor("minimal", gpu="0"),
         zoo("minimal_offload", setting="defaults", gpu="0"),
         zoo("minimal_offload", setting="concurrent", gpu="1"),
         zoo("minimal_offload", layers=6, batch=1, est=90, gpu="1"), zoo("full", layers=6, batch=1, est=90, gpu="1"),
         anchor("offload_minimal", layers=6, batch=1, flags="cb_off", est=70, gpu="1"),
         _sweep_deepseek("full", gpu="1"), _sweep_deepseek("mla_moe_offload", est=85, gpu="1"),
         _sweep_deepseek("lowrank_wa_offload", gpu="1"), _sweep_deepseek("save_mla_moe", gpu="1"),
         _sweep_deepseek("auto", gpu="1"),
         anchor("full", gpu="0"))),
    "auto": Scenario(
        "the recipe `auto` picks against the fixed ones: the main job on GPU 0, the DeepSeek slice on GPU 1",
        (main_job("qkv_offload", timeout=260, gpu="0"), main_job("save_qkv", timeout=260, gpu="0"),
         main_job("auto", timeout=260, gpu="0"),
         _sweep_deepseek("save_mla_moe", gpu="1"), _sweep_deepseek("mla_moe_offload", gpu="1"),
         _sweep_deepseek("auto", gpu="1"),
         _sweep_deepseek("full", gpu="1"))),
    "double-buffer": Scenario(
        "where the rest of the copy time goes (profiles, compiled ops) and XLA's while-loop double buffering",
        (zoo("minimal_offload", extra=_PROF, est=90, gpu="0"), zoo("minimal_offload", setting="double_buffer", gpu="0"),
         zoo("minimal", gpu="0"), anchor("offload_minimal", flags="cb_off_db", gpu="0"),
         zoo("minimal_offload", layers=6, batch=1, extra=_PROF, est=90, gpu="1"),
         zoo("minimal_offload", layers=6, batch=1, setting="double_buffer", est=90, gpu="1"),
         zoo("qkv_offload", setting="double_buffer", gpu="1"))),
    "pipelined": Scenario(
        "XLA's pipelined host offloading (copies off the compute stream), with and without double buffering",
        (zoo("minimal_offload", setting="pipelined", gpu="0"), zoo("minimal_offload", setting="pipelined_db", gpu="0"),
         zoo("qkv_offload", setting="pipelined", gpu="0"),
         zoo("minimal_offload", layers=6, batch=1, setting="pipelined", est=90, gpu="1"),
         zoo("minimal_offload", layers=6, batch=1, setting="pipelined_db", est=90, gpu="1"),
         zoo("save_qkv", setting="pipelined", gpu="1"))),
    "pgle": Scenario(
        "the same programs compiled again from a profile of their own steps (profile-guided latency estimation)",
        (zoo("minimal_offload", extra=_PGLE, est=100, gpu="0"), zoo("minimal", extra=_PGLE, est=90, gpu="0"),
         zoo("full", extra=_PGLE, est=90, gpu="0"),
         zoo("qkv_offload", extra=_PGLE, est=90, gpu="1"), zoo("save_qkv", extra=_PGLE, est=90, gpu="1"),
         zoo("minimal_offload", layers=6, batch=1, extra=_PGLE, est=100, gpu="1"),
         zoo("full", layers=6, batch=1, extra=_PGLE, est=90, gpu="1"))),
    "chunks": Scenario(
        "the MLP in sequence chunks (the gate/up copies start before the layer ends), beside minimal, full and the "
        "plain-JAX anchor, on one GPU, in the order of importance",
        (zoo("minimal", est=60, gpu="0"), zoo("minimal_offload", extra=_CH[4], est=50, gpu="0"),
         zoo("minimal_offload", est=50, gpu="0"), zoo("full", est=40, gpu="0"),
         zoo("minimal_offload", extra=_CH[2], est=50, gpu="0"), zoo("minimal_offload", extra=_CH[8], est=50, gpu="0"),
         anchor("offload_minimal", flags="cb_off", est=40, gpu="0"), anchor("minimal", est=35, gpu="0"),
         zoo("minimal_offload", layers=6, batch=1, extra=_CH[4], est=60, gpu="0"),
         zoo("full", layers=6, batch=1, est=45, gpu="0"),
         zoo("qkv_offload", extra=_CH[4], est=45, gpu="0"), zoo("save_qkv", est=35, gpu="0"),
         zoo("minimal", extra=_CH[4], est=35, gpu="0"),
         zoo("minimal_offload", layers=6, batch=1, extra=_CH[2], est=60, gpu="0"),
         zoo("minimal_offload", layers=6, batch=1, est=60, gpu="0"),
         zoo("minimal", extra=_CH[2], est=35, gpu="0"))),
    "chunks-pgle": Scenario(
        "the two-chunk MLP under profile-guided latency estimation (each PGLE job times the step before and after "
        "the recompile) and under XLA's while-loop double buffering, at 6 layers B1 and 3 layers B2, beside full, "
        "minimal and the plain-JAX anchor, on one GPU in the order of importance",
        (zoo("full", layers=6, batch=1, est=50, gpu="0"),
         zoo("minimal_offload", layers=6, batch=1, extra=(*_CH[2], *_PGLE), est=120, gpu="0"),
         zoo("minimal", est=60, gpu="0"), zoo("full", est=45, gpu="0"),
         zoo("minimal_offload", extra=(*_CH[2], *_PGLE), est=110, gpu="0"),
         anchor("offload_minimal", flags="cb_off", est=40, gpu="0"), anchor("minimal", est=35, gpu="0"),
         zoo("minimal_offload", layers=6, batch=1, setting="double_buffer", extra=_CH[2], est=60, gpu="0"))),
    "llama": Scenario(
        "the 405B slice under full remat, save_qkv and qkv_offload beside the plain-JAX anchor",
        (*(llama(r, gpu="0") for r in ("full", "save_qkv", "qkv_offload")),
         *(anchor(p, est=70, gpu="0") for p in ("full", "offload_qkv")))),
    "deepseek-ragged": Scenario(
        "the DeepSeek slice with jax.lax.ragged_dot dispatch beside the plain-JAX anchor (same dispatch)",
        (anchor_deepseek("full", gpu="0"), deepseek("full", "ragged_dot", timeout=110, gpu="0"),
         anchor_deepseek("mla_moe_offload", gpu="0"), deepseek("mla_moe_offload", "ragged_dot", timeout=110, gpu="0"),
         deepseek("lowrank_wa_offload", "ragged_dot", timeout=110, gpu="0"),
         anchor_deepseek("lowrank_offload", gpu="0"))),
    "deepseek-capacity": Scenario(
        "the DeepSeek slice's recipes with capacity dispatch (a batched einsum), and ragged_dot at batch 2 for scale",
        (*(deepseek(r, timeout=110, gpu="0") for r in ("full", "mla_moe_offload", "lowrank_wa_offload",
                                                        "save_mla_moe")),
         deepseek("mla_moe_offload", batch=8, timeout=110, gpu="0"),
         deepseek("full", "ragged_dot", batch=2, timeout=110, gpu="0"))),
    "deepseek-side-by-side": Scenario(
        "the DeepSeek slice with capacity dispatch beside the plain-JAX anchor, in one call",
        (anchor_deepseek("full", gpu="0"), deepseek("full", timeout=110, gpu="0"),
         deepseek("mla_moe_offload", timeout=110, gpu="0"))),
    "deepseek-ep2": Scenario(
        "expert parallelism on two GPUs (32 experts, batch 8: each GPU's share as on one): capacity `full`, "
        "dropless tokamax (ragged all-to-all) `full` and `mla_moe_offload`",
        (deepseek("full", batch=8, extra=_EP2, timeout=180),
         deepseek("full", "tokamax", batch=8, extra=(*_EP2, "--ep-dispatch", "ragged_a2a"), timeout=180),
         deepseek("mla_moe_offload", "tokamax", batch=8, extra=(*_EP2, "--ep-dispatch", "ragged_a2a"),
                  timeout=180))),
    "deepseek-ep2-one": Scenario(
        "the model and batch of deepseek-ep2, dropless, on GPU 0 alone (the loss the ep=2 dropless runs should equal)",
        (deepseek("full", "tokamax", batch=8, extra=("--experts", "32"), est=150, timeout=300, gpu="0"),)),
    "fsdp": Scenario(
        "sharded training on two GPUs against the plain-JAX FSDP anchor, expert parallelism, and the one-GPU run "
        "of the same code path (weak scaling)",
        (*(anchor_fsdp(p) for p in ("full", "save_qkv", "offload_qkv")),
         *(llama(r, batch=4, mesh="fsdp=2", steps=4, est=80, timeout=100) for r in ("full", "save_qkv",
                                                                                     "qkv_offload")),
         *(deepseek(r, batch=8, extra=_EP2, est=70, timeout=80) for r in ("full", "mla_moe_offload")),
         llama("full", batch=2, mesh="fsdp=1", steps=4, est=80, timeout=100, gpu="0"))),
    "dropless": Scenario(
        "the DeepSeek slice's dropless tokamax against capacity dispatch and each offload recipe's host bytes, the "
        "plain-JAX anchor beside it; the main job beside the SGD bench of the same model",
        (deepseek("full", "tokamax", timeout=100), deepseek("full", timeout=90),
         deepseek("mla_moe_offload", "tokamax", timeout=90), main_job("qkv_offload", est=150, timeout=180),
         sgd_twin("qkv_offload", timeout=80), anchor_deepseek("full", timeout=90),
         *(deepseek(r, "tokamax", timeout=90) for r in ("lowrank_wa_offload", "lowrank_offload", "save_mla_moe")))),
    "tokamax-tiles": Scenario(
        "tokamax's grouped-matmul tiles per problem of the DeepSeek slice's MoE layer, then the slice with the "
        "fastest tiles, with tokamax's own choice and with capacity dispatch",
        (Job("tokamax-tiles", ("-m", "bench.tokamax_tiles", "--out", _TILES), LHS, 200, 240,
             ident={"bench": "tokamax-tiles", "setting": "zoo"}, gpus="0", gpu_only=True),
         deepseek("full", "tokamax", timeout=100, gpu="0", name="deepseek-tokamax-B4-full-measured-tiles",
                  env={"ZOO_TOKAMAX_TILES": _TILES}, requires=_TILES),
         deepseek("full", timeout=90, gpu="0"),
         deepseek("full", "tokamax", timeout=100, gpu="0", name="deepseek-tokamax-B4-full-tokamax-choice",
                  env={"ZOO_TOKAMAX_TILES": _NO_TILES}, files=_NO_TILES_FILE),
         deepseek("lowrank_offload", "tokamax", timeout=100, gpu="0", name="deepseek-tokamax-B4-lowrank_offload-"
                  "measured-tiles", env={"ZOO_TOKAMAX_TILES": _TILES}, requires=_TILES))),
    "deepseek-auto": Scenario(
        "the DeepSeek slice with the zoo's built-in tiles: tokamax against capacity dispatch, the recipe `auto` "
        "picks, and the other recipes on the same backend",
        (deepseek("full", "tokamax", est=110, timeout=150, gpu="0"), deepseek("full", est=100, timeout=130, gpu="0"),
         deepseek("auto", "tokamax", est=110, timeout=150, gpu="0"),
         *(deepseek(r, "tokamax", est=100, timeout=130, gpu="0")
           for r in ("save_mla_moe", "lowrank_offload", "mla_moe_offload", "lowrank_wa_offload")),
         deepseek("full", "tokamax", est=100, timeout=130, gpu="0", name="deepseek-tokamax-B4-full-tokamax-choice",
                  env={"ZOO_TOKAMAX_TILES": _NO_TILES}, files=_NO_TILES_FILE))),
    "step-cost": Scenario(
        "the main job's step by NaN-guard variant, the main job and its SGD twin, the plain-JAX 8B anchor",
        (*(Job(f"step-cost-{v}", ("-m", "bench.step_cost", "--recipe", "qkv_offload", "--variants", v), LHS, 80,
               110, ident={"bench": "step-cost", "setting": "zoo"}, gpus="0")
           for v in ("guard_lr", "guard_exact", "no_guard")),
         main_job("qkv_offload", est=150, timeout=200, gpu="0"), sgd_twin("qkv_offload", gpu="0"),
         *(anchor(p, shape="8b", layers=8, est=50, timeout=80, gpu="0") for p in ("full", "offload_qkv")))),
    "main-job": Scenario(
        "the main job (AdamW, 8B preset cut to 8 layers) under each recipe beside its SGD twin, and `--recipe auto`",
        (*(j for r in ("qkv_offload", "save_qkv", "none")
           for j in (main_job(r, est=120, timeout=170, gpu="0"), sgd_twin(r, gpu="0"))),
         main_job("auto", est=120, timeout=170, gpu="0"))),
    "capacity": Scenario(
        "the largest batch each DeepSeek-slice recipe fits (capacity dispatch): the planner's B*, then the step "
        "really run at B* (should run) and 2 B* (should run out of memory)",
        tuple(capacity(r, s) for r, s in _CAPACITY_START.items())),
    "opt-state": Scenario(
        "the main job with AdamW's state on the host: all 32 layers of the 8B preset (refused with the state in HBM) "
        "beside the 8-layer cut with the state in HBM",
        (Job("refused-32-layers-in-hbm", ("-m", "recipes.train", "--preset", "llama3_1_8b", "--seq", "8192",
                                          "--batch", "4", "--recipe", "qkv_offload", "--steps", "1"), "", 60, 200,
             env=_OPT_STATE_ENV, ident={"bench": "main-job-8b", "impl": "zoo", "program": "main-job",
                                        "recipe": "qkv_offload", "L": 32, "B": 4, "opt_state": "device"},
             gpus="0", expect_rc=2,
             smoke_argv=("-m", "recipes.train", "--preset", "tiny", "--seq", "32", "--batch", "2", "--steps", "1",
                         "--hbm-limit", "0.0001")),
         main_job("qkv_offload", ("--layers", "32", "--batch", "4", "--grad-accum", "4", "--opt-state", "host"),
                  steps=8, est=280, timeout=320, gpu="0", name="main-job-8b-L32-opt-state-host", env=_OPT_STATE_ENV),
         main_job("qkv_offload", ("--layers", "8", "--batch", "2"), est=120, timeout=170, gpu="0",
                  env=_OPT_STATE_ENV),
         *(main_job("qkv_offload", ("--layers", "32", "--batch", str(k), "--grad-accum", str(k), "--opt-state",
                                    "host"), steps=5 if k == 8 else 4, est=60 + 14 * k, timeout=300, gpu="0",
                    name=f"main-job-8b-L32-opt-state-host-K{k}", env=_OPT_STATE_ENV) for k in (8, 16)))),
    "host-state": Scenario(
        "all 32 layers of the 8B preset with the optimizer state on the host at 4 micro-batches: AdamW's moments in "
        "bfloat16 (DeepSeek-V3's choice; half the bytes to stream) beside the 8-layer cut with the state in HBM",
        (main_job("qkv_offload", ("--layers", "32", "--batch", "4", "--grad-accum", "4", "--opt-state", "host",
                                  "--opt-dtype", "bfloat16"), steps=5, est=200, timeout=300, gpu="0",
                  name="main-job-8b-L32-opt-state-host-bf16-moments", env=_OPT_STATE_ENV),
         main_job("qkv_offload", ("--layers", "8", "--batch", "2"), est=120, timeout=170, gpu="0",
                  env=_OPT_STATE_ENV))),
    "params-host": Scenario(
        "all 32 layers of the 8B preset with bfloat16 parameters in HBM and their float32 master copy and the moments "
        "on the host (--params host), beside the same with float32 parameters in HBM (bfloat16 moments on the host)",
        (main_job("qkv_offload", ("--layers", "32", "--batch", "4", "--grad-accum", "4", "--opt-state", "host",
                                  "--opt-dtype", "bfloat16", "--param-dtype", "bfloat16", "--params", "host"),
                  steps=5, est=200, timeout=300, gpu="0", name="main-job-8b-L32-params-host-bf16-moments",
                  env=_OPT_STATE_ENV),)),
    "mtp": Scenario(
        "the step-time cost of DeepSeek-V3's multi-token prediction (one depth) on the deepseek-slice, capacity "
        "dispatch, under full remat and the study's offload recipe, and its host bytes against the plan",
        tuple(deepseek(r, extra=("--mtp", str(m)), name=f"deepseek-capacity-B4-{r}-mtp{m}", timeout=120)
              for r in ("full", "mla_moe_offload") for m in (0, 1))),
    "long-context": Scenario(
        "long context on one GPU: the zoo's 8B-shaped stack at 32K/8 layers, 64K/4 and 128K/2 (batch 1) under full "
        "remat and the context recipes beside the plain-JAX baseline's policies, in the order of importance",
        (ctx("full", 32768, 8), ctx("context_offload", 32768, 8), anchor_ctx("full", 32768, 8),
         anchor_ctx("ctx_offload", 32768, 8),
         ctx("full", 65536, 4), ctx("context_offload", 65536, 4), anchor_ctx("full", 65536, 4),
         anchor_ctx("ctx_offload", 65536, 4),
         ctx("full", 131072, 2, est=50), ctx("context_offload", 131072, 2, est=50), anchor_ctx("full", 131072, 2),
         anchor_ctx("ctx_offload", 131072, 2),
         ctx("minimal", 32768, 8), ctx("minimal_no_context", 32768, 8), anchor_ctx("minimal_ctx", 32768, 8),
         anchor_ctx("minimal", 32768, 8), ctx("context_save", 32768, 8), anchor_ctx("ctx_save", 32768, 8))),
    "long-context-more": Scenario(
        "long context, the rest: q, k, v recipes and auto on the 8B-shaped stack at 32K, the DeepSeek slice's stack "
        "at 32K under full and MLA's context offloaded",
        (ctx("qkv_offload", 32768, 8), ctx("qkv_context_offload", 32768, 8), ctx("save_qkv", 32768, 8),
         ctx("auto", 32768, 8), anchor_ctx("offload_qkv_ctx", 32768, 8),
         ctx("full", 32768, 4, family="deepseek_v3", est=60), ctx("context_offload", 32768, 4, family="deepseek_v3",
                                                                    est=60))),
    "qwen3-rate": Scenario(
        "Qwen3's step rate on one GPU: the 32B-shaped stack (4 layers, batch 2, seq 8192, SGD) under minimal and full "
        "(the two the rate and overhead are fitted from: zoo.models.qwen3.training), then qkv_offload, save_qkv and "
        "context_offload, whose times the fitted rate predicts",
        tuple(ctx(r, 8192, 4, family="qwen3", batch=2, est=40) for r in
              ("minimal", "full", "qkv_offload", "save_qkv", "context_offload"))),
    "long-context-main": Scenario(
        "long context in the main job (AdamW, the LM head and its loss in chunks): the 8B preset cut to 8 layers at "
        "32K under full (chunked and unchunked) and context_offload, the DeepSeek slice's stack at 32K, the 8B cut "
        "to 4 layers at 64K and 2 at 128K, and all 32 layers at 64K with the optimizer state on the host",
        (main_job("full", ("--layers", "8", "--batch", "1", "--seq", "32768"), steps=6, est=70, timeout=200,
                  gpu="0", name="main-job-8b-L8-S32K-full"),
         main_job("full", ("--layers", "8", "--batch", "1", "--seq", "32768", "--train-arg=--loss-chunk=none"),
                  steps=6, est=70, timeout=200, gpu="0", name="main-job-8b-L8-S32K-full-unchunked"),
         main_job("context_offload", ("--layers", "8", "--batch", "1", "--seq", "32768"), steps=6, est=70,
                  timeout=200, gpu="0", name="main-job-8b-L8-S32K-context_offload"),
         ctx("full", 32768, 4, family="deepseek_v3", est=60),
         ctx("context_offload", 32768, 4, family="deepseek_v3", est=60),
         main_job("context_offload", ("--layers", "4", "--batch", "1", "--seq", "65536"), steps=6, est=70,
                  timeout=200, gpu="0", name="main-job-8b-L4-S64K-context_offload"),
         main_job("context_offload", ("--layers", "32", "--batch", "1", "--seq", "65536", "--opt-state", "host",
                                      "--opt-dtype", "bfloat16"), steps=4, est=150, timeout=300, gpu="0",
                  name="main-job-8b-L32-S64K-context_offload-host-state", env=_OPT_STATE_ENV),
         main_job("context_offload", ("--layers", "2", "--batch", "1", "--seq", "131072"), steps=5, est=70,
                  timeout=200, gpu="0", name="main-job-8b-L2-S128K-context_offload"))),
    "longest-context-check": Scenario(
        "before the longest runs: the 8B cut to 4 layers at 128K under long_context (tiles, groups of two, the layer "
        "input offloaded) trains; the 32-layer step at 256K compiled for the GPU under long_context and auto; the "
        "default 8K main job (auto, and the README's qkv_offload, the loss whole where it fits) beside its plain-JAX "
        "anchor",
        (long_job("long_context", 131072, layers=4, steps=3, est=90, timeout=240),
         probe(("long_context", "auto"), seq=262144, est=200, timeout=330),
         main_job("auto", est=90, timeout=200, gpu="0"), main_job("qkv_offload", est=70, timeout=170, gpu="0"),
         anchor("minimal", shape="8b", layers=8, est=50, gpu="0"))),
    "longest-context": Scenario(
        "all 32 layers of the 8B at 128K: auto beside full remat (the state on the host), and the plain-JAX "
        "long-context anchor's 128K slice",
        (long_job("auto", 131072, steps=3, est=260), long_job("full", 131072, steps=3, est=260),
         anchor_ctx("ctx_offload", 131072, 2), anchor_ctx("full", 131072, 2))),
    "longest-context-256k": Scenario(
        "all 32 layers of the 8B at 256K under auto (two steps: one takes minutes), then the planner's compiled answer "
        "for the longest length up to 512K",
        (long_job("auto", 262144, steps=2, est=420, timeout=560),
         probe(("auto",), longest=524288, est=240, timeout=400))),
    "offload-profile": Scenario(
        "where the offload time goes: the plain-JAX anchor under XLA's overlap options and profiles of the zoo's "
        "step (405B slice, 3 layers, batch 2), two single-GPU queues side by side",
        (anchor("minimal", gpu="0"), anchor("offload_minimal", gpu="0"), profile("minimal_offload", gpu="0"),
         profile("minimal", gpu="0"),
         anchor("offload_minimal", flags="pipelined", gpu="1"), anchor("offload_minimal", flags="double_buffer",
                                                                       gpu="1"),
         profile("minimal_offload", flags="pipelined", gpu="1"))),
    "stream-probe": Scenario(
        "do host copies overlap compute: bench.stream_probe's variants under XLA's stream options",
        (stream_probe("device"), stream_probe("plain"), stream_probe("stream"),
         stream_probe("plain", STREAM_ANNOTATION, "annotation"),
         stream_probe("stream", STREAM_ANNOTATION, "annotation"),
         stream_probe("plain", SELECTIVE_MEMCPY, "selective"),
         stream_probe("stream", f"{STREAM_ANNOTATION} {SELECTIVE_MEMCPY}", "annotation-selective"))),
    "stack-depth": Scenario(
        "does offload survive every stack depth: XLA's host bytes against the plan at 1, 2 and 3 layers",
        (Job("stack-depth", ("-m", "bench.stack_depth", "--variant", "current"), LHS, 60, 150,
             ident={"bench": "stack-depth", "setting": "zoo"}, gpus="0"),)),
    "loss-curve": Scenario(
        "does offloading change the numbers: 50 steps of the main job under minimal_offload against full",
        (Job("loss-curve-minimal_offload", ("-m", "bench.loss_curve", "--recipe", "minimal_offload"), LHS, 150, 240,
             ident={"bench": "loss-curve", "setting": "zoo"}, gpus="0"),)),
}

# ------------------------------------------------------------------------------------------------ the runner

_SMOKE_VALUES = {"--layers": "2", "--steps": "2", "--experts": "16", "--start": "1", "--timeout": "240", "--seq": "64"}


def smoke(job: Job) -> Job:
    """The same job on tiny shapes on the CPU: the bench's `--smoke` with the sizes that matter cut, the anchors'
    SMALL shapes, fake CPU devices for a mesh."""
    argv = list(job.smoke_argv or job.argv)
    env = dict(job.env)
    if job.smoke_argv is None and job.program in TAKES_SMOKE:
        argv = [_SMOKE_VALUES.get(argv[i - 1], x) if i else x for i, x in enumerate(argv)]
        argv.append("--smoke")
        if job.program == "bench.overlap_slice":
            argv = [x for i, x in enumerate(argv) if x != "--profile" and argv[i - 1] != "--profile"]
            argv += ["--warmup", "1"]
        if job.program == "bench.llama_slice" and "--seq" not in argv:
            argv += ["--seq", "64"]
        if job.program == "bench.deepseek_slice" and "tokamax" in argv:   # its Mosaic GPU kernel: not on the CPU
            argv[argv.index("tokamax")] = "ragged_dot"
        if job.program == "bench.capacity_sweep":
            argv += ["--hbm", "0.01"]
    elif job.program in ANCHORS:
        env.update(SMALL="1", NL="2", **({"SEQ": "64"} if "SEQ" in env else {}))
    return dataclasses.replace(job, argv=tuple(argv), env=env, timeout_s=300, est_s=30)


def last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def _fill(text: str, job: Job, anchor_dir: str, out: str) -> str:
    return text.replace("{anchor}", anchor_dir).replace("{out}", out).replace(
        "{work}", os.path.join(out, "work", job.name))


def _records(job: Job, rc, stdout: str, text: str, records_path: str, smoke_run: bool, flags: str) -> list[dict]:
    """The job's records: what the bench wrote to its BENCH_OUT, else the last JSON line it printed (an anchor's,
    turned into the records' schema), else one saying why there is none."""
    recs = []
    if os.path.exists(records_path):
        with open(records_path) as f:
            recs = [json.loads(line) for line in f if line.strip()]
    if not recs and job.expect_rc:
        at = text.find("error:")   # the refusal, from its first line on
        message = text[at:at + 400] if at >= 0 else " | ".join(text.strip().splitlines()[-3:])[-400:]
        return [{"rc": rc, "expected_rc": job.expect_rc, "as_expected": rc == job.expect_rc,
                 "message": " ".join(message.split())}]
    if not recs:
        got = last_json(stdout)
        if got is not None and job.anchor is not None:
            from bench.anchor_record import to_record

            got = to_record(got, smoke=smoke_run, **job.anchor)
            got.update(jax=_version("jax"), flags=flags,
                       date=time.strftime("%Y-%m-%d"))
        if got is not None:
            recs = [got]
    if not recs:
        recs = [{"error": f"rc={rc}: " + " | ".join(text.strip().splitlines()[-3:])[-300:]}]
    elif rc not in (0, job.expect_rc):
        recs = [{**r, "rc": rc} for r in recs]
    return recs


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_job(job: Job, gpu: str | None, out: str, remaining: float, *, anchor_dir: str, base_env: dict,
            smoke_run: bool = False) -> list[dict]:
    work = os.path.join(out, "work", job.name)
    os.makedirs(work, exist_ok=True)
    for path, content in job.files.items():
        with open(_fill(path, job, anchor_dir, out), "w") as f:
            f.write(content)
    flags = f"{job.flags} {AUTOTUNE_CACHE}".strip()
    if smoke_run and job.devices > 1:
        flags += f" --xla_force_host_platform_device_count={job.devices}"
    records_path = os.path.join(work, "records.jsonl")
    if os.path.exists(records_path):
        os.remove(records_path)
    env = {**base_env, **{k: _fill(v, job, anchor_dir, out) for k, v in job.env.items()},
           "XLA_FLAGS": flags, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", "BENCH_OUT": records_path}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    argv = [sys.executable] + [_fill(x, job, anchor_dir, out) for x in job.argv]
    t = time.time()
    try:
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=min(job.timeout_s, remaining))
        stdout, text, rc = p.stdout, p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        dec = lambda x: x.decode(errors="replace") if isinstance(x, bytes) else (x or "")  # noqa: E731
        stdout, text, rc = "", dec(e.stdout) + dec(e.stderr), "timeout"
    wall = round(time.time() - t, 1)
    with open(os.path.join(out, "logs", job.name + ".log"), "w") as f:
        f.write(" ".join(argv) + "\n" + "\n".join(text.splitlines()[-150:]))
    recs = _records(job, rc, stdout, text, records_path, smoke_run, flags)
    ident = {k: _fill(v, job, anchor_dir, out) if isinstance(v, str) else v for k, v in job.ident.items()}
    return [records.normalize({**ident, **records.flat(r), "job": job.name, "gpu_index": gpu, "wall_s": wall},
                              **_record_defaults(job)) for r in recs]


def _record_defaults(job: Job) -> dict:
    """The schema fields a job's record may lack (an error, a skipped job): its bench, impl and today."""
    return dict(bench=job.ident.get("bench") or job.name, impl="anchor" if job.anchor else "zoo",
                date=time.strftime("%Y-%m-%d"))


def _job_env(smoke_run: bool) -> dict:
    """The environment every job starts from: on a GPU machine, tokamax from the wheels in `.whl` (installed once
    into /tmp/site) and `bench/shims` for xprof where it is not installed; in smoke form, the CPU."""
    env = dict(os.environ)
    env.pop("BENCH_OUT", None)
    paths = [os.getcwd()]
    if smoke_run:
        env["JAX_PLATFORMS"] = "cpu"
    else:
        wheels = sorted(glob.glob(".whl/*.whl"))
        if wheels:
            p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                "--no-cache-dir", "--upgrade", "--target", "/tmp/site", *wheels])
            if p.returncode == 0:
                paths.insert(0, "/tmp/site")
    probe = subprocess.run([sys.executable, "-c", "import xprof"], capture_output=True, env=env)
    if probe.returncode != 0:
        paths.append(os.path.join(os.getcwd(), "bench", "shims"))
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _gpus() -> list[str]:
    if os.environ.get("BENCH_GPUS"):  # e.g. "0": leave the other GPUs to another runner in the same call
        return os.environ["BENCH_GPUS"].split(",")
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except Exception:
        return []
    return [line.split(":")[0].split()[-1] for line in listing.splitlines() if line.startswith("GPU")]


def select(name: str, only: str | None = None, smoke_run: bool = False) -> list[Job]:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}: one of {', '.join(SCENARIOS)}")
    todo = [j for j in SCENARIOS[name].jobs if not only or re.search(only, j.name)]
    return [smoke(j) for j in todo] if smoke_run else todo


def run(name: str, anchor_dir: str, out: str, *, deadline: float = 540, only: str | None = None,
        smoke_run: bool = False) -> str:
    """Run a scenario's jobs; returns the path of results.jsonl."""
    todo = select(name, only, smoke_run)
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    base_env = _job_env(smoke_run)
    gpus = [] if smoke_run else _gpus()
    start = time.time()
    queues: dict = {}
    if any(j.devices > 1 for j in todo):   # a job on several GPUs: the whole scenario in one queue, in order
        queues["all"] = queue.Queue()
        for j in todo:
            queues["all"].put(j)
    else:
        workers = gpus or [None]
        queues = {w: queue.Queue() for w in workers}
        for i, j in enumerate(todo):   # a job pinned to a GPU that is not here goes to the queues in turn
            queues[j.gpus if j.gpus in queues else workers[i % len(workers)]].put(j)
    lock = threading.Lock()
    results_path = os.path.join(out, "results.jsonl")

    def worker(key):
        q = queues[key]
        while True:
            try:
                job = q.get_nowait()
            except queue.Empty:
                return
            if smoke_run:
                gpu = None
            elif key == "all":   # one queue for the machine: each job on its own GPUs, a one-GPU job on the first
                gpu = job.gpus or (gpus[0] if gpus else None)
            else:
                gpu = key
            remaining = deadline - (time.time() - start)
            requires = job.requires and _fill(job.requires, job, anchor_dir, out)
            if job.gpu_only and smoke_run:
                recs = [{**job.ident, "job": job.name, "skipped": "GPU only: not run in smoke form"}]
            elif requires and not os.path.exists(requires):
                recs = [{**job.ident, "job": job.name, "skipped": f"{requires} was not written"}]
            elif job.est_s > remaining:
                recs = [{**job.ident, "job": job.name,
                         "skipped": f"{job.est_s:.0f} s estimated, {remaining:.0f} s left"}]
            else:
                recs = run_job(job, gpu, out, remaining, anchor_dir=anchor_dir, base_env=base_env,
                               smoke_run=smoke_run)
            with lock:
                with open(results_path, "a") as f:
                    for rec in recs:
                        rec = {**records.flat(rec), "scenario": name}
                        f.write(json.dumps(records.normalize(rec, **_record_defaults(job))) + "\n")
                        print(json.dumps({k: rec.get(k) for k in (
                            "job", "gpu_index", "step_s", "peak_gib", "host_temp_gib", "wall_s", "error",
                            "skipped", "as_expected") if k in rec}), flush=True)

    threads = [threading.Thread(target=worker, args=(k,)) for k in queues]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results_path


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="scenarios:\n" + "\n".join(f"  {k}: {s.what}" for k, s in SCENARIOS.items()))
    ap.add_argument("scenario", choices=list(SCENARIOS), metavar="SCENARIO")
    ap.add_argument("paths", nargs="*", metavar="[ANCHOR_DIR] OUT_DIR")
    ap.add_argument("--deadline", type=float, default=540, help="seconds from start: start no job that cannot end")
    ap.add_argument("--only", default=None, help="regex over job names")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the scenario)")
    ap.add_argument("--list", action="store_true", help="print the jobs and their commands; run nothing")
    a = ap.parse_args(argv)
    if a.list:
        for j in select(a.scenario, a.only, a.smoke):
            env = " ".join(f"{k}={v}" for k, v in j.env.items())
            print(f"{j.name}  [gpus {j.gpus or 'any'}, ~{j.est_s:.0f} s, timeout {j.timeout_s:.0f} s]\n"
                  f"    XLA_FLAGS='{j.flags}' {env} python {' '.join(j.argv)}")
        return
    if len(a.paths) not in (1, 2):
        ap.error("give OUT_DIR, or ANCHOR_DIR and OUT_DIR")
    anchor_dir, out = (".anchor", a.paths[0]) if len(a.paths) == 1 else a.paths
    results = run(a.scenario, anchor_dir, out, deadline=a.deadline, only=a.only, smoke_run=a.smoke)
    from bench.report import write_summary

    write_summary(results, os.path.join(out, "summary.md"))
    print(open(os.path.join(out, "summary.md")).read())


if __name__ == "__main__":
    main()
