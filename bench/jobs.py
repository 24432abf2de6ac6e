"""The benchmark jobs: what one process of a scenario runs (`Job`: a bench module or a plain-JAX anchor script,
its recipe, backend, mesh, XLA setting, the GPUs it runs on, its time estimate), the builders that make each kind,
the XLA settings they run under, and a job's smoke form (`smoke`). The scenarios are `bench.scenarios`; the runner
is `bench.run`.
"""
from __future__ import annotations

import dataclasses
import json
import os

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
           "bench.loss_chunks", "bench.param_stream_probe", "bench.split_carry_probe",
           "bench.attention_rates", "recipes.train")
ANCHORS = ("bench.baselines.plain_jax_llama", "bench.baselines.plain_jax_llama_fsdp",
           "bench.baselines.plain_jax_deepseek", "plain_jax_llama_ctx.py")
TAKES_SMOKE = ("bench.overlap_slice", "bench.llama_slice", "bench.deepseek_slice", "bench.main_job_8b",
               "bench.plan_probe", "bench.ctx_slice", "bench.capacity_sweep", "bench.step_cost", "bench.loss_curve",
               "bench.stack_depth", "bench.loss_chunks", "bench.split_carry_probe",
               "bench.attention_rates")

# The optimizer-state runs: the allocator's share of the GPU raised, an 80 GiB pinned pool.
OPT_STATE_ENV = {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".95", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "80"}
# The longest contexts: the allocator's share of the GPU raised, and a pinned pool for the state (60 GiB) and the
# offloaded layer inputs, within the machine's 128 GiB of RAM.
LONG_ENV = {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".95", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "110"}
HOST_STATE = ("--opt-state", "host", "--opt-dtype", "bfloat16", "--param-dtype", "bfloat16", "--params", "host")


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


def main_job(recipe, extra=(), steps=12, est=110, timeout=200, gpu=None, name=None, env=None, flags=LHS) -> Job:
    """bench.main_job_8b main: `python -m recipes.train` on the 8B preset cut to 8 layers, AdamW (`flags`: its
    XLA_FLAGS)."""
    return Job(name or f"main-job-8b-{recipe}",
               ("-m", "bench.main_job_8b", "main", "--recipe", recipe, "--steps", str(steps), "--workdir", "{work}",
                "--timeout", str(timeout - 20), *extra), flags, est, timeout, env=env or {},
               ident={"bench": "main-job-8b", "impl": "zoo", "program": "main-job", "recipe": recipe, "setting": "zoo",
                      "log": "{work}/train.log"}, gpus=gpu)


def sgd_twin(recipe, est=60, timeout=90, gpu=None, layers=None) -> Job:
    """bench.main_job_8b sgd: the same model under the benches' SGD step (bf16 parameters, no clipping), with
    `layers` of the preset's (None: the bench's 8)."""
    cut = () if layers is None else ("--layers", str(layers))
    return Job(f"sgd-8b-{recipe}" + (f"-L{layers}" if layers else ""),
               ("-m", "bench.main_job_8b", "sgd", "--recipe", recipe, *cut), LHS, est, timeout,
               ident={"bench": "main-job-8b", "impl": "zoo", "program": "sgd-bench", "recipe": recipe,
                      "setting": "zoo"}, gpus=gpu)


def capacity(recipe, start, est=240, timeout=300, gpu=None) -> Job:
    """bench.capacity_sweep: the planner's largest batch, then the real step at it and at twice it."""
    return Job(f"capacity-{recipe}", ("-m", "bench.capacity_sweep", recipe, "--start", str(start), "--backend",
                                      "capacity", "--deadline", str(timeout - 10)), LHS, est, timeout,
               env={"JAX_COMPILATION_CACHE_DIR": "{work}/jit-cache"},
               ident={"bench": "capacity-sweep", "impl": "zoo", "recipe": recipe, "setting": "zoo"}, gpus=gpu)


def profile(recipe, flags="lhs", gpu=None, est=120, timeout=170, shape="405b", layers=3, batch=2, seq=8192,
            attention="cudnn", loss_chunk=None, env=None, passes=None) -> Job:
    """bench.profile_step: a profiled step of a Llama slice (default: the 405B's, 3 layers, batch 2, seq 8192) under
    `attention`, the trace's summary and the compiled step's custom calls (with `passes`: compiled only, the passes
    after which the count of that custom call changed)."""
    shaped = (shape, layers, batch, seq) != ("405b", 3, 2, 8192)
    name = (f"profile-{shape}-L{layers}-S{seq // 1024}K-{recipe}-{attention}" if shaped or attention != "cudnn"
            else f"profile-405b-{recipe}-{flags}") + ("-passes" if passes else "")
    size = ("--layers", str(layers), "--batch", str(batch), "--seq", str(seq), "--attention", attention,
            *(("--loss-chunk", str(loss_chunk)) if loss_chunk else ()), *(("--passes", passes) if passes else ()))
    return Job(name, ("-m", "bench.profile_step", recipe, "--shape", shape, *size, "--out", "{work}/trace"),
               ANCHOR_FLAGS[flags], est, timeout, env=env or {},
               ident={"bench": "profile", "impl": "zoo", "recipe": recipe, "setting": flags}, gpus=gpu,
               smoke_argv=("-m", "bench.profile_step", recipe, "--shape", "tiny", "--layers", "2", "--seq", "64",
                           "--out", "{work}/trace"))


