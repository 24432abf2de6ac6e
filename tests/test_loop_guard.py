"""zoo.loop_guard: a loop inside a layer is refused only when it holds a tag or an offload (whose placement a recipe
could not control), however deep, in both directions; through the tag reader (zoo.emitted) and on its own."""
import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

from zoo import loop_guard, tags
from zoo.emitted import emitted

X = jnp.ones((4, 3))


def _with_inner_scan(body):
    def f(x):
        y = tags.name(x * 2.0, "mlpwi_0")
        c, _ = jax.lax.scan(body, jnp.zeros(3), y)
        return c
    return f


def _loops(fn, *args):
    """The loop equations at the top level of fn's jaxpr."""
    return [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if loop_guard.is_loop(e)]


def test_a_loop_without_tags_or_offloads_is_allowed():
    got = emitted(_with_inner_scan(lambda c, a: (c + jnp.sin(a), None)), X)
    assert list(got) == ["mlpwi_0"] and got["mlpwi_0"].shape == (4, 3)


def test_a_loop_holding_a_tag_is_refused():
    with pytest.raises(ValueError, match="scan whose body holds the tag 'mlpwi_1'"):
        emitted(_with_inner_scan(lambda c, a: (c + checkpoint_name(a, "mlpwi_1"), None)), X)


def test_a_loop_holding_a_tag_deeper_down_is_refused():
    def body(c, a):
        inner = jax.jit(lambda v: jax.lax.fori_loop(0, 2, lambda i, w: w + checkpoint_name(w, "mlpwo"), v))
        return c + inner(a), None
    with pytest.raises(ValueError, match="holds the tag 'mlpwo'"):
        emitted(_with_inner_scan(body), X)


def test_a_loop_holding_an_offload_is_refused():
    def body(c, a):
        back = jax.device_put(jax.device_put(a, jax.memory.Space.Host), jax.memory.Space.Device)
        return c + back, None
    with pytest.raises(ValueError, match="offload to host memory"):
        emitted(_with_inner_scan(body), X)


def test_scan_and_while_are_the_loops_and_nothing_else_is():
    scan = _loops(lambda x: jax.lax.scan(lambda c, a: (c + a, None), jnp.zeros(3), x)[0], X)
    while_ = _loops(lambda x: jax.lax.while_loop(lambda v: v.sum() < 100.0, lambda v: v * 2.0, x), X)
    assert [e.primitive.name for e in scan + while_] == ["scan", "while"]
    assert _loops(lambda x: jax.jit(jnp.sin)(x) + jax.lax.cond(True, jnp.cos, jnp.sin, x), X) == []


def test_check_loop_on_its_own_says_what_the_body_holds():
    (clean,) = _loops(lambda x: jax.lax.fori_loop(0, 2, lambda i, v: v * 2.0, x), X)
    (tagged,) = _loops(lambda x: jax.lax.fori_loop(0, 2, lambda i, v: checkpoint_name(v, "mlpwo") * 2.0, x), X)
    assert loop_guard.unsafe_content(clean.params) is None and loop_guard.check_loop(clean) is None
    assert loop_guard.unsafe_content(tagged.params) == "the tag 'mlpwo'"
    with pytest.raises(ValueError, match="a tagged layer contains a (scan|while) whose body holds the tag 'mlpwo'"):
        loop_guard.check_loop(tagged)


def test_a_copy_between_device_memories_is_no_offload():
    def body(c, a):
        return c + jax.device_put(a, jax.memory.Space.Device), None
    (loop,) = _loops(lambda x: jax.lax.scan(body, jnp.zeros(3), x)[0], X)
    assert loop_guard.unsafe_content(loop.params) is None
