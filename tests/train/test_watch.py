"""The live line while something long runs (`recipes.train.watching.watch.busy`), off a terminal: its "... still"
lines go where the console wrote when the work began, even if the work redirects stdout meanwhile, as
`zoo.plan.measure` does to read JAX's printed residuals (a line of ours there failed a 128K run's planning)."""
import contextlib
import io
import sys
import threading

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from rich.console import Console

from recipes.train.watching import watch
from zoo.plan import measure


class Signalling(io.StringIO):
    """A stream that says when a "... still" line has reached it."""

    def __init__(self):
        super().__init__()
        self.still = threading.Event()

    def write(self, text):
        n = super().write(text)
        if "... still" in text:
            self.still.set()
        return n


def test_the_heartbeat_keeps_to_the_consoles_stream_while_the_work_redirects_stdout(monkeypatch):
    terminal = Signalling()
    monkeypatch.setattr(sys, "stdout", terminal)
    console = Console()                       # no file of its own: it writes to sys.stdout, as the main job's does
    captured = io.StringIO()
    with watch.busy(console, "compiling", every_s=0.001):
        with contextlib.redirect_stdout(captured):
            assert terminal.still.wait(30), "no heartbeat line was written"
    assert captured.getvalue() == ""
    assert terminal.getvalue().startswith("compiling ...\n") and "... still compiling: " in terminal.getvalue()


def test_residuals_are_read_while_the_heartbeat_runs(monkeypatch):
    terminal = Signalling()
    monkeypatch.setattr(sys, "stdout", terminal)

    def f(w, x):
        h = checkpoint_name(jnp.sin(x @ w), "h")
        return jnp.sum(jnp.cos(h @ w))

    remat = jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names("h"))
    args = (jnp.ones((8, 8)), jnp.ones((4, 8)))
    with watch.busy(Console(), "planning", every_s=0.001):
        assert terminal.still.wait(30)
        saved = measure.saved_residuals(remat, *args)
    assert [(shape, dtype) for shape, dtype, _, source in saved if "named 'h'" in source] == [((4, 8), jnp.float32)]