def stream_probe(variant, flags="", label="plain") -> Job:
    """bench.stream_probe: a chain of matmuls whose outputs go to the host and back, under XLA's stream options."""
    return Job(f"stream-probe-{variant}-{label}", ("-m", "bench.stream_probe", variant, "--out", "{work}/trace"),
               flags, 45, 90, ident={"bench": "stream-probe", "setting": label}, gpus="0",
               smoke_argv=("-m", "bench.stream_probe", variant, "--n", "2", "--m", "128", "--k", "128", "--out",
                           "{work}/trace"))


def module_job(name, module, *args, bench=None, est=90, timeout=240) -> Job:
    """A bench module of the zoo's own (`-m MODULE ARGS`) on GPU 0 under the latency-hiding scheduler; its records
    are named `bench` (default: `name`)."""
    return Job(name, ("-m", module, *args), LHS, est, timeout,
               ident={"bench": bench or name, "impl": "zoo", "setting": "zoo"}, gpus="0")


def probe(recipes, seq=None, longest=None, est=120, timeout=300, extra=(), env=None, name=None) -> Job:
    """bench.plan_probe: the 8B's step (32 layers, batch 1, state on the host) compiled for the GPU at `seq` under
    each recipe of `recipes`, or zoo.plan.longest_seq's answer up to `longest`; nothing runs. `extra`: more of
    plan_probe's flags (`--params stream`, `--attention-tiles N`)."""
    what = ("--longest", str(longest)) if longest else ("--seq", str(seq))
    return Job(name or f"plan-probe-{'longest-' if longest else ''}{(longest or seq) // 1024}K-{'-'.join(recipes)}",
               ("-m", "bench.plan_probe", *what, *(a for r in recipes for a in ("--recipe", r)), *extra), LHS, est,
               timeout, env=env or LONG_ENV,
               ident={"bench": "plan-probe", "impl": "zoo", "recipe": recipes[0], "setting": "zoo"},
               gpus="0", smoke_argv=("-m", "bench.plan_probe", "--seq", "256", "--recipe", recipes[0], "--smoke"))


def _mesh_size(mesh: str) -> int:
    n = 1
    for axis in mesh.split(","):
        n *= int(axis.split("=")[1])
    return n


def long_job(recipe, seq, layers=32, steps=3, est=300, timeout=420, extra=(), name=None, env=None, flags=LHS) -> Job:
    """The main job on the 8B preset at `seq` (batch 1), bf16 parameters with their float32 master and AdamW's bf16
    moments in pinned host memory."""
    sets = ("--train-arg=--set=max_seq_len=" + str(seq),) if seq > 131072 else ()
    return main_job(recipe, ("--layers", str(layers), "--batch", "1", "--seq", str(seq), *HOST_STATE, *sets, *extra),
                    steps=steps, est=est, timeout=timeout, gpu="0",
                    name=name or f"main-job-8b-L{layers}-S{seq // 1024}K-{recipe}", env=env or LONG_ENV, flags=flags)


# ------------------------------------------------------------------------------------------------ smoke form

_LOSS_CHUNK_ARG = "--train-arg=--loss-chunk="   # its smoke form: 16, a chunk length that divides 64 positions
_KERNEL_ARG = "--train-arg=--set=attention_impl="   # a GPU kernel: left out of the smoke form (the CPU runs its own)
_SMOKE_VALUES = {"--layers": "2", "--steps": "2", "--experts": "16", "--start": "1", "--timeout": "240", "--seq": "64"}


def smoke(job: Job) -> Job:
    """The same job on tiny shapes on the CPU: the bench's `--smoke` with the sizes that matter cut, the anchors'
    SMALL shapes, fake CPU devices for a mesh."""
    argv = list(job.smoke_argv or job.argv)
    env = dict(job.env)
    if job.smoke_argv is None and job.program in TAKES_SMOKE:
        argv = [_SMOKE_VALUES.get(argv[i - 1], x) if i else x for i, x in enumerate(argv)]
        argv = [f"{_LOSS_CHUNK_ARG}16" if x.startswith(_LOSS_CHUNK_ARG) else x for x in argv
                if not x.startswith(_KERNEL_ARG)]
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
