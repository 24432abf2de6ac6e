"""The streamed update of optimizer state in pinned host memory (`zoo.streamed_update`): the numbers of the update
with the state in HBM (to an ulp or two at each array's scale: the same arithmetic in another program, which XLA
may fuse differently; tests/rounding.py) through normal and non-finite steps; a streamed loop per group of
parameters in the program, with HBM receiving chunks of the host state, never a whole stacked leaf; the chunking
rule at the 8B sizes (the refusals and the rule's unit cases: tests/test_streamed_update.py). Tiny Llama and
DeepSeek-V3, a few steps on the CPU."""
from __future__ import annotations

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from recipes.registry import default_recipe
from recipes.train.inputs import data as data_lib
from recipes.train.processes import mesh as mesh_lib
from recipes.train.settings.cli import family as model_family
from recipes.train.settings.cli import recipe as model_recipe
from recipes.train.step import prepare
from tests.helpers import hlo_type
from tests.rounding import assert_same_metrics, assert_same_state
from zoo import sharding
from zoo import streamed_update as su
from zoo.opt_state import HOST, is_master
from zoo.optim import lr_schedule, make_optimizer
from zoo.plan import Training
from zoo.train_step import abstract_batch, abstract_step, family_step, jit_step

SEQ = 8
BATCH = 4
SCHEDULE = lr_schedule(lr=3e-3, steps=12, warmup=0)   # the first step moves the parameters


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    opt_state: str = "host"
    params: str = "device"
    opt_dtype: str | None = None
    grad_accum: int = 1
    chunk_bytes: int | None = None   # zoo.streamed_update.CHUNK_BYTES: 16 KiB cuts the tiny embedding and head too
    optimizer: str = "adamw"

    def __str__(self) -> str:
        parts = [self.model, self.optimizer, f"opt_state_{self.opt_state}", f"params_{self.params}",
                 f"accum{self.grad_accum}"]
        return "-".join(parts + [f"{self.opt_dtype}_moments"] * bool(self.opt_dtype) +
                        [f"chunks_{self.chunk_bytes}B"] * bool(self.chunk_bytes))


CASES = [Case("llama3", chunk_bytes=2 ** 14), Case("llama3", opt_dtype="bfloat16", grad_accum=2),
         Case("llama3", params="host", grad_accum=2), Case("llama3", params="host", optimizer="sgd"),
         Case("deepseek_v3", opt_dtype="bfloat16"), Case("deepseek_v3", params="host", grad_accum=2)]


def _run(case: Case, opt_state: str, params: str):
    """(initial state, metrics of steps 1 and 2, state after them, metrics of a NaN-weighted step 3, state after
    it, the memory kinds of the optimizer's floating-point arrays after it): arrays as numpy."""
    fam = model_family(case.model)
    cfg = fam.config("tiny")
    if case.params == "host":
        cfg = dataclasses.replace(cfg, param_dtype="bfloat16")
    mesh = mesh_lib.resolve(None, cfg, BATCH)
    model, opt = prepare.build_sharded(fam, cfg, model_recipe(fam, default_recipe(fam)), mesh, seed=0,
                                    opt_state=opt_state, params=params, make_opt=lambda m: make_optimizer(
                                        m, SCHEDULE, clip=1.0, weight_decay=0.1, opt_dtype=case.opt_dtype,
                                        optimizer=case.optimizer, master=case.params == "host"))
    step, _, state = jit_step(model, opt, family_step(fam, SCHEDULE, case.grad_accum), keep_shardings=True)
    data = data_lib.Synthetic(vocab=cfg.vocab_size, batch=BATCH, seq=SEQ)
    numpy = lambda s: [np.asarray(x) for x in jax.tree.leaves(s)]   # noqa: E731
    initial, metrics = numpy(state), []
    for i in (1, 2):
        state, m = step(state, mesh_lib.put_batch(data.batch(i), mesh))
        metrics.append(jax.device_get(m))
    after = numpy(state)
    poisoned = dict(data.batch(3), weights=np.full((BATCH, SEQ), np.nan, np.float32))
    state, bad = step(state, mesh_lib.put_batch(poisoned, mesh))
    kinds = {x.sharding.memory_kind for p, x in jax.tree_util.tree_flatten_with_path(state)[0]
             if p[0].key == 1 and (is_master(p) or (x.ndim and jnp.issubdtype(x.dtype, jnp.floating)))}
    return initial, metrics, after, jax.device_get(bad), numpy(state), kinds


