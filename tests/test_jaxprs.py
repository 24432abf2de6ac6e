"""zoo.jaxprs.sub_jaxprs: the jaxprs one level inside an equation, each an open Jaxpr (jit's, scan's and cond's
closed ones opened, a custom VJP's primal as it is), and none from an equation that holds none."""
import jax
import jax.extend.core
import jax.numpy as jnp

from zoo.jaxprs import sub_jaxprs

X = jnp.ones((4, 3))


@jax.custom_vjp
def _custom_sin(x):
    return jnp.sin(x)


_custom_sin.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))


def _subs(fn):
    """{primitive: number of jaxprs inside} for each top-level equation of fn's jaxpr."""
    out = {}
    for eqn in jax.make_jaxpr(fn)(X).jaxpr.eqns:
        subs = list(sub_jaxprs(eqn.params))
        assert all(isinstance(s, jax.extend.core.Jaxpr) for s in subs)
        out[eqn.primitive.name] = len(subs)
    return out


def test_each_kind_of_equation_gives_its_jaxprs_open():
    assert _subs(lambda x: jax.jit(jnp.sin)(x))["jit"] == 1
    assert _subs(lambda x: jax.lax.scan(lambda c, a: (c + a, None), jnp.zeros(3), x)[0])["scan"] == 1
    assert _subs(lambda x: jax.lax.cond(True, jnp.sin, jnp.cos, x))["cond"] == 2   # the branches: a tuple
    assert _subs(_custom_sin)["custom_vjp_call"] == 1   # its primal, an open Jaxpr
    assert _subs(lambda x: jnp.sin(x) * 2.0) == {"sin": 0, "mul": 0}


def test_one_level_down_only():
    (inner,) = sub_jaxprs(jax.make_jaxpr(lambda x: jax.jit(lambda v: jax.jit(jnp.sin)(v))(x))(X).jaxpr.eqns[0].params)
    assert [e.primitive.name for e in inner.eqns] == ["jit"]   # the inner jit, not entered
