"""What the planner knows of a device from measurement: its host link (`Link.rate_gbps`, per direction), how much of a
copy hides under compute (`Link.overlap`), and how fast a family's step runs (`step_rate`: `tflops` and `overhead`,
`zoo.models.registry.StepRate`). How the figures were measured: docs/internals.md, "Links and step rates". A device
missing here has no default: pass `--link` (and `--overlap`) and `--peak-tflops`.
"""
from __future__ import annotations

import dataclasses
import math

from zoo.models.registry import StepRate, family_of


@dataclasses.dataclass(frozen=True)
class Overlap:
    """Fraction of copy time hidden under compute: `d2h` (stores, forward pass) and `h2d` (reloads, backward)."""
    d2h: float
    h2d: float

    def __post_init__(self):
        for name in ("d2h", "h2d"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise ValueError(f"overlap must be a fraction in [0, 1], got {v!r} ({name})")

    @classmethod
    def of(cls, value: float | tuple[float, float] | Overlap) -> Overlap:
        """`value` as an Overlap: a number for both directions, or a (d2h, h2d) pair."""
        if isinstance(value, Overlap):
            return value
        if isinstance(value, tuple | list):
            return cls(float(value[0]), float(value[1]))
        return cls(float(value), float(value))

    def __str__(self) -> str:
        return f"{self.d2h:g}" if self.d2h == self.h2d else f"d2h {self.d2h:g} / h2d {self.h2d:g}"

    def exposed(self, move: float, store_window: float, reload_window: float) -> float:
        """Seconds of a layer's copies that do not hide under its compute: of `move` seconds each way, the share
        that does not overlap, plus whatever of the overlapped share outlasts its window.

        Args:
            move: seconds of transfer each way (store and reload).
            store_window: seconds of compute a store hides under (the layer's forward pass).
            reload_window: seconds of compute a reload hides under (the layer's backward pass).

        Returns:
            Seconds added to the step.
        """
        return ((1 - self.d2h) * move + self.d2h * max(0.0, move - store_window)
                + (1 - self.h2d) * move + self.h2d * max(0.0, move - reload_window))


@dataclasses.dataclass(frozen=True)
class Link:
    device_kind: str        # matched (case-insensitive substring) against jax.Device.device_kind
    rate_gbps: float        # GB/s per direction reached inside a training step (the slower direction)
    overlap: Overlap        # fraction of copy time hidden under compute, per direction
    setting: str            # the XLA setting the overlap was measured with
    date: str
    source: str


MEASURED: tuple[Link, ...] = (
    Link("H200", 55.3, Overlap(0.634, 0.475),
         "command buffers off for the offloading step (zoo.compile_options)", "2026-12-01",
         "bench/results/offload-pays_2026-12-01.jsonl: profile of the 405B-shaped slice (3 layers, batch 2, seq "
         "8192) under minimal_offload, jax 0.11.2, PCIe gen5: 14.44 GiB each way per step, D2H 48.6 GB/s and "
         "63.4% overlapped with compute, H2D 52.8 GB/s and 47.5%; qkv_offload against save_qkv exposes the same "
         "28% of its copy time as minimal_offload against minimal"),
)

@dataclasses.dataclass(frozen=True)
class AttentionRate:
    """How fast causal attention runs on a device, in FLOPs counted as `zoo.layers.attention_kernel.attention_flops`
    counts them (half of the square): the forward and backward of a step (three times the forward's count) and a
    forward re-run in the backward pass. Attention runs slower than the matmuls the step rates were measured on, at
    long context it is most of the step, and its backward's rate changes with the sequence length.

    Args:
        device_kind: matched (case-insensitive substring) against `jax.Device.device_kind`.
        kernel: the attention kernel measured ("cudnn" or "mosaic_cudnn").
        tflops: (sequence length, forward + backward TFLOP/s) points, in increasing length: `tflops_at` interpolates
            them in log2 of the length and holds the first and last past the ends.
        forward_tflops: a forward re-run in the backward pass (a recipe that does not keep the kernel's residuals).
        date: when it was measured.
        source: the records it was fitted to.
    """
    device_kind: str
    kernel: str
    tflops: tuple[tuple[int, float], ...]
    forward_tflops: float
    date: str
    source: str

    def tflops_at(self, seq: int) -> float:
        """The forward + backward rate at `seq` positions (`tflops` interpolated in log2 of the length).

        Args:
            seq: the sequence length.

        Returns:
            TFLOP/s per device.
        """
        (s0, r0), *rest = self.tflops
        if seq <= s0:
            return r0
        for s1, r1 in rest:
            if seq <= s1:
                return r0 + (r1 - r0) * (math.log2(seq) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
            s0, r0 = s1, r1
        return r0


GPU_KERNELS = ("cudnn", "mosaic_cudnn")   # the attention kernels with a measured rate (zoo.layers.attention_kernel)
# cuDNN's rates in the main job, fitted to its records past the first step (below): at 128K and 256K lower than cuDNN's
# alone (460 and 454 TFLOP/s: bench/results/attention-rates_2026-12-03.jsonl), the rest of the step's time beside
# attention included (3% at 128K, 2% at 256K); at 512K, where attention is most of the step, cuDNN's own 450.
_CUDNN_IN_STEP_H200 = ((32768, 418.0), (131072, 446.0), (262144, 445.0), (524288, 450.0))
# mosaic_cudnn's: 463 TFLOP/s measured in the step at 128K (4.0% over cuDNN's, as alone: 482.4 against 463.2); at
# 32K, 256K and 512K cuDNN's in-step rate times the ratio alone (472.7 / 463.1; about 1.065; 487.9 / 448.1).
_MOSAIC_IN_STEP_H200 = ((32768, 427.0), (131072, 463.0), (262144, 474.0), (524288, 490.0))
ATTENTION_RATES: tuple[AttentionRate, ...] = (
    AttentionRate("H200", "cudnn", _CUDNN_IN_STEP_H200, 620.0, "2026-12-03",
                  "fitted to 15 records, every one predicted within 5%: the 8B-shaped stack (batch 1, bf16, SGD) at "
                  "32K/8, 64K/4 and 128K/2 layers under full, context_offload, minimal and minimal_no_context "
                  "(bench/results/long-context_2026-12-01.jsonl), and the main job (AdamW, state on the host) past "
                  "its first step at 128K (32 layers under auto and full, 4 under long_context), 256K (32 under "
                  "auto, 148.9 s with the loss in chunks of 1,024) and 512K (8 under long_context, 134.3 s and "
                  "137.5 s traced: bench/results/longest-context_2026-12-02.jsonl, "
                  "longest-context-256k_2026-12-03.jsonl, half-million-rate_2026-12-03.jsonl, "
                  "half-million-trace_2026-12-03.jsonl); the family's step rate for the matmuls"),
    AttentionRate("H200", "mosaic_cudnn", _MOSAIC_IN_STEP_H200, 620.0, "2026-12-03",
                  "at 128K the 8B-shaped stack in the step (4 layers under long_context, SGD: 5.99 s against cuDNN's "
                  "6.13 s, bench/results/mosaic-once_2026-12-03.jsonl), the rest of the step as cuDNN's fit leaves "
                  "it; at other lengths cuDNN's rate in the step times the two kernels' measured ratio alone, through "
                  "the same layer (bench/results/attention-rates_2026-12-03.jsonl; 256K between 128K's and 512K's)"),
)


def attention_rate(device_kind: str | None, kernel: str = "cudnn") -> AttentionRate | None:
    """The measured attention rate of a device kind for `kernel`, or None (then attention runs at the step rate)."""
    return next((r for r in ATTENTION_RATES if _matches(r.device_kind, device_kind) and r.kernel == kernel), None)


def _matches(kind: str, device_kind: str | None) -> bool:
    return bool(device_kind) and kind.lower() in device_kind.lower()


def measured(device_kind: str | None) -> Link | None:
    """The measured link of a device kind (e.g. "NVIDIA H200"), or None."""
    return next((link for link in MEASURED if _matches(link.device_kind, device_kind)), None)


def step_rate(device_kind: str | None, cfg) -> StepRate | None:
    """The measured step rate of `cfg`'s family (and MoE backend) on a device kind, or None: what the family
    declares (`zoo.models.registry.Family.step_rates`)."""
    return family_of(cfg).step_rate(device_kind, cfg)
