"""Offload against saving and recomputing in one device call: the zoo's slices under each recipe and XLA setting,
beside the plain-JAX anchor, one process per configuration, each job on the GPU its comparison needs, most
important first, stopping before a deadline.

    python -m bench.run_overlap ANCHOR_DIR OUT_DIR [--deadline 540] [--only REGEX] [--smoke]

Each job runs `python -m bench.overlap_slice` / `bench.deepseek_slice` (the zoo) or `ANCHOR_DIR/plain_jax_llama.py`
(plain JAX) in its own process (XLA reads its flags once) with a timeout. A setting is the process's `XLA_FLAGS`
plus the compile options of the zoo's step (`BENCH_OPTIONS`; `zoo`: the library's own choice,
`zoo.compile_options`). Jobs that are compared with each other run on the same GPU, in sequence: two GPUs of one
machine may share a PCIe switch, so only one queue offloads a lot at a time where the ratio matters. A job starts
only if its estimated time fits before the deadline. Writes OUT_DIR/results.jsonl (one record per job, DESIGN
section 8 plus `setting`), OUT_DIR/logs/JOB.log and OUT_DIR/summary.md. `--smoke`: tiny shapes on the CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time

LHS = "--xla_gpu_enable_latency_hiding_scheduler=true"
AUTOTUNE_CACHE = "--xla_gpu_per_fusion_autotune_cache_dir=/tmp/zoo-autotune"  # later compiles reuse the tuning
# setting -> (XLA_FLAGS, BENCH_OPTIONS: the zoo step's compile options as JSON; None: the library's choice)
SETTINGS = {
    "zoo": (LHS, None),
    "defaults": (LHS, "{}"),
    "concurrent": (LHS, json.dumps({"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"})),
    "cb_off_flags": (f"{LHS} --xla_gpu_enable_command_buffer=", "{}"),
    "double_buffer": (f"{LHS} --xla_gpu_enable_while_loop_double_buffering=true", None),
    "pipelined": (f"{LHS} --xla_gpu_enable_pipelined_host_offloading=true", None),
    "pipelined_db": (f"{LHS} --xla_gpu_enable_pipelined_host_offloading=true "
                     "--xla_gpu_enable_while_loop_double_buffering=true", None),
}
ANCHOR_FLAGS = {"lhs": LHS, "cb_off": f"{LHS} --xla_gpu_enable_command_buffer=",
                "cb_off_db": f"{LHS} --xla_gpu_enable_command_buffer= "
                             "--xla_gpu_enable_while_loop_double_buffering=true"}


@dataclasses.dataclass
class Job:
    name: str
    argv: list[str]
    flags: str
    est_s: float
    timeout_s: float
    env: dict = dataclasses.field(default_factory=dict)
    ident: dict = dataclasses.field(default_factory=dict)
    gpu: str | None = None   # the GPU index this job must run on (None: any)


def zoo(recipe, shape="405b", layers=3, batch=2, setting="zoo", extra=(), est=75, gpu=None):
    flags, options = SETTINGS[setting]
    env = {"BENCH_PLAN_PEAK": "none", **({} if options is None else {"BENCH_OPTIONS": options})}
    chunks = extra[extra.index("--mlp-chunks") + 1] if "--mlp-chunks" in extra else "1"
    return Job(f"zoo-{shape}-L{layers}-B{batch}-{recipe}-{setting}" + ("" if chunks == "1" else f"-mlp{chunks}"),
               [sys.executable, "-m", "bench.overlap_slice", recipe, "--shape", shape, "--layers", str(layers),
                "--batch", str(batch), "--steps", "4", *extra], flags, est, 200, env=env,
               ident={"bench": f"llama{shape}-slice", "impl": "zoo", "recipe": recipe, "setting": setting},
               gpu=gpu)


def deepseek(recipe, setting="zoo", extra=(), est=75, gpu=None):
    flags, options = SETTINGS[setting]
    env = {"BENCH_PLAN_PEAK": "none", **({} if options is None else {"BENCH_OPTIONS": options})}
    return Job(f"zoo-deepseek-{recipe}-{setting}",
               [sys.executable, "-m", "bench.deepseek_slice", recipe, "--backend", "capacity", "--batch", "4",
                *extra], flags, est, 200, env=env,
               ident={"bench": "deepseek-slice", "impl": "zoo", "recipe": recipe, "setting": setting}, gpu=gpu)


def anchor(policy, shape="405b", layers=3, batch=2, flags="lhs", est=60, anchor_dir=".", gpu=None):
    return Job(f"anchor-{shape}-L{layers}-B{batch}-{policy}-{flags}",
               [sys.executable, os.path.join(anchor_dir, "plain_jax_llama.py"), policy, str(batch)],
               ANCHOR_FLAGS[flags], est, 150, env={"SHAPE": shape, "NL": str(layers)},
               ident={"bench": f"llama{shape}-slice", "impl": "anchor", "recipe": policy, "setting": flags,
                      "L": layers}, gpu=gpu)


def main_job(recipe, est=110, gpu=None, log_dir=None):
    """The main job itself (`bench.main_job_8b main`: recipes.train on the 8B preset cut to 8 layers, AdamW)."""
    work = f"/tmp/main-job-{recipe}"
    return Job(f"main-job-8b-{recipe}", [sys.executable, "-m", "bench.main_job_8b", "main", "--recipe", recipe,
                                          "--steps", "12", "--workdir", work], LHS, est, 260,
               ident={"bench": "main-job-8b", "impl": "zoo-main-job", "recipe": recipe, "setting": "zoo",
                      "log": f"{work}/train.log"}, gpu=gpu)


def jobs(anchor_dir: str, out: str, scenarios: str = "slices") -> list[Job]:
    """`slices`: GPU 0 the 405B slice's ratios (each pair on one chip), GPU 1 the settings, depth and the DeepSeek
    slice. `jobs`: the main job on GPU 0, the DeepSeek slice's offload pair and `auto` on GPU 1."""
    if scenarios == "probe":   # where the rest of the copy time goes, and XLA's double buffering against it
        prof = lambda n: ["--hlo", "--profile", f"/tmp/overlap-prof/{n}"]  # noqa: E731
        return [zoo("minimal_offload", extra=prof("mo3"), est=90, gpu="0"),
                zoo("minimal_offload", setting="double_buffer", gpu="0"), zoo("minimal", gpu="0"),
                anchor("offload_minimal", flags="cb_off_db", anchor_dir=anchor_dir, gpu="0"),
                zoo("minimal_offload", layers=6, batch=1, extra=prof("mo6"), est=90, gpu="1"),
                zoo("minimal_offload", layers=6, batch=1, setting="double_buffer", est=90, gpu="1"),
                zoo("qkv_offload", setting="double_buffer", gpu="1")]
    if scenarios == "pipelined":   # XLA's cross-iteration mechanisms with the copies off the compute stream
        return [zoo("minimal_offload", setting="pipelined", gpu="0"), zoo("minimal_offload", setting="pipelined_db",
                                                                          gpu="0"),
                zoo("qkv_offload", setting="pipelined", gpu="0"),
                zoo("minimal_offload", layers=6, batch=1, setting="pipelined", est=90, gpu="1"),
                zoo("minimal_offload", layers=6, batch=1, setting="pipelined_db", est=90, gpu="1"),
                zoo("save_qkv", setting="pipelined", gpu="1")]
    if scenarios == "pgle":   # the same programs compiled again from a profile of their own steps
        pg = ["--pgle"]
        return [zoo("minimal_offload", extra=pg, est=100, gpu="0"), zoo("minimal", extra=pg, est=90, gpu="0"),
                zoo("full", extra=pg, est=90, gpu="0"),
                zoo("qkv_offload", extra=pg, est=90, gpu="1"), zoo("save_qkv", extra=pg, est=90, gpu="1"),
                zoo("minimal_offload", layers=6, batch=1, extra=pg, est=100, gpu="1"),
                zoo("full", layers=6, batch=1, extra=pg, est=90, gpu="1")]
    if scenarios == "chunks":   # the MLP in sequence chunks: the gate/up copies start before the layer ends
        ch = lambda n: ["--mlp-chunks", str(n)]  # noqa: E731
        a = lambda *x, **k: anchor(*x, anchor_dir=anchor_dir, **k)  # noqa: E731
        return [zoo("minimal", est=60, gpu="0"), zoo("minimal_offload", extra=ch(4), est=50, gpu="0"),
                zoo("minimal_offload", est=50, gpu="0"), zoo("full", est=40, gpu="0"),
                zoo("minimal_offload", extra=ch(2), est=50, gpu="0"),
                zoo("minimal_offload", extra=ch(8), est=50, gpu="0"),
                a("offload_minimal", flags="cb_off", est=40, gpu="0"), a("minimal", est=35, gpu="0"),
                zoo("minimal_offload", layers=6, batch=1, extra=ch(4), est=60, gpu="0"),
                zoo("full", layers=6, batch=1, est=45, gpu="0"),
                zoo("qkv_offload", extra=ch(4), est=45, gpu="0"), zoo("save_qkv", est=35, gpu="0"),
                zoo("minimal", extra=ch(4), est=35, gpu="0"),
                zoo("minimal_offload", layers=6, batch=1, extra=ch(2), est=60, gpu="0"),
                zoo("minimal_offload", layers=6, batch=1, est=60, gpu="0"),
                zoo("minimal", extra=ch(2), est=35, gpu="0")]
    if scenarios == "jobs":
        return [main_job("qkv_offload", gpu="0"), main_job("save_qkv", gpu="0"), main_job("auto", gpu="0"),
                deepseek("save_mla_moe", gpu="1"), deepseek("mla_moe_offload", gpu="1"), deepseek("auto", gpu="1"),
                deepseek("full", gpu="1")]
    prof = lambda n: ["--hlo", "--profile", f"/tmp/overlap-prof/{n}"]  # noqa: E731
    a = lambda *x, **k: anchor(*x, anchor_dir=anchor_dir, **k)  # noqa: E731
    return [
        zoo("qkv_offload", gpu="0"), zoo("save_qkv", gpu="0"),
        zoo("minimal_offload", extra=prof("minimal_offload"), est=90, gpu="0"), zoo("minimal", gpu="0"),
        zoo("full", gpu="0"),
        a("offload_minimal", flags="cb_off", gpu="0"), a("minimal", gpu="0"),
        zoo("minimal_offload", setting="defaults", gpu="0"),
        zoo("minimal_offload", setting="concurrent", gpu="1"),
        zoo("minimal_offload", layers=6, batch=1, est=90, gpu="1"), zoo("full", layers=6, batch=1, est=90, gpu="1"),
        a("offload_minimal", layers=6, batch=1, flags="cb_off", est=70, gpu="1"),
        deepseek("full", gpu="1"), deepseek("mla_moe_offload", extra=prof("ds_mla_moe_offload"), est=85, gpu="1"),
        deepseek("lowrank_wa_offload", gpu="1"), deepseek("save_mla_moe", gpu="1"), deepseek("auto", gpu="1"),
        a("full", gpu="0"),
    ]


