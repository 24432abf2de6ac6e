"""The XLA options a training step is compiled with: a step that offloads gets its copies off the compute stream
(`HIDE_COPIES`: command buffers, which put every host copy on the compute stream, off for that executable only); every
other program keeps XLA's defaults, and a user's `XLA_FLAGS` wins (`reason` says so). The measurement:
docs/offload-profile.md.
"""
from __future__ import annotations

import dataclasses
import os

from zoo.recipe import Recipe

# The dense MLP's gate and up projections: the tensors a layer makes last, whose copies the layer's end waits for.
CHUNKED_MLP_TAGS = ("mlpwi_0", "mlpwi_1")
CHUNKS_SOURCE = ("on an H200 the 405B-shaped slice's minimal_offload ran 2.3% (3 layers) and 7.5% (6 layers) faster "
                 "with 2 chunks; 4 and 8 raised the peak (docs/offload-profile.md)")

# The narrowest setting measured to give the copies their own streams, and where it was measured.
HIDE_COPIES: dict[str, str] = {"xla_gpu_enable_command_buffer": ""}
HIDE_COPIES_SOURCE = ("command buffers off for this executable: on an H200 (jax 0.11.2) the 405B-shaped slice's "
                      "offloaded step ran at 0.79x of saving with them on, 0.91x with them off "
                      "(docs/offload-profile.md)")
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """XLA options for one compiled step (`jitted.lower(...).compile(compiler_options=options)`) and why."""
    options: dict[str, str]
    reason: str

    def describe(self) -> str:
        shown = " ".join(f"--{k}={v}" for k, v in self.options.items()) or "XLA's defaults"
        return f"{shown} ({self.reason})"


def offloads(recipe: Recipe | None) -> bool:
    """True iff `recipe` sends any tag to pinned host memory (a group's first layer's included)."""
    return recipe is not None and bool(recipe.offload or recipe.lead_offload)


def _user_set(option: str, xla_flags: str) -> bool:
    return any(f.lstrip("-").split("=", 1)[0] == option for f in xla_flags.split())


def for_step(recipe: Recipe | None, platform: str, xla_flags: str | None = None) -> StepOptions:
    """The options for a training step under `recipe` compiled for `platform` ("gpu", "cpu", ...).

    `xla_flags` defaults to the environment's `XLA_FLAGS`: an option the user set there is never overridden."""
    if not offloads(recipe):
        return StepOptions({}, "the recipe offloads nothing")
    if platform.lower() not in GPU_PLATFORMS:
        return StepOptions({}, f"no copy streams to free on {platform}")
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    kept = {k: v for k, v in HIDE_COPIES.items() if not _user_set(k, flags)}
    if not kept:
        return StepOptions({}, "XLA_FLAGS sets " + ", ".join(HIDE_COPIES) + ": yours win")
    return StepOptions(kept, HIDE_COPIES_SOURCE)



def chunking_hint(recipe: Recipe | None, mlp_seq_chunks: int, platform: str) -> str | None:
    """A line for a GPU step whose recipe offloads the dense MLP's gate or up projection in one piece: each copy
    can start only once its whole tensor exists, and 2 sequence chunks (`mlp_seq_chunks=2`) start half of it one
    chunk earlier. None where it would not help (nothing of the MLP offloaded, already chunked, not a GPU)."""
    if (not offloads(recipe) or platform.lower() not in GPU_PLATFORMS or mlp_seq_chunks != 1
            or not set(CHUNKED_MLP_TAGS) & set(recipe.resolve().offload)):
        return None
    return f"hint: --set mlp_seq_chunks=2 hides more of the MLP's copies ({CHUNKS_SOURCE})"
