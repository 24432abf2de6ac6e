"""What "the same numbers" means between two programs of the same arithmetic: the update with its state in HBM and
the one streamed from pinned host memory (`zoo.streamed_update`), or the same state in another memory space.

The streamed update runs the same elementwise expressions as the update in HBM, but in another program (a loop over
slices of each parameter), which XLA fuses and simplifies on its own terms: a division by a scalar may become a
multiplication by its reciprocal, a multiply and an add one fused operation. Each element may then round
differently in its last bit, and which elements do depends on the XLA build (jax 0.11.2's CPU build gave identical
arrays; jax 0.12's gives parameters an ulp apart). So the promise across jax versions, and what these helpers
check:

- every floating-point array of the state within `ULPS` ulp at that array's scale (its largest magnitude) of the
  reference's, and every other array (step counts, integers, booleans) equal;
- every metric within `RTOL` of the reference's (the next step's loss and norms are of parameters an ulp apart),
  flags (`ok`, `kept`) and non-finite values (NaN equal to NaN) exactly.

What one program computes twice (a resumed run against the same run uninterrupted, a non-finite step that must keep
the state as it was, the parameters as the master rounded) is still compared bit for bit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ULPS = 4       # one rounding of an update, at the array's scale, with room for a second
RTOL = 1e-5    # float32 metrics of states a few ulp apart


def _floating(x) -> bool:
    return jnp.issubdtype(np.asarray(x).dtype, jnp.floating)


def assert_same_state(ref, got) -> None:
    """`got`'s arrays (a list or tree, as `ref`'s) are `ref`'s to `ULPS` ulp at each array's scale, non-float
    arrays exactly."""
    refs, gots = jax.tree.leaves(ref), jax.tree.leaves(got)
    assert len(refs) == len(gots)
    for i, (a, b) in enumerate(zip(refs, gots)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, (i, a.dtype, b.dtype, a.shape, b.shape)
        if not _floating(a):
            np.testing.assert_array_equal(b, a, err_msg=f"leaf {i}")
            continue
        wide_a, wide_b = a.astype(np.float64), b.astype(np.float64)
        assert np.array_equal(np.isfinite(wide_a), np.isfinite(wide_b)), f"leaf {i}: non-finite elements differ"
        finite = np.isfinite(wide_a)
        scale = np.abs(wide_a[finite]).max(initial=0.0)
        atol = ULPS * float(jnp.finfo(a.dtype).eps) * scale
        np.testing.assert_allclose(wide_b[finite], wide_a[finite], rtol=0, atol=atol,
                                   err_msg=f"leaf {i} ({a.dtype}{list(a.shape)}): more than {ULPS} ulp of {scale:g}")


def assert_same_metrics(ref: dict, got: dict) -> None:
    """`got`'s metrics are `ref`'s: the same keys, floats within `RTOL` (NaN equal to NaN), the rest exactly."""
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    for key in ref:
        a, b = np.asarray(ref[key]), np.asarray(got[key])
        if _floating(a):
            np.testing.assert_allclose(b.astype(np.float64), a.astype(np.float64), rtol=RTOL, equal_nan=True,
                                       err_msg=key)
        else:
            np.testing.assert_array_equal(b, a, err_msg=key)
