"""`zoo.two_programs` and `zoo.train_step.jit_step(two_programs=True)`: a training step run as two programs (the
gradients, then the update; how `--params stream` runs) on the two-layer Llama of tests/tiny_lm.py. Its new state and
metrics are those of the step as one program; lowered and compiled it is called the same way and reports the larger
of its programs' memory analyses; a step function without its two halves is refused by name."""
from __future__ import annotations

import jax
import pytest

from tests import tiny_lm
from tests.helpers import max_rel_err
from zoo.models.registry import family
from zoo.optim import lr_schedule, make_optimizer
from zoo.train_step import family_step, jit_step
from zoo.two_programs import CompiledTwo, TwoPrograms

SCHEDULE = lr_schedule(lr=1e-2, steps=10, warmup=1)


def _steps():
    """(one program, two programs, state, batch) of an AdamW step of the two-layer Llama."""
    model = tiny_lm.build()
    opt = make_optimizer(model, SCHEDULE, clip=1.0, weight_decay=0.1)
    fn = family_step(family("llama3"), SCHEDULE)
    one, _, state = jit_step(model, opt, fn)
    two, _, _ = jit_step(model, opt, fn, two_programs=True)
    return one, two, state, tiny_lm.batch()


def test_two_programs_make_the_step_of_one():
    one, two, state, batch = _steps()
    assert isinstance(two, TwoPrograms)
    copy = jax.tree.map(lambda x: x.copy(), state)
    want_state, want = one(state, batch)
    got_state, got = two(copy, batch)
    assert set(got) == set(want) and float(got["loss"]) == float(want["loss"]) and bool(got["ok"])
    assert max_rel_err(got_state, want_state) <= 1e-6
    assert max_rel_err(got, want) <= 1e-6


def test_compiled_two_programs_run_as_the_step_and_report_the_larger_peak():
    _, two, state, batch = _steps()
    compiled = two.lower(state, batch).compile()
    assert isinstance(compiled, CompiledTwo)
    def peak(a):
        return a.argument_size_in_bytes + a.output_size_in_bytes - a.alias_size_in_bytes + a.temp_size_in_bytes
    peaks = [peak(p.memory_analysis()) for p in (compiled.first, compiled.second)]
    assert peak(compiled.memory_analysis()) == max(peaks)
    copy = jax.tree.map(lambda x: x.copy(), state)
    assert float(compiled(state, batch)[1]["loss"]) == float(two(copy, batch)[1]["loss"])


def test_two_programs_need_the_steps_two_halves():
    model = tiny_lm.build()
    opt = make_optimizer(model, SCHEDULE, clip=1.0, weight_decay=0.0)
    with pytest.raises(ValueError, match="two_programs=True.*step_fn must be a zoo.train_step.FamilyStep"):
        jit_step(model, opt, lambda m, o, b: {}, two_programs=True)
