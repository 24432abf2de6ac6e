"""`--recipe auto` on a device: what `zoo.plan.plan(model_cfg, "auto", ...)` needs, taken from the device.

The planner's automatic recipe (`zoo.plan.auto`) needs an HBM budget, a host link (rate and overlap) and a
FLOP rate. On a device each has a default, and every figure says where it came from:

- HBM: `--hbm-limit`, else the device's allocator limit (`memory_stats()["bytes_limit"]`); a device without one
  (the CPU) needs `--hbm-limit`.
- link: `--link` (GB/s per direction, with `--overlap`, default 0), else the link measured for the device kind
  inside a training step (`zoo.plan.links`: on the H200 with jax 0.11.2, 55.3 GB/s, 63% of the stores and 48% of
  the reloads hidden under compute once the step's copies leave the compute stream).
- FLOP rate: `--peak-tflops`, else the main job's per-device table (`recipes.train.watching.meter.peak_tflops`: the
  datasheet bf16 peak).

The planner fills the budget with saved activations and model state beside what it expects XLA's temporaries to
take; the main job compiles the choice and, while its peak is over the device's limit, plans again with the budget
lowered by the excess (`zoo.plan.fit`): the recipe that runs is one whose compiled peak fits.
"""
from __future__ import annotations

import dataclasses

import jax

import zoo
from recipes.train.watching import meter
from zoo.plan import links
from zoo.plan.build import ONE_DEVICE
from zoo.plan.peak import allocator_limit
from zoo.training import STEP

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Inputs:
    hbm_gib: float
    hbm_source: str
    link_gbps: float
    overlap: links.Overlap
    link_source: str
    tflops: float
    tflops_source: str

    def hardware(self, hbm_gib: float | None = None) -> zoo.plan.Hardware:
        """These inputs as the planner's `Hardware` (the HBM budget `hbm_gib` if given)."""
        return zoo.plan.Hardware(hbm_gib=self.hbm_gib if hbm_gib is None else hbm_gib, link_gbps=self.link_gbps,
                                 overlap=self.overlap, tflops=self.tflops)

    def describe(self) -> str:
        return (f"HBM {self.hbm_gib:.1f} GiB ({self.hbm_source}), link {self.link_gbps:g} GB/s with overlap "
                f"{self.overlap} ({self.link_source}), {self.tflops:g} TFLOP/s ({self.tflops_source})")


def inputs(device: jax.Device, *, hbm_gib: float | None = None, link_gbps: float | None = None,
           overlap: float | None = None, tflops: float | None = None) -> Inputs:
    """The automatic recipe's inputs for `device`, each given or taken from the device. Where neither is possible
    (the CPU: all three), one ValueError names every missing input and its flag at once."""
    kind = device.device_kind
    missing = []
    if hbm_gib is not None:
        hbm, hbm_src = hbm_gib, "--hbm-limit"
    else:
        limit = allocator_limit(device)
        hbm, hbm_src = (limit or 0) / GiB, f"{kind}'s bytes_limit"
        if not limit:
            missing.append(f"an HBM budget: {kind} reports no memory limit; pass --hbm-limit GIB")
    if link_gbps is not None:
        rate, ovl, link_src = link_gbps, links.Overlap.of(0.0 if overlap is None else overlap), "--link"
    else:
        measured = links.measured(kind)
        if measured is None:
            rate, ovl, link_src = 0.0, links.Overlap.of(0.0), ""
            missing.append(f"a host link: none is measured for {kind!r} (zoo.plan.links: "
                           f"{', '.join(m.device_kind for m in links.MEASURED)}); pass --link GBPS")
        else:
            rate, ovl = measured.rate_gbps, measured.overlap if overlap is None else links.Overlap.of(overlap)
            link_src = f"measured on the {measured.device_kind}, zoo.plan.links"
    rate_tflops, tflops_src = meter.peak_tflops(device, tflops)
    if rate_tflops is None:
        missing.append(f"a FLOP rate: no datasheet peak is known for {kind!r} (recipes.train.watching.meter); "
                       f"pass --peak-tflops TFLOPS")
    if missing:
        raise ValueError("--recipe auto needs " + "; and ".join(missing))
    return Inputs(hbm, hbm_src, rate, ovl, link_src, rate_tflops, tflops_src)


def choose(model_cfg, ins: Inputs, *, batch: int, seq: int, training: zoo.plan.Training = STEP,
           parallel: zoo.plan.Parallelism = ONE_DEVICE) -> zoo.Recipe:
    """The recipe `zoo.plan` chooses for the model config `model_cfg` at [batch, seq] with `ins`."""
    return zoo.plan.plan(model_cfg, "auto", batch=batch, seq=seq, hardware=ins.hardware(), parallel=parallel,
                         training=training, peak=None).recipe


def summary(recipe: zoo.Recipe) -> str:
    names = recipe.resolve()
    kept = ", ".join(names.device) or "none"
    sent = ", ".join(names.offload) or "none"
    return f"keeps [{kept}] in HBM, offloads [{sent}], recomputes every other tag"

