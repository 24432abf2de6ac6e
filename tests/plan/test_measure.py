"""zoo.plan.measure reads JAX's saved residuals through the public printer: the same list as JAX's own."""
import threading

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from zoo.plan import measure


def test_saved_residuals_match_jax_own_list():
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=["kept"], names_which_can_be_offloaded=["moved"], offload_src="device",
        offload_dst="pinned_host")

    def f(x):
        kept = checkpoint_name(jnp.sin(x), "kept")
        moved = checkpoint_name(jnp.sin(kept) * 2, "moved")
        return jnp.sum(jnp.sin(moved.astype(jnp.bfloat16)))

    fn = jax.checkpoint(f, policy=policy)
    got = measure.saved_residuals(fn, jnp.ones((2, 3, 4)))
    shapes = [(shape, jnp.dtype(dtype).name, host) for shape, dtype, host, _ in got]
    assert ((2, 3, 4), "float32", True) in shapes and ((2, 3, 4), "float32", False) in shapes
    tags = {r.tag: r.host for r in measure.residuals(fn, jnp.ones((2, 3, 4))) if r.tag}
    assert tags == {"kept": False}   # a host residual is the copy's output: JAX names it no more
    # the same list as JAX's private function, where this JAX version still has it
    from jax._src.ad_checkpoint import saved_residuals
    want = [(tuple(a.shape), jnp.dtype(a.dtype).name, src) for a, src in saved_residuals(fn, jnp.ones((2, 3, 4)))]
    assert [(s, jnp.dtype(d).name, src) for s, d, _, src in got] == want


def test_what_other_threads_print_meanwhile_is_not_read_as_a_residual(monkeypatch, capsys):
    """JAX prints the residuals; a line another thread prints at that moment (a progress line) goes to stdout as it
    would have, and the residuals read are the same."""
    fn = jax.checkpoint(lambda x: jnp.sum(jnp.sin(jnp.sin(x))), policy=jax.checkpoint_policies.everything_saveable)
    want = measure.saved_residuals(fn, jnp.ones((4,)))
    printer = jax.ad_checkpoint.print_saved_residuals

    def printing_beside(*a):
        printer(*a)
        other = threading.Thread(target=print, args=("... still compiling: 30 s",))
        other.start()
        other.join()

    monkeypatch.setattr(jax.ad_checkpoint, "print_saved_residuals", printing_beside)
    assert measure.saved_residuals(fn, jnp.ones((4,))) == want
    assert capsys.readouterr().out == "... still compiling: 30 s\n"
