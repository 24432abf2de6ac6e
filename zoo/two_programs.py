"""A training step run as two programs, one after the other: the first makes the gradients, the second updates the
state from them (`zoo.train_step.jit_step(..., two_programs=True)`).

The step over parameters that live in pinned host memory (`--params stream`) runs this way: compiled as one
program, XLA's GPU compiler crashes on it (jax 0.11.2, in its `HostOffloadLegalize` pass), while each half compiles
and runs (docs/long-context.md, "Parameters streamed from the host"). Nothing is copied for the split: the streamed
parameters' gradients are made in pinned host memory by the first program and read there by the second; the
others pass in HBM, as they would inside one program.

`TwoPrograms` behaves as the jitted step does where the zoo uses one: it is called on (state, batch), and
`lower(...).compile(...)` gives a compiled step that is called the same way and reports the larger of its two
programs' memory analyses.
"""
from __future__ import annotations

from typing import Any

import jax

__all__ = ["CompiledTwo", "LoweredTwo", "TwoPrograms", "peak_bytes"]


def peak_bytes(analysis) -> int:
    """A compiled program's HBM peak from XLA's memory analysis: arguments + outputs - aliased (donated) + temporaries,
    a field the backend leaves out counted as 0 (what the planner reads, `zoo.plan.peak.from_compiled`).

    Args:
        analysis: `compiled.memory_analysis()`.

    Returns:
        the peak in bytes.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from zoo.two_programs import peak_bytes
        >>> peak_bytes(jax.jit(jnp.sin).lower(jnp.ones(1024)).compile().memory_analysis()) >= 2 * 4096
        True
    """
    def field(name: str) -> int:
        return int(getattr(analysis, f"{name}_size_in_bytes", 0) or 0)
    return field("argument") + field("output") - field("alias") + field("temp")


class _InTurn:
    """Two programs called in turn on the step's (state, batch): `second(state, first(state, batch))`."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __call__(self, state, batch):
        return self.second(state, self.first(state, batch))


class CompiledTwo(_InTurn):
    """The two programs compiled: called as the step, `memory_analysis()` is that of the program with the larger
    peak (they never run at once; the second's arguments include what the first returns)."""

    def memory_analysis(self):
        analyses = [p.memory_analysis() for p in (self.first, self.second)]
        if any(a is None for a in analyses):
            return None
        return max(analyses, key=peak_bytes)


class LoweredTwo:
    """The first program lowered on (state, batch); the second is lowered when the first is compiled, on the
    shapes and shardings (memory kinds included) the first returns."""

    def __init__(self, two: TwoPrograms, state, batch):
        self.two, self.state = two, state
        self.first = two.first.lower(state, batch)

    def compile(self, compiler_options: dict[str, Any] | None = None) -> CompiledTwo:
        first = self.first.compile(compiler_options=compiler_options)
        infos = jax.tree.leaves(first.out_info)
        shardings = jax.tree.leaves(first.output_shardings)
        carry = jax.tree.unflatten(first.out_tree, [jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=s)
                                                     for o, s in zip(infos, shardings)])
        second = self.two.second.lower(self.state, carry).compile(compiler_options=compiler_options)
        return CompiledTwo(first, second)


class TwoPrograms(_InTurn):
    """A step as two jitted programs: `first(state, batch) -> carry` (the gradients and what the update reads),
    then `second(state, carry) -> (new state, metrics)`.

    Args:
        first: the jitted first program; it reads the state and does not donate it.
        second: the jitted second program; it may donate the state.
    """

    def lower(self, state, batch) -> LoweredTwo:
        return LoweredTwo(self, state, batch)
