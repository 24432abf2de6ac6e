"""A plain-JAX baseline's JSON line (`bench.baselines` print their own keys) as a record of `bench.records`;
`bench.run` applies it to every baseline job.

The anchor's `policy` becomes `recipe`; its MoE dispatch is sort + jax.lax.ragged_dot (`backend` "ragged_dot").
Its planned figures are None: the planner plans zoo models only.
"""
from __future__ import annotations


def to_record(got: dict, *, bench: str, S: int, backend: str = "ragged_dot", mesh: str | None = None,
              smoke: bool = False) -> dict:
    got = dict(got)
    record = dict(bench=bench, impl="anchor", recipe=got.pop("policy", None),
                  backend=None if backend == "none" else backend,
                  B=got.pop("B", None), S=64 if smoke else S, L=got.pop("L", None),
                  planned_peak_gib=None, planned_host_gib=None, dropped=0, mesh=mesh)
    got.pop("flags", None)  # the runner writes the flags the anchor ran with
    if "tflops_per_device" in got:   # plain_jax_llama_fsdp.py: per device, batch per device
        got["tflops"] = got.pop("tflops_per_device")
        record["B"] = got.get("batch_per_device", 0) * got.get("gpus", 1)
    return {**record, **got}
