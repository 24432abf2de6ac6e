"""What a plan is: per tag, per stack, the model state and the whole plan (frozen dataclasses), and the units.

Every byte and FLOP figure is per device. `Plan.to_dict()` is the JSON the command line prints; the tables are
`zoo.plan.report`.
"""
from __future__ import annotations

import dataclasses

from zoo.plan.links import Overlap
from zoo.recipe import Recipe

GiB, MiB = 1 << 30, 1 << 20
CARRY = "decoder_layer_input"
# Optimizer moments kept per parameter.
OPTIMIZERS = {"adamw": 2, "adam": 2, "lion": 1, "momentum": 1, "sgd": 0}
POOL_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
"""The variable that sizes XLA's pinned host pool on GPUs (an integer, GiB; `POOL_DEFAULT_GIB` when unset)."""
POOL_DEFAULT_GIB = 64


def fmt_bytes(n: float) -> str:
    """A byte count as the planner's tables print it: binary units (B, KiB, MiB, GiB, TiB), one decimal.

    Args:
        n: the bytes.

    Returns:
        the text, e.g. "1.5 GiB".

    Examples:
        >>> from zoo.plan import fmt_bytes
        >>> fmt_bytes(512), fmt_bytes(3 * 2**29), fmt_bytes(2**41)
        ('512 B', '1.5 GiB', '2.0 TiB')
    """
    if n >= 1024 * GiB:
        return f"{n / (1024 * GiB):.1f} TiB"
    if n >= GiB:
        return f"{n / GiB:.1f} GiB"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{int(n)} B"


def fmt_flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} FLOP"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class TagPlan:
    """What one tag (`zoo.tags`) of one stack costs under the recipe: where the recipe puts the tensor (kept in HBM,
    offloaded to pinned host memory, or rematerialized in the backward pass) and its bytes, per layer and per device.

    Args:
        tag: the tag's name.
        shape: the global shape of one layer's tensor.
        dtype: its dtype's name ("bfloat16", ...).
        placement: "device", "offload" or "remat".
        residual: whether the backward pass reads it at all (a tensor it never reads costs nothing anywhere).
        nbytes: one layer's tensor's bytes when it is saved (0 if not a residual).
        device_bytes: the bytes it holds in HBM per layer.
        host_bytes: the bytes it holds in pinned host memory per layer.
        note: why it is where it is ("" if nothing to say).
        device_shape: one device's part when the step is split over devices (None: not split).

    Examples:
        >>> import zoo
        >>> from zoo.models import LlamaConfig
        >>> recipe = zoo.Recipe("mlp_host", offload=("mlpwi_0", "mlpwi_1"))
        >>> p = zoo.plan.plan(LlamaConfig.preset("tiny"), recipe, batch=1, seq=8, peak=None)
        >>> t = next(t for t in p.stacks[0].tags if t.tag == "mlpwi_0")
        >>> t.shape, t.placement, t.host_bytes   # [B, S, F] in float32, offloaded
        ((1, 8, 128), 'offload', 4096)
    """
    tag: str
    shape: tuple[int, ...]
    dtype: str
    placement: str
    residual: bool
    nbytes: int
    device_bytes: int
    host_bytes: int
    note: str = ""
    device_shape: tuple[int, ...] | None = None

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "shape": list(self.shape),
                "device_shape": None if self.device_shape is None else list(self.device_shape)}


