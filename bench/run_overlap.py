"""Issue 14 in one device call: every offload mechanism and XLA option beside the plain-JAX anchor, one process per
configuration, spread over the GPUs present, most important first, stopping before a deadline.

    python -m bench.run_overlap ANCHOR_DIR OUT_DIR [--deadline 540] [--only REGEX] [--smoke]

Each job runs `python -m bench.overlap_slice` (the zoo), `ANCHOR_DIR/plain_jax_llama.py` (plain JAX) or
`python -m bench.loss_curve` in its own process (XLA reads its flags once) on one GPU (CUDA_VISIBLE_DEVICES), with
a timeout. A job starts only if its estimated time fits before the deadline. Writes OUT_DIR/results.jsonl (one
record per job, DESIGN section 8 plus `mechanism`), OUT_DIR/logs/JOB.log (each job's last output lines) and
OUT_DIR/summary.md (the ratios issue 14 asks for, and where the copies ran). `--smoke`: tiny shapes on the CPU.
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
FLAGS = {
    "lhs": LHS,
    "pipelined": f"{LHS} --xla_gpu_enable_pipelined_host_offloading=true",
    "double_buffer": f"{LHS} --xla_gpu_enable_while_loop_double_buffering=true",
    "selective": f"{LHS} --xla_gpu_experimental_enable_selective_memcpy_overlap=true",
    "no_cmd_buffer": f"{LHS} --xla_gpu_enable_command_buffer=",
}


@dataclasses.dataclass
class Job:
    name: str
    argv: list[str]
    flags: str
    est_s: float
    timeout_s: float
    env: dict = dataclasses.field(default_factory=dict)
    ident: dict = dataclasses.field(default_factory=dict)


def zoo(recipe, impl, shape="405b", layers=3, flags="lhs", extra=(), est=85, name=None):
    tag = name or f"zoo-{shape}-{recipe}-{impl}-{flags}"
    return Job(tag, [sys.executable, "-m", "bench.overlap_slice", recipe, "--shape", shape, "--layers", str(layers),
                     "--impl", impl, *extra], FLAGS[flags], est, 170,
               ident={"bench": f"llama{shape}-slice", "impl": "zoo", "mechanism": impl, "recipe": recipe,
                      "flag_set": flags})


def deepseek(recipe, impl, flags="lhs", est=70):
    return Job(f"zoo-deepseek-{recipe}-{impl}-{flags}",
               [sys.executable, "-m", "bench.deepseek_slice", recipe, "--backend", "capacity", "--batch", "4",
                "--impl", impl], FLAGS[flags], est, 150,
               ident={"bench": "deepseek-slice", "impl": "zoo", "mechanism": impl, "recipe": recipe, "flag_set": flags})


def anchor(policy, shape="405b", layers=3, flags="lhs", est=65, anchor_dir="."):
    return Job(f"anchor-{shape}-{policy}-{flags}",
               [sys.executable, os.path.join(anchor_dir, "plain_jax_llama.py"), policy, "2"], FLAGS[flags], est, 150,
               env={"SHAPE": shape, "NL": str(layers)},
               ident={"bench": f"llama{shape}-slice", "impl": "anchor", "mechanism": "xla", "recipe": policy,
                      "flag_set": flags, "L": layers})


def jobs(anchor_dir: str, out: str) -> list[Job]:
    """Most important first: what decides the default, then the ratios issue 14 asks for, then the extras."""
    prof = lambda n: ["--hlo", "--profile", f"/tmp/overlap-prof/{n}"]  # noqa: E731
    a = lambda *x, **k: anchor(*x, anchor_dir=anchor_dir, **k)  # noqa: E731
    return [
        # the decision: does an explicit mechanism hide the copies? (profiled: stream, overlap)
        zoo("minimal", "xla", extra=["--hlo"]),
        zoo("minimal_offload", "explicit", extra=prof("explicit"), est=100),
        zoo("minimal_offload", "xla", extra=["--hlo"]),
        zoo("full", "xla"),
        zoo("save_qkv", "xla"),
        zoo("qkv_offload", "xla"),
        a("minimal"), a("offload_minimal"), a("full"),
        # the 8B-shaped slice: a harder ratio of bytes to FLOPs
        zoo("minimal", "xla", shape="8b", layers=8, est=55),
        zoo("minimal_offload", "xla", shape="8b", layers=8, est=55),
        zoo("full", "xla", shape="8b", layers=8, est=55),
        a("minimal", shape="8b", layers=8, est=45), a("offload_minimal", shape="8b", layers=8, est=45),
        # ablations and XLA's options
        zoo("minimal_offload", "explicit_prefetch"),
        zoo("minimal_offload", "explicit", flags="pipelined"),
        zoo("minimal_offload", "xla", flags="double_buffer"),
        zoo("minimal_offload", "explicit", flags="double_buffer"),
        zoo("minimal_offload", "xla", flags="no_cmd_buffer"),
        zoo("minimal_offload", "xla", flags="selective"),
        zoo("qkv_offload", "explicit"),
        zoo("save_qkv", "xla", shape="8b", layers=8, est=55),
        zoo("qkv_offload", "xla", shape="8b", layers=8, est=55),
        a("full", shape="8b", layers=8, est=45),
        deepseek("save_mla_moe", "xla"), deepseek("mla_moe_offload", "xla"), deepseek("full", "xla"),
        Job("loss-curve-explicit", [sys.executable, "-m", "bench.loss_curve", "--recipe", "minimal_offload",
                                    "--impl", "explicit"], FLAGS["lhs"], 120, 240,
            ident={"bench": "loss-curve", "mechanism": "explicit", "recipe": "minimal_offload"}),
    ]


def smoke(job: Job) -> Job:
    """The same job on tiny shapes (CPU)."""
    argv = list(job.argv)
    if "bench.overlap_slice" in argv:
        argv = [x for x in argv if not x.startswith("/tmp/overlap-prof")]
        argv = [x for x in argv if x != "--profile"] + ["--smoke", "--steps", "2", "--warmup", "1"]
        argv[argv.index("--layers") + 1] = "2"
    elif "bench.loss_curve" in argv or "bench.deepseek_slice" in argv:
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
    env = {**os.environ, **job.env, "XLA_FLAGS": job.flags, "PYTHONUNBUFFERED": "1"}
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
    return {**job.ident, **rec, "job": job.name, "flag_set": job.ident.get("flag_set"), "gpu_index": gpu,
            "wall_s": wall, "flags": job.flags}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("anchor_dir")
    ap.add_argument("out")
    ap.add_argument("--deadline", type=float, default=540, help="seconds from start: start no job that cannot end")
    ap.add_argument("--only", default=None, help="regex over job names")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    todo = jobs(a.anchor_dir, a.out)
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
    q: queue.Queue = queue.Queue()
    for j in todo:
        q.put(j)
    lock = threading.Lock()
    results_path = os.path.join(a.out, "results.jsonl")

    def worker(gpu):
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