def smoke(job: Job) -> Job:
    """The same job on tiny shapes (CPU)."""
    argv = list(job.argv)
    if "bench.overlap_slice" in argv:
        argv = [x for x in argv if not x.startswith("/tmp/overlap-prof")]
        argv = [x for x in argv if x != "--profile"] + ["--smoke", "--steps", "2", "--warmup", "1"]
        argv[argv.index("--layers") + 1] = "2"
    elif "bench.deepseek_slice" in argv or "bench.main_job_8b" in argv:
        argv += ["--smoke"]
    else:
        job.env = {**job.env, "SMALL": "1", "NL": "2"}
    return dataclasses.replace(job, argv=argv, timeout_s=300, est_s=30)


def last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def run_job(job: Job, gpu: str | None, out: str, remaining: float) -> dict:
    env = {**os.environ, **job.env, "XLA_FLAGS": f"{job.flags} {AUTOTUNE_CACHE}".strip(), "PYTHONUNBUFFERED": "1"}
    env.pop("BENCH_OUT", None)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    t = time.time()
    try:
        p = subprocess.run(job.argv, env=env, capture_output=True, text=True, timeout=min(job.timeout_s, remaining))
        stdout, text, rc = p.stdout, p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        dec = lambda x: x.decode(errors="replace") if isinstance(x, bytes) else (x or "")  # noqa: E731
        stdout, text, rc = "", dec(e.stdout) + dec(e.stderr), "timeout"
    wall = round(time.time() - t, 1)
    with open(os.path.join(out, "logs", job.name + ".log"), "w") as f:
        f.write("\n".join(text.splitlines()[-150:]))
    rec = last_json(stdout)
    if rec is None:
        rec = {"error": f"rc={rc}: " + " | ".join(text.strip().splitlines()[-3:])[-300:]}
    return {**job.ident, **rec, "job": job.name, "gpu_index": gpu, "wall_s": wall}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("anchor_dir")
    ap.add_argument("out")
    ap.add_argument("--deadline", type=float, default=540, help="seconds from start: start no job that cannot end")
    ap.add_argument("--only", default=None, help="regex over job names")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--scenarios", default="slices",
                    choices=("slices", "jobs", "probe", "pgle", "pipelined", "chunks"))
    a = ap.parse_args()
    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    todo = jobs(a.anchor_dir, a.out, a.scenarios)
    if a.only:
        todo = [j for j in todo if re.search(a.only, j.name)]
    if a.smoke:
        todo = [smoke(j) for j in todo]
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        gpus = [line.split(":")[0].split()[-1] for line in listing.splitlines() if line.startswith("GPU")]
    except Exception:
        gpus = []
    if os.environ.get("BENCH_GPUS"):  # e.g. "0": leave the other GPUs to another runner in the same call
        gpus = os.environ["BENCH_GPUS"].split(",")
    workers = gpus or [None]
    start = time.time()
    queues: dict = {w: queue.Queue() for w in workers}
    for i, j in enumerate(todo):   # a job pinned to a GPU that is not here goes to the queues in turn
        queues[j.gpu if j.gpu in queues else workers[i % len(workers)]].put(j)
    lock = threading.Lock()
    results_path = os.path.join(a.out, "results.jsonl")

    def worker(gpu):
        q = queues[gpu]
        while True:
            try:
                job = q.get_nowait()
            except queue.Empty:
                return
            remaining = a.deadline - (time.time() - start)
            if job.est_s > remaining:
                rec = {**job.ident, "job": job.name, "skipped": f"{job.est_s:.0f} s estimated, {remaining:.0f} s left"}
            else:
                rec = run_job(job, gpu, a.out, remaining)
            with lock:
                with open(results_path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(json.dumps({k: rec.get(k) for k in ("job", "gpu_index", "step_s", "peak_gib", "host_temp_gib",
                                                         "wall_s", "error", "skipped")}), flush=True)

    threads = [threading.Thread(target=worker, args=(g,)) for g in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    from bench.overlap_report import write_summary

    write_summary(results_path, os.path.join(a.out, "summary.md"))
    print(open(os.path.join(a.out, "summary.md")).read())


if __name__ == "__main__":
    main()