@dataclasses.dataclass(frozen=True)
class StackPlan:
    """What one stack of scanned layers (`zoo.models.Stack`) costs under the recipe: a `TagPlan` per tag of a layer,
    and the layers' bytes and FLOPs, per device; its properties sum them (`device_bytes`, `host_bytes`, per layer
    and over the stack).

    Args:
        name: the stack's name in the model ("layers", ...).
        num_layers: its layers.
        tags: one `TagPlan` per tag a layer emits.
        untagged_bytes: per layer, the residuals JAX saves beyond the tags (recipe `none`).
        invariant_bytes: once per stack, the residuals JAX hoists out of the scan (masks, RoPE tables).
        forward_flops: per layer, the forward pass's FLOPs.
        remat_flops: per layer, the forward work the recipe re-runs in the backward pass.
        attention_flops: per layer, causal attention's share of `forward_flops`.
        remat_attention_flops: per layer, attention's share of `remat_flops`.

    Examples:
        >>> import zoo
        >>> from zoo.models import LlamaConfig
        >>> recipe = zoo.Recipe("mlp_host", offload=("mlpwi_0", "mlpwi_1"))
        >>> p = zoo.plan.plan(LlamaConfig.preset("tiny"), recipe, batch=1, seq=8, peak=None)
        >>> s = p.stacks[0]
        >>> s.name, s.num_layers, s.host_bytes   # two layers of two [1, 8, 128] float32 tensors offloaded
        ('layers', 2, 16384)
    """
    name: str
    num_layers: int
    tags: tuple[TagPlan, ...]
    untagged_bytes: int
    invariant_bytes: int
    forward_flops: int
    remat_flops: int
    attention_flops: int = 0
    remat_attention_flops: int = 0

    @property
    def device_bytes_per_layer(self) -> int:
        return sum(t.device_bytes for t in self.tags) + self.untagged_bytes

    @property
    def host_bytes_per_layer(self) -> int:
        return sum(t.host_bytes for t in self.tags)

    @property
    def device_bytes(self) -> int:
        return self.num_layers * self.device_bytes_per_layer + self.invariant_bytes

    @property
    def host_bytes(self) -> int:
        return self.num_layers * self.host_bytes_per_layer

    def to_dict(self) -> dict:
        return dict(name=self.name, num_layers=self.num_layers, tags=[t.to_dict() for t in self.tags],
                    untagged_bytes_per_layer=self.untagged_bytes,
                    invariant_bytes=self.invariant_bytes,
                    device_bytes_per_layer=self.device_bytes_per_layer,
                    host_bytes_per_layer=self.host_bytes_per_layer, device_bytes=self.device_bytes,
                    host_bytes=self.host_bytes, forward_flops_per_layer=self.forward_flops,
                    remat_flops_per_layer=self.remat_flops, remat_flops=self.num_layers * self.remat_flops)


