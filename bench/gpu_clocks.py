"""The GPU's clock and power while a job runs: `nvidia-smi` sampled every 2 s beside the job, summed into the record.

The same command can run at different speeds on two machines of one kind: under a long step an H200 holds its power
cap (690-700 W) by lowering its SM clock, and how far depends on the chip. The summary says how hard this GPU was
held back, so two records of one command can be read side by side.

    with gpu_clocks.Sampler("0", "/tmp/job-smi.csv") as s:
        ...                                    # the job
    s.summary()   # {"samples": 120, "loaded": 96, "sm_mhz": 1620.6, "power_w": 691.4, "power_capped": 0.99}

`summarise(path)` reads a log written by `nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,...
--format=csv` by hand as well (its header names the columns; units are dropped).
"""
from __future__ import annotations

import csv
import shutil
import subprocess

QUERY = "timestamp,clocks.sm,power.draw,power.limit,clocks_throttle_reasons.active"
SW_POWER_CAP = 0x4   # nvidia-smi's clocks_event_reasons bit: the clock is lowered to hold the power limit
LOADED_W = 300.0     # a sample above this draw is counted as the job computing (an idle H200 draws 80-150 W)


class Sampler:
    """Samples one GPU into `path` for the life of a `with` block; nothing where nvidia-smi is missing.

    Args:
        gpu: the GPU's index as nvidia-smi numbers it (None: the first).
        path: the CSV log's path.
        every_s: seconds between samples.
    """

    def __init__(self, gpu: str | None, path: str, every_s: int = 2):
        self.gpu, self.path, self.every_s, self.proc = gpu, path, every_s, None

    def __enter__(self) -> Sampler:
        if shutil.which("nvidia-smi"):
            argv = ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv", "-l", str(self.every_s)]
            argv += ["-i", self.gpu.split(",")[0]] if self.gpu else []
            self.out = open(self.path, "w")
            self.proc = subprocess.Popen(argv, stdout=self.out, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *_) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.out.close()

    def summary(self) -> dict | None:
        """The log's summary (`summarise`), or None where nothing was sampled."""
        return summarise(self.path) if self.proc is not None else None


def _number(text: str) -> float | None:
    """A sample's value: "1980 MHz" -> 1980.0, "0x0000000000000004" -> 4.0, "[N/A]" -> None."""
    word = text.strip().split(" ")[0]
    try:
        return float(int(word, 16)) if word.startswith("0x") else float(word)
    except ValueError:
        return None


def summarise(path: str) -> dict | None:
    """What one nvidia-smi CSV log says of the job: how many samples, how many under load (over `LOADED_W`), and
    under load the mean SM clock (MHz), the mean draw (W) and the share of samples held at the power cap.

    Args:
        path: the CSV log (`Sampler`'s, or one written by hand with `--format=csv`: its header names the columns).

    Returns:
        {"samples", "loaded", and where any sample was under load "sm_mhz", "power_w", "power_capped"}; None for a
        log with no sample.
    """
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    if len(rows) < 2:
        return None
    head = [h.strip().split(" ")[0] for h in rows[0]]
    col = {name: head.index(name) for name in ("clocks.current.sm", "clocks.sm", "power.draw",
                                               "clocks_event_reasons.active", "clocks_throttle_reasons.active")
           if name in head}
    sm = col.get("clocks.current.sm", col.get("clocks.sm"))
    reason = col.get("clocks_event_reasons.active", col.get("clocks_throttle_reasons.active"))
    samples = [(_number(r[sm]), _number(r[col["power.draw"]]), _number(r[reason]) if reason is not None else None)
               for r in rows[1:] if len(r) == len(head)]
    loaded = [s for s in samples if s[0] is not None and s[1] is not None and s[1] > LOADED_W]
    out = {"samples": len(samples), "loaded": len(loaded)}
    if loaded:
        out.update(sm_mhz=round(sum(s[0] for s in loaded) / len(loaded), 1),
                   power_w=round(sum(s[1] for s in loaded) / len(loaded), 1),
                   power_capped=round(sum(1 for s in loaded if s[2] is not None and int(s[2]) & SW_POWER_CAP)
                                      / len(loaded), 3))
    return out
