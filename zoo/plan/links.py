"""Host links as measured inside a training step: the one place `--recipe auto` takes its link model from.

`rate_gbps` is what a copy of an offloaded residual reaches inside a step, per direction; `overlap` is the
fraction of that copy time that runs while compute runs (1: hidden under the layer's compute when it fits in the
window; 0: every copy adds its time to the step). XLA (jax 0.11.2) issues the offload copies as MemcpyD2H/H2D on
the compute stream itself, so on the H200 nothing overlaps: overlap 0 until a mechanism is measured to hide them
(issue 14). A device missing here has no default: pass `--link` (and `--overlap`).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Link:
    device_kind: str        # matched (case-insensitive substring) against jax.Device.device_kind
    rate_gbps: float        # GB/s per direction reached inside a training step (the slower direction)
    overlap: float          # fraction of copy time hidden under compute
    source: str


MEASURED: tuple[Link, ...] = (
    Link("H200", 55.3, 0.0,
         "bench/results/overlap-probe_2026-11-29.jsonl (docs/offload-profile.md): 405B-shaped slice, "
         "minimal_offload, jax 0.11.2, PCIe gen5: D2H 55.3 GB/s, H2D 55.4 GB/s inside the step, on the compute "
         "stream, 0% overlapped with compute"),
)


def measured(device_kind: str | None) -> Link | None:
    """The measured link of a device kind (e.g. "NVIDIA H200"), or None."""
    if not device_kind:
        return None
    for link in MEASURED:
        if link.device_kind.lower() in device_kind.lower():
            return link
    return None