@dataclasses.dataclass(frozen=True)
class ModelState:
    """The bytes of the model's state per device, beyond the activations: parameters, their gradients, the
    optimizer's moments, other variables; with gradient accumulation, the float32 sums of the micro-batches'
    gradients; with a float32 master copy of the parameters, its bytes. `total` is what the state holds in HBM,
    `host` what it holds in pinned host memory.

    Args:
        num_params: the parameters' count (`zoo.models.count_params`), not per device.
        params: the parameters' bytes.
        grads: their gradients' bytes.
        optimizer: the optimizer's moments' bytes.
        other: the other variables' bytes (e.g. a router's bias).
        optimizer_name: the optimizer ("adamw", ...).
        accum: the float32 gradient sums' bytes (0 without gradient accumulation).
        optimizer_host: whether the moments live in pinned host memory between steps (then `total` leaves them
            out and `host` counts them).
        master: the float32 master copy's bytes (0 without one).
        master_host: whether the master copy lives in pinned host memory.
        streamed: the bytes of the decoder stacks' parameters that live in pinned host memory (`--params stream`;
            0 otherwise): their gradients go there too, so `total` leaves both out and `host` counts both.
        streamed_window: HBM that streaming holds through the step: the parameters and gradients of the layers one
            rematerialized body runs at a time (0 without streaming).

    Examples:
        >>> import zoo
        >>> from zoo.models import LlamaConfig
        >>> p = zoo.plan.plan(LlamaConfig.preset("tiny"), zoo.Recipe.none(), batch=1, seq=8, peak=None)
        >>> s = p.state   # float32 parameters, gradients and AdamW's two moments: 4 x 4 bytes a parameter
        >>> s.total == 16 * s.num_params, s.host
        (True, 0)
    """
    num_params: int
    params: int
    grads: int
    optimizer: int
    other: int
    optimizer_name: str
    accum: int = 0
    optimizer_host: bool = False
    master: int = 0
    master_host: bool = False
    streamed: int = 0
    streamed_window: int = 0

    @property
    def total(self) -> int:
        """HBM held by the model state between steps and through the step."""
        return (self.params + self.grads - 2 * self.streamed + self.streamed_window + self.accum + self.other
                + (0 if self.optimizer_host else self.optimizer) + (0 if self.master_host else self.master))

    @property
    def host(self) -> int:
        """Pinned host memory held by the model state (the moments and the master, where they live there; the
        streamed parameters and their gradients)."""
        return ((self.optimizer if self.optimizer_host else 0) + (self.master if self.master_host else 0)
                + 2 * self.streamed)

    def in_groups(self, group: int) -> ModelState:
        """This state with the streaming window of a recipe that rematerializes `group` layers at a time."""
        return dataclasses.replace(self, streamed_window=self.streamed_window * group)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total": self.total, "host": self.host}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `recipe` costs for a model at [batch, seq], the result of `zoo.plan.plan`: per stack, per tag, the saved
    activations in HBM and in pinned host memory and the recompute; the model state; the step's peak HBM; the
    predicted step time (`step_time`). Every byte and FLOP figure is per device. `to_dict()` is the JSON the command
    line prints, `zoo.plan.render` the tables.

    Args:
        model: the plan's label (`zoo.plan.plan`'s `model_name`, else the config's class name).
        recipe: the `zoo.Recipe` planned (for "auto", the one chosen).
        batch: the global batch.
        seq: the sequence length.
        shard: the devices the step is split over.
        stacks: one `StackPlan` per stack of the model.
        state: the `ModelState`.
        hbm_budget: the HBM budget per device in bytes (None: none given).
        host_pool: XLA's pinned host pool in bytes (`zoo.plan.host_pool_bytes`).
        warnings: what the plan warns of, one line each.
        link_gbps: the host link's rate per direction, GB/s (None: unknown).
        tflops: the matmul rate given, TFLOP/s.
        mesh: the mesh planned under, e.g. "dp=1,fsdp=4,tp=2,ep=1" (None: none; `shard` is its device count).
        overlap: the fraction of copy time hidden under compute (`zoo.plan.links.Overlap`).
        link_source: where `link_gbps` and `overlap` come from.
        peak: the step's peak HBM, compiled or estimated (`zoo.plan.peak.Peak`; None: not asked for).
        model_flops: the family's model FLOPs per step, forward and backward.
        step_tflops: the rate the step runs its FLOPs at on the device (`zoo.plan.links.step_rate`).
        step_overhead: the step's non-FLOP work, as a fraction of its model FLOPs' time.
        attention_tflops: causal attention's forward and backward rate (`zoo.plan.links`).
        attention_forward_tflops: its forward re-run's rate.
        attention_kernel: the attention kernel whose measured rates these are ("cudnn", "mosaic_cudnn"; None: none
            measured, attention at the step's rate).
        step_rate_source: where `step_tflops` comes from.
        grad_accum: micro-batches per update (activations are a micro-batch's: batch / grad_accum).
        loss_chunk: the positions per chunk of the loss the plan counts (None: the whole sequence).

    Examples:
        >>> import zoo
        >>> from zoo.models import LlamaConfig
        >>> p = zoo.plan.plan(LlamaConfig.preset("tiny"), zoo.Recipe.none(), batch=1, seq=8, peak=None)
        >>> p.model, p.recipe.name, [s.name for s in p.stacks], p.peak_bytes
        ('LlamaConfig', 'none', ['layers'], None)
        >>> p.hbm_bytes == p.activation_bytes + p.state.total
        True
    """
    model: str
    recipe: Recipe
    batch: int
    seq: int
    shard: int
    stacks: tuple[StackPlan, ...]
    state: ModelState
    hbm_budget: int | None
    host_pool: int
    warnings: tuple[str, ...]
    link_gbps: float | None = None
    tflops: float | None = None
    mesh: str | None = None
    overlap: Overlap = Overlap(0.0, 0.0)
    link_source: str | None = None
    peak: object | None = None
    model_flops: float | None = None
    step_tflops: float | None = None
    step_overhead: float = 0.0
    attention_tflops: float | None = None
    attention_forward_tflops: float | None = None
    attention_kernel: str | None = None
    step_rate_source: str | None = None
    grad_accum: int = 1
    loss_chunk: int | None = None

    @property
    def peak_bytes(self) -> int | None:
        """Peak HBM of the training step with XLA's temporaries (compiled), or an estimate; see `peak_source`."""
        return None if self.peak is None else self.peak.bytes

    @property
    def peak_source(self) -> str | None:
        """"compiled for <device>" or "estimate (...)"."""
        return None if self.peak is None else self.peak.source

    @property
    def activation_bytes(self) -> int:
        """HBM held by saved activations, over all stacks."""
        return sum(s.device_bytes for s in self.stacks)

    @property
    def host_bytes(self) -> int:
        """Pinned host memory held by offloaded activations (one micro-batch's)."""
        return sum(s.host_bytes for s in self.stacks)

    @property
    def host_total(self) -> int:
        """Pinned host memory: offloaded activations plus the model state kept there (`ModelState.host`)."""
        return self.host_bytes + self.state.host

    @property
    def hbm_bytes(self) -> int:
        """Saved activations plus model state (no temporaries: a floor)."""
        return self.activation_bytes + self.state.total

    @property
    def remat_flops(self) -> int:
        """Forward FLOPs re-run in the backward pass, per step."""
        return sum(s.num_layers * s.remat_flops for s in self.stacks)

    @property
    def forward_flops(self) -> int:
        return sum(s.num_layers * s.forward_flops for s in self.stacks)

    def step_time(self, stacks_only: bool = False) -> dict | None:
        """The predicted time of a training step: its model FLOPs with the step's measured non-FLOP work
        (`step_overhead`), plus the recipe's recompute, at the step's measured rate (`step_tflops`, else `tflops`), plus
        the transfers that do not hide (docs/internals.md, "The predicted step time"). None without a rate, or with host
        bytes and no link. `stacks_only`: the decoder stacks alone, as a benchmark of the stacks runs them."""
        tflops = self.step_tflops or self.tflops
        if tflops is None or (self.host_total and self.link_gbps is None):
            return None
        rate, link, ov = tflops * 1e12, (self.link_gbps or 1.0) * 1e9, self.overlap
        work = self.model_flops if self.model_flops is not None and not stacks_only else 3 * self.forward_flops
        overhead = self.step_overhead if self.step_tflops else 0.0
        # causal attention at its own measured rate where there is one (it runs slower than the matmuls)
        attention = sum(s.num_layers * s.attention_flops for s in self.stacks)
        again = sum(s.num_layers * s.remat_attention_flops for s in self.stacks)
        att_rate = (self.attention_tflops or tflops) * 1e12
        fwd_rate = (self.attention_forward_tflops or tflops) * 1e12
        out = dict(compute_s=(work - 3 * attention) * (1 + overhead) / rate + 3 * attention / att_rate,
                   remat_s=(self.remat_flops - again) / rate + again / fwd_rate, exposed_transfer_s=0.0)
        k = self.grad_accum
        for s in self.stacks:   # FLOPs are per step (k micro-batches); a micro-batch's copies hide under its own
            fwd, remat, move = s.forward_flops / rate / k, s.remat_flops / rate / k, s.host_bytes_per_layer / link
            exposed = ov.exposed(move, fwd, 2 * fwd + remat)
            out["exposed_transfer_s"] += k * s.num_layers * exposed
        out["exposed_transfer_s"] += 2 * self.state.host / link
        layers = sum(s.num_layers for s in self.stacks)
        if self.state.streamed and layers:
            # streamed parameters: each layer's slice comes in for its forward pass and again for the backward pass's
            # recompute, and its gradient goes out during the backward pass, each copy under its pass's compute
            move = self.state.streamed / layers / link
            for s in self.stacks:
                fwd, remat = s.forward_flops / rate / k, s.remat_flops / rate / k
                back = 2 * fwd + remat
                again = (1 - ov.h2d) * move + ov.h2d * max(0.0, move - back)
                out["exposed_transfer_s"] += k * s.num_layers * (ov.exposed(move, back, fwd) + again)
        out["total_s"] = sum(out.values())
        out["rate_tflops"] = tflops
        return out

    def to_dict(self) -> dict:
        names = self.recipe.resolve()
        return dict(model=self.model, recipe=self.recipe.name, offload=list(names.offload),
                    device=list(names.device), special=self.recipe.special, batch=self.batch, seq=self.seq,
                    shard=self.shard, mesh=self.mesh, grad_accum=self.grad_accum, loss_chunk=self.loss_chunk,
                    seq_tiles=self.recipe.seq_tiles, group=self.recipe.group, subgroup=self.recipe.subgroup,
                    group_keep=list(names.group_keep), lead_device=list(names.lead_device),
                    lead_offload=list(names.lead_offload),
                    stacks=[s.to_dict() for s in self.stacks],
                    model_state=self.state.to_dict(),
                    totals=dict(activation_bytes=self.activation_bytes, host_bytes=self.host_bytes,
                                host_total=self.host_total,
                                hbm_bytes=self.hbm_bytes, remat_flops=self.remat_flops,
                                forward_flops=self.forward_flops),
                    hbm_budget=self.hbm_budget, host_pool=self.host_pool, link_gbps=self.link_gbps,
                    tflops=self.tflops, overlap=dataclasses.asdict(self.overlap), link_source=self.link_source,
                    model_flops=self.model_flops, step_tflops=self.step_tflops, step_overhead=self.step_overhead,
                    step_rate_source=self.step_rate_source, attention_tflops=self.attention_tflops,
                    attention_kernel=self.attention_kernel, step_time=self.step_time(), peak_bytes=self.peak_bytes,
                    peak_source=self.peak_source,
                    peak=None if self.peak is None else self.peak.to_dict(), warnings=list(self.warnings))
