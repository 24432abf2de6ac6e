"""Peak HBM with XLA's temporaries: the training step compiled on abstract inputs, or an estimate.

- **compiled** (the device present): `zoo.train_step.compile_abstract` lowers the main job's own step on shapes
  alone and compiles it; `memory_analysis()` gives XLA's buffer assignment: arguments (parameters, optimizer
  state, the batch), outputs, the bytes of outputs that alias a donated argument (the state is donated: its
  updated copy reuses the input's buffers), and temporaries (one block XLA allocates for the whole step: saved
  activations, gradients, transients). What the step holds at its peak is

      arguments + outputs - aliased + temporaries

  (the outputs that alias a donated argument are not allocated again). Host figures (offloaded residuals in
  pinned host memory) are `host_temp_size_in_bytes`.
- **estimate** (planning for another device, e.g. an H200 config on a laptop): a CPU compile is not a GPU's
  program: the CPU has no pinned host memory space (an offloaded residual stays in device memory there, so an
  offload recipe would look as heavy as saving), it fuses differently, upcasts bf16 arithmetic to float32 and
  runs XLA's attention where the GPU runs cuDNN's. So the estimate is the planner's own floor (saved activations
  + parameters, gradients and optimizer state) plus what any training step holds on top: the float32 logits and
  their gradient ([B, S, vocab] x 8 bytes) and one layer's intermediates and their cotangents in the backward pass
  (2 x the layer's tags). It is labelled as an estimate; the bench records show how far it is from the measured
  peak.
"""
from __future__ import annotations

import dataclasses

import jax

from zoo.plan.types import ceil_div


@dataclasses.dataclass(frozen=True)
class Peak:
    """Peak device bytes of one training step, and where the figure comes from."""
    bytes: int
    source: str                      # "compiled for <device>" or "estimate (...)"
    compiled: bool
    detail: dict                     # the memory analysis' fields, or the estimate's terms

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def device_label(device: jax.Device) -> str:
    return f"{device.device_kind} ({device.platform})" if device.device_kind != device.platform else device.platform


def from_compiled(compiled, device: jax.Device | None = None) -> Peak:
    """The peak of a compiled step: arguments + outputs - aliased + temporaries (XLA's memory analysis)."""
    ma = compiled.memory_analysis()
    if ma is None:
        raise ValueError("this backend's compiled program has no memory analysis")
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "host_temp_size_in_bytes", "generated_code_size_in_bytes", "peak_memory_in_bytes")
    detail = {f.removesuffix("_size_in_bytes").removesuffix("_in_bytes"): int(getattr(ma, f, 0) or 0)
              for f in fields}
    peak = detail["argument"] + detail["output"] - detail["alias"] + detail["temp"]
    device = device or jax.devices()[0]
    return Peak(bytes=peak, source=f"compiled for {device_label(device)}", compiled=True, detail=detail)


def estimate(floor: int, *, batch: int, seq: int, shard: int, vocab: int, layer_bytes: int, why: str) -> Peak:
    """The floor plus the float32 logits and their gradient, and one layer's intermediates and cotangents."""
    logits = 2 * 4 * ceil_div(batch, shard) * seq * vocab
    working = 2 * layer_bytes
    return Peak(bytes=floor + logits + working, source=f"estimate ({why})", compiled=False,
                detail=dict(floor=floor, logits_f32_and_grad=logits, one_layer_backward=working))
