"""What a plan is asked for beyond the model, the recipe and the shape, in three small groups:

    zoo.plan.plan(cfg, recipe, batch=8, seq=4096,
                  hardware=Hardware(hbm_gib=141, link_gbps=55, tflops=800),   # the device planned for
                  parallel=Parallelism(mesh="fsdp=4,tp=2"),                    # how the step is split over devices
                  training=Training(optimizer="adamw", grad_accum=2))          # what the step keeps and how it updates

Each group checks its own values when it is made (a ValueError naming the field); checks between groups and the
shape (a mesh the batch does not split over, micro-batches that do not divide it) are the planner's.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from zoo.opt_state import OPT_STATE_PLACES, PARAMS_PLACES
from zoo.plan.types import OPTIMIZERS


def check_positive(name: str, value, kind=int) -> None:
    """ValueError unless `value` is None or a positive `kind` (int; float also accepts an int)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) or not value > 0:
        raise ValueError(f"{name} must be a positive {'number' if kind is float else 'int'}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The device planned for. `hbm_gib`: the HBM budget per device (warned about; needed by recipe "auto");
    `host_gib`: host memory per device for "auto" (None: unbounded); `link_gbps` (GB/s per direction) and
    `overlap` (the fraction of transfer time hidden under compute: one for both directions or a (device-to-host,
    host-to-device) pair) default to the link measured on `device_kind` (`zoo.plan.links`; default: the device
    present); `tflops`: the matmul rate for "auto" and the step time; `step_tflops`: the executed rate of the
    family's step (default: measured, `zoo.plan.links.step_rate`: the family's own, else `tflops`)."""
    hbm_gib: float | None = None
    host_gib: float | None = None
    link_gbps: float | None = None
    overlap: Any = None
    tflops: float | None = None
    step_tflops: float | None = None
    device_kind: str | None = None

    def __post_init__(self):
        for name in ("hbm_gib", "host_gib", "link_gbps", "tflops", "step_tflops"):
            check_positive(name, getattr(self, name), float)


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """How the step is split: `shard=N` devices (data parallel + FSDP, a uniform split: every byte divided by N),
    or `mesh` (a spec "fsdp=4,tp=2", a {axis: size} dict, a Mesh or an AbstractMesh: split by the sharding rules,
    `zoo.plan.mesh`), not both."""
    shard: int = 1
    mesh: Any = None

    def __post_init__(self):
        check_positive("shard", self.shard)
        if self.mesh is not None and self.shard != 1:
            raise ValueError(f"give shard={self.shard} or mesh={self.mesh!r}, not both (shard=N is a uniform split "
                             f"over N devices; a mesh splits by the sharding rules)")


@dataclasses.dataclass(frozen=True)
class Training:
    """What the step keeps and how it updates: `optimizer` (its moments per parameter, `OPTIMIZERS`) in
    `opt_dtype`, living on the "device" or in pinned "host" memory between steps (`opt_state`); `params="host"`: a
    float32 master copy of the (16-bit) parameters in pinned host memory (`zoo.optim.with_master`; "device": none);
    `grad_accum` K micro-batches of batch / K per update, with float32 gradient sums; `loss_chunk`: positions of
    the sequence per chunk of the LM head and its cross-entropy (`zoo.train_step`: "auto", None, or a divisor of
    the sequence)."""
    optimizer: str = "adamw"
    opt_dtype: str = "float32"
    grad_accum: int = 1
    opt_state: str = "device"
    params: str = "device"
    loss_chunk: int | str | None = "auto"

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
        check_positive("grad_accum", self.grad_accum)
        if self.opt_state not in OPT_STATE_PLACES:
            raise ValueError(f"opt_state={self.opt_state!r}: choose one of {', '.join(OPT_STATE_PLACES)}")
        if self.params not in PARAMS_PLACES:
            raise ValueError(f"params={self.params!r}: choose one of {', '.join(PARAMS_PLACES)}")
