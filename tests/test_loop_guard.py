"""zoo.tags' nested-loop guard: a loop inside a layer is refused only when it holds a tag or an offload (whose
placement a recipe could not control), in both directions."""
import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

from zoo import tags

X = jnp.ones((4, 3))


def _with_inner_scan(body):
    def f(x):
        y = tags.name(x * 2.0, "mlpwi_0")
        c, _ = jax.lax.scan(body, jnp.zeros(3), y)
        return c
    return f


def test_a_loop_without_tags_or_offloads_is_allowed():
    got = tags.emitted(_with_inner_scan(lambda c, a: (c + jnp.sin(a), None)), X)
    assert list(got) == ["mlpwi_0"] and got["mlpwi_0"].shape == (4, 3)


def test_a_loop_holding_a_tag_is_refused():
    with pytest.raises(ValueError, match="scan whose body holds the tag 'mlpwi_1'"):
        tags.emitted(_with_inner_scan(lambda c, a: (c + checkpoint_name(a, "mlpwi_1"), None)), X)


def test_a_loop_holding_a_tag_deeper_down_is_refused():
    def body(c, a):
        inner = jax.jit(lambda v: jax.lax.fori_loop(0, 2, lambda i, w: w + checkpoint_name(w, "mlpwo"), v))
        return c + inner(a), None
    with pytest.raises(ValueError, match="holds the tag 'mlpwo'"):
        tags.emitted(_with_inner_scan(body), X)


def test_a_loop_holding_an_offload_is_refused():
    def body(c, a):
        back = jax.device_put(jax.device_put(a, jax.memory.Space.Host), jax.memory.Space.Device)
        return c + back, None
    with pytest.raises(ValueError, match="offload to host memory"):
        tags.emitted(_with_inner_scan(body), X)
