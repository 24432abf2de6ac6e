"""What a step costs: tokens/s, model TFLOP/s, MFU against the device's peak, peak HBM and host bytes.

Model FLOPs are the model's, not the hardware's: recomputation (remat) is not counted, so a recipe that
recomputes more shows a lower MFU for the same model (the convention of the reference study and MaxText).
"""
from __future__ import annotations

import jax

# Dense bf16 peak TFLOP/s from the vendors' datasheets, matched against `device.device_kind` (longest match
# first). Datasheet peaks are not reached by real matmuls (about 800 measured on an H200): pass
# `--peak-tflops` to measure MFU against your own figure.
PEAK_TFLOPS: dict[str, float] = {
    "GB200": 2450.0,
    "B200": 2250.0,
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "TPU v6 lite": 918.0,
    "TPU v5 lite": 197.0,
    "TPU v5": 459.0,
    "TPU v4": 275.0,
}


def peak_tflops(device: jax.Device, override: float | None = None) -> tuple[float | None, str]:
    """(peak TFLOP/s or None, where it came from)."""
    return peak_tflops_of(device.device_kind, override)


def peak_tflops_of(kind: str, override: float | None = None) -> tuple[float | None, str]:
    """(peak TFLOP/s of the device kind `kind` or None, where it came from)."""
    if override is not None:
        return override, "--peak-tflops"
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key.lower() in kind.lower():
            return PEAK_TFLOPS[key], f"datasheet bf16 peak of {key}"
    return None, f"no known peak for {kind!r} (pass --peak-tflops for MFU)"


def peak_hbm_bytes(device: jax.Device) -> int | None:
    """Peak bytes in use on the device so far (None where the backend keeps no statistics, e.g. the CPU)."""
    stats = device.memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


def host_bytes(compiled, *, state_on_host: bool = False) -> int | None:
    """Host memory the compiled step uses for offloaded values (None where XLA does not say).

    With part of the state in pinned host memory (`--opt-state host`, `--params host`) XLA's memory analysis has
    reported no host temporaries at all: 0 B on an H200 (jax 0.11.2) for a step that brought that state into HBM a
    whole leaf at a time, whose optimized HLO held the same pinned-host (S(5)) buffers of the offloaded tags as the
    step with its state in HBM (the streamed update's step reports them). A 0 there is not a measurement, so it is
    None (not known) and the caller falls back on the plan."""
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # not every backend implements it
        return None
    temps = None if analysis is None else getattr(analysis, "host_temp_size_in_bytes", None)
    return None if state_on_host and not temps else temps


def host_note(host: int | None, plan, platform: str) -> str:
    """What the compile says of the offloaded values' host memory; with the state on the host XLA says nothing."""
    if host is not None:
        return f"; host memory for offloaded values: {fmt_bytes(host)}"
    if platform != "cpu" and plan.host_bytes:
        return (f"; host memory for offloaded values: not reported by XLA while state lives in pinned host memory "
                f"(planned {fmt_bytes(plan.host_bytes)})")
    return ""


def fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