# the default set: the moments chunked below a layer, a master with micro-batches
# All in the full set: the library's own test (tests/test_streamed_update.py) checks the streamed update against the
# update in HBM in the default run; these run it through the main job's loop, a further case of that concern.
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_streamed_update_is_the_update_in_hbm(case, monkeypatch):
    """With the moments (and the float32 master, under params="host") in pinned host memory, two steps give the
    parameters, moments, master, step counts and metrics (loss, gradient norm, learning rate, ...) of the same
    optimizer with its state in HBM: step counts and flags exactly, every float array within a few ulp at its
    scale, metrics within float32 rounding (`tests.rounding`). A third step on a NaN-weighted batch is not
    ok and leaves every state as it was, bit for bit, the host state included, which stays in pinned host memory.
    With a small chunk size the unstacked embedding and head are streamed in 4 chunks each (a second loop); SGD on
    a master streams the master alone (no moments; the step counts come from the empty update)."""
    if case.chunk_bytes:
        monkeypatch.setattr(su, "CHUNK_BYTES", case.chunk_bytes)
    initial, ref_metrics, ref_after, ref_bad, ref_final, ref_kinds = _run(case, "device", "device")
    _, metrics, after, bad, final, kinds = _run(case, case.opt_state, case.params)
    assert ref_kinds == {"device"} and kinds == {HOST}
    for m, ref in zip(metrics, ref_metrics):
        assert_same_metrics(ref, m)
    assert all(m["ok"] and m["kept"] for m in metrics)
    assert_same_state(ref_after, after)
    assert any(not np.array_equal(a, b) for a, b in zip(initial, after))   # the steps moved the state
    assert_same_metrics(ref_bad, bad)
    assert not bad["ok"] and not np.isfinite(bad["loss"])
    assert all(np.array_equal(a, b) for a, b in zip(after, final))         # the refused step: exactly as it was
    assert all(np.array_equal(a, b) for a, b in zip(ref_after, ref_final))


def _placements(text: str) -> collections.Counter:
    """Counter of (memory kind, tensor type) of the placement annotations in lowered text."""
    out = collections.Counter()
    for line in text.splitlines():
        if "annotate_device_placement" in line:
            kind = re.search(r'_xla_buffer_placement = "(\w+)"', line).group(1)
            out[kind, line.rsplit("->", 1)[-1].strip()] += 1
    return out


def test_the_lowered_step_streams_host_state_a_layer_at_a_time():
    """Tiny Llama (2 layers) with bf16 parameters, --params host --opt-state host, lowered for the CPU and for
    CUDA (no GPU needed): one while loop more than the step with its state in HBM (the stack's parameters, streamed
    together; the unstacked ones are small and updated whole). In the CUDA lowering (the CPU's drops memory
    placements inside the program), each stacked parameter's master and two moments come into HBM and go back to
    the host as one-layer chunks [1, ...], and no float32 stacked array (all host state) is ever placed in device
    memory whole."""
    fam = model_family("llama3")
    cfg = dataclasses.replace(fam.config("tiny"), param_dtype="bfloat16")
    texts = {}
    for where in ("device", "host"):
        jitted, _, state = abstract_step(fam, cfg, model_recipe(fam, "full"),
                                          training=Training(params=where, opt_state=where))
        traced = jitted.trace(state, abstract_batch(2, SEQ))
        texts[where] = {p: traced.lower(lowering_platforms=(p,)).as_text() for p in ("cpu", "cuda")}
    for platform in ("cpu", "cuda"):
        whiles = {where: texts[where][platform].count("stablehlo.while") for where in texts}
        assert whiles["host"] == whiles["device"] + 1, platform
    assert not any(shape.startswith("tensor<1x") for _, shape in _placements(texts["device"]["cuda"]))
    placed = _placements(texts["host"]["cuda"])
    stacked = collections.Counter(x.shape for x in jax.tree.leaves(state[0]) if x.ndim > 1 and
                                  x.shape[0] == cfg.num_layers)
    assert stacked
    for shape, count in stacked.items():
        chunk = hlo_type((1, *shape[1:]), jnp.float32)
        assert placed["device", chunk] == placed["pinned_host", chunk] == 3 * count, shape
        assert placed["device", hlo_type(shape, jnp.float32)] == 0, shape


def test_chunks_are_a_layer_or_at_most_256_mib_along_an_unsplit_axis():
    """A stacked parameter: one layer per chunk whatever its size; the 8B embedding [128256, 4096] at 4 bytes: the
    fewest equal chunks of at most 256 MiB (8 of 16032 rows); with its vocab axis split over tp, along its embed
    axis; a small or 1-d parameter: whole."""
    def param(shape, names):
        return nnx.eval_shape(lambda: nnx.Param(jnp.zeros(shape, jnp.bfloat16), out_sharding=names,
                                                eager_sharding=False))
    assert su.chunking(param((32, 4096, 14336), ("layers", "embed", "mlp")), 4) == (0, 32)
    assert su.chunking(param((2, 4), ("layers", "embed")), 4) == (0, 2)
    assert su.chunking(param((128256, 4096), ("vocab", "embed")), 4) == (0, 8)
    assert su.chunking(param((4096,), ("embed",)), 4) == (0, 1)
    assert su.chunking(param((256, 64), ("vocab", "embed")), 4) == (0, 1)
    with sharding.use(sharding.abstract_mesh("tp=2", 2)):
        axis, n = su.chunking(param((128256, 4096), ("vocab", "embed")), 4)
    assert axis == 1 and 4096 % n == 0 and 128256 * 4096 * 4 / n <= su.CHUNK_BYTES
