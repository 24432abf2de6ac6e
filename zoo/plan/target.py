"""Where a plan's figures come from: the device planned for (the one present, or another by its kind), its host
link and step rate (given, or measured: `zoo.plan.links`), and how the peak HBM is found (a step given, one
compiled here, or an estimate: `zoo.plan.peak`), decided before anything is traced."""
from __future__ import annotations

import jax

from zoo import sharding
from zoo.plan import links
from zoo.plan import mesh as mesh_plan
from zoo.plan import peak as peak_lib
from zoo.plan.inputs import Training


def device_target(device: str | None) -> tuple[str, bool, jax.Device]:
    """(the device kind planned for, whether it is the device present, the device present)."""
    present = jax.devices()[0]
    if device is None:
        return present.device_kind, True, present
    same = device.lower() in (present.device_kind.lower(), present.platform.lower()) or (
        present.platform != "cpu" and device.lower() in present.device_kind.lower())
    return device, same, present


def link_of(device_kind: str, link_gbps: float | None, overlap) -> tuple[float | None, links.Overlap, str | None]:
    """(link GB/s, overlap per direction, where they come from): given, else measured for the device
    (zoo.plan.links). `overlap` is a fraction for both directions or a (d2h, h2d) pair."""
    m = links.measured(device_kind)
    given = None if overlap is None else links.Overlap.of(overlap)
    if link_gbps is None and m is not None:
        return m.rate_gbps, m.overlap if given is None else given, (
            f"measured on {m.device_kind} with {m.setting}, {m.date}: {m.source}")
    ov = given if given is not None else (m.overlap if m is not None else links.Overlap(0.0, 0.0))
    src = None if link_gbps is None else (
        "given" + ("" if given is not None else
                   f"; overlap {ov}: " + ("measured" if m is not None else "no overlap measured for " + device_kind)))
    return link_gbps, ov, src


def step_rate_of(device_kind: str, cfg, step_tflops: float | None) -> tuple[float | None, float, str | None]:
    """(the rate recompute adds time at, the step's non-FLOP work as a fraction, where they come from) for the
    family's training step on the device: given (no overhead), else measured (zoo.plan.links.step_rate)."""
    if step_tflops is not None:
        return step_tflops, 0.0, "given"
    r = links.step_rate(device_kind, cfg)
    return ((None, 0.0, None) if r is None else
            (r.tflops, r.overhead, f"measured on {r.device_kind}, {r.date}: {r.source}"))


def peak_target(mode, compiled, *, device, mesh, amesh, shard) -> tuple[str | None, object, str]:
    """How the peak is found, decided before anything is traced: (mode: "compiled" (given), "compile", "estimate"
    or None; the mesh to compile on or to label a given compiled step with; why it is estimated). ValueError for a
    bad `peak`, or for peak="compile" where nothing here can compile the step asked for."""
    kind, same, present = device_target(device)
    if compiled is not None:
        return "compiled", mesh if isinstance(mesh, jax.sharding.Mesh) else amesh, ""
    if mode is None:
        return None, None, ""
    if mode not in ("auto", "compile", "estimate"):
        raise ValueError(f"peak={mode!r}: choose 'auto', 'compile', 'estimate' or None")
    if mode == "compile" and not same:
        raise ValueError(f"peak='compile' compiles for the device present ({peak_lib.device_label(present)}), "
                         f"not for {device!r}: plan there, or take the estimate")
    concrete, why = None, ""
    if not same:
        why = f"planned for {kind} on {peak_lib.device_label(present)}"
    elif amesh is None and shard > 1:
        if mode == "compile":
            raise ValueError(f"peak='compile' with shard={shard}: a uniform split is not a program; give "
                             f"mesh='fsdp={shard}' (or another mesh) to compile the sharded step")
        why = f"shard={shard} is a uniform split: mesh= compiles the sharded step"
    elif amesh is not None:
        n = mesh_plan.devices(amesh)
        if isinstance(mesh, jax.sharding.Mesh):
            concrete = mesh
        else:
            devices = jax.devices()
            if n <= len(devices):
                concrete = sharding.make_mesh(sharding.mesh_sizes(amesh), devices[:n])
            elif mode == "compile":
                raise ValueError(f"peak='compile' under mesh {peak_lib.mesh_label(amesh)} needs {n} devices, but "
                                 f"{len(devices)} {present.platform} device(s) are present: plan on a machine with "
                                 f"{n}, or take the estimate")
            else:
                why = (f"mesh {peak_lib.mesh_label(amesh)} needs {n} devices, {len(devices)} "
                       f"{peak_lib.device_label(present)} present")
    if mode == "auto":
        mode = "compile" if not why and present.platform != "cpu" else "estimate"
    if mode == "estimate" and not why:
        why = "not compiled on the CPU: peak='compile' does" if present.platform == "cpu" else "peak='estimate'"
    return mode, concrete, why


def find_peak(cfg, recipe, target, compiled, training: Training, *, batch, seq, shard, floor, working):
    """The peak as `target` (`peak_target`) says: None, the given step's, one compiled here, or the estimate from
    the `floor` (saved activations + model state) and one group's backward beyond it (`working`)."""
    mode, mesh, why = target
    if mode is None:
        return None
    if mode == "compiled":
        return peak_lib.from_compiled(compiled, mesh=mesh)
    if mode == "compile":
        step = peak_lib.compile_step(cfg, recipe, batch=batch, seq=seq, training=training, mesh=mesh)
        return peak_lib.from_compiled(step, mesh=mesh)
    return peak_lib.estimate(floor, cfg=cfg, batch=batch // training.grad_accum, seq=seq, shard=shard,
                             working=working, why=why, loss_chunk=training.loss_chunk)
