"""Checkpoints of a training run with orbax: the model's and the optimizer's NNX state, and a small JSON record.

The record holds the step and what the run was (model, preset, recipe, batch, seq, seed, data) so that
`--resume` refuses a checkpoint of a different run instead of silently continuing it. The data is a pure
function of (seed, step) (`recipes.data`), the optimizer state holds its step count and the learning-rate
schedule reads it: restoring these two states and the step reproduces the uninterrupted run exactly.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx


class Checkpoints:
    """Save and restore `(model, optimizer)` under `directory` (one sub-folder per step)."""

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3):
        self.directory = os.path.abspath(os.fspath(directory))
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer, record: dict[str, Any]) -> None:
        state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        record=ocp.args.JsonSave({**record, "step": step})))

    def record(self, step: int | None = None) -> dict[str, Any]:
        step = self.latest_step() if step is None else step
        return self.manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))["record"]

    def restore(self, model: nnx.Module, optimizer: nnx.Optimizer, step: int | None = None) -> dict[str, Any]:
        """Load the checkpoint of `step` (default: the latest) into `model` and `optimizer`; return its record."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise ValueError(f"no checkpoint in {self.directory}")
        state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 record=ocp.args.JsonRestore()))
        nnx.update(model, out["state"]["model"])
        nnx.update(optimizer, out["state"]["optimizer"])
        return out["record"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
