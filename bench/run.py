"""The benchmark runner: one scenario of `bench.scenarios` (data: a list of `bench.jobs.Job`), run one process per
job, most important first, stopping before a deadline.

    python -m bench.run SCENARIO [ANCHOR_DIR] OUT_DIR [--deadline 540] [--only REGEX] [--smoke] [--list]

The plain-JAX baselines are `bench.baselines` (impl "anchor" in the records); ANCHOR_DIR (default `.anchor`) is
where a job given as `{anchor}/SCRIPT` finds its script. Each job runs in its own process
(XLA reads its flags once) with a timeout; a setting is the process's `XLA_FLAGS` plus the compile options of the
zoo's step (`BENCH_OPTIONS`; `zoo`: the library's own choice, `zoo.compile_options`). Jobs compared with each other
run on the same GPU, in sequence (GPUs of one machine may share a PCIe switch); a scenario with a job on several GPUs
runs all its jobs in one queue. A job starts only if its estimate fits before the deadline. `NCCL_NVLS_ENABLE=0`.

Writes OUT_DIR/results.jsonl (every record of every job in the schema of `bench.records`, with the job's `job`,
`scenario`, `setting`, `gpu_index`, `wall_s` and, on a GPU, `gpu_clocks` in its extras), OUT_DIR/logs/JOB.log and
JOB.smi.csv (the GPU's clock and power every 2 s while the job ran, summed by `bench.gpu_clocks`), OUT_DIR/work/JOB/
(a job's own files: the main job's train.log and metrics) and OUT_DIR/summary.md (`bench.report`). `--smoke`: the
same jobs on tiny shapes on the CPU (fake devices for a mesh), which checks the scenario and the benches, not the
figures. `--list`: the jobs, not run.
"""
from __future__ import annotations

import argparse
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

from bench import gpu_clocks, records
from bench.jobs import ANCHOR_FLAGS, ANCHORS, AUTOTUNE_CACHE, BENCHES, Job, smoke
from bench.scenarios import SCENARIOS

__all__ = ["ANCHORS", "ANCHOR_FLAGS", "BENCHES", "SCENARIOS", "Job", "main", "run", "select", "smoke"]


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
    with gpu_clocks.Sampler(gpu, os.path.join(out, "logs", job.name + ".smi.csv")) as clocks:
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
    clock = {"gpu_clocks": summary} if (summary := clocks.summary()) else {}   # the GPU's clock and power draw
    return [records.normalize({**ident, **records.flat(r), "job": job.name, "gpu_index": gpu, "wall_s": wall, **clock},
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
    """The scenario's jobs (those whose name matches `only`), in their smoke form with `smoke_run`; ValueError for
    an unknown scenario or a job whose module is not a bench (`bench.jobs.BENCHES`, `ANCHORS`)."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}: one of {', '.join(SCENARIOS)}")
    todo = [j for j in SCENARIOS[name].jobs if not only or re.search(only, j.name)]
    unknown = [j.name for j in todo if j.argv[0] == "-m" and j.program not in BENCHES + ANCHORS]
    if unknown:
        raise ValueError(f"scenario {name!r}: jobs {unknown} run a module that is not a bench of bench.jobs.BENCHES")
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
