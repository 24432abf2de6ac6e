"""--profile DIR: a profiler trace of exactly one step, written where asked; a file in its place is refused before
anything is built."""
import glob
import io
import os

import jax
import jax.numpy as jnp
import pytest
from rich.console import Console

from recipes.train.settings.config import RunConfig
from recipes.train.settings.job import Cadence
from recipes.train.watching import watch


def test_the_trace_holds_the_one_step_asked_for(tmp_path):
    out = io.StringIO()
    trace = watch.StepTrace(str(tmp_path / "trace"), 2, Console(file=out))
    f = jax.jit(lambda x: jnp.sin(x) @ x.T)
    x = jnp.ones((64, 64))
    for step in (1, 2, 3):
        trace.begin(step)
        assert trace.on == (step == 2)
        jax.block_until_ready(f(x))
        trace.end(step)
        assert not trace.on
    assert len(glob.glob(str(tmp_path / "trace" / "plugins" / "profile" / "*" / "*.xplane.pb"))) == 1
    assert out.getvalue() == f"profile of step 2: {tmp_path / 'trace'}\n"
    trace.close()   # nothing running: nothing to stop


def test_the_run_carries_the_flag_and_refuses_a_file_in_its_place(tmp_path):
    assert Cadence.of(RunConfig(profile=str(tmp_path))).profile == str(tmp_path)
    assert Cadence.of(RunConfig()).profile is None
    taken = tmp_path / "trace"
    taken.write_text("")
    with pytest.raises(ValueError, match=f"--profile {taken} is a file: give a directory for the trace"):
        RunConfig(profile=str(taken))
    assert os.path.isfile(taken)   # left as it was
