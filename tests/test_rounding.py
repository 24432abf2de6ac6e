"""The comparison of two programs of the same arithmetic (tests/rounding.py) accepts what rounding
explains and nothing more: an ulp at an array's scale passes; a difference a wrong update would make (a weight
decay step left out, 3e-4 of the value) fails, as do changed step counts, flags and NaNs."""
import numpy as np
import pytest

from tests.rounding import ULPS, assert_same_metrics, assert_same_state


def test_an_ulp_passes_and_an_update_error_does_not():
    rng = np.random.default_rng(0)
    ref = [rng.standard_normal((4, 8)).astype(np.float32), np.array(3, np.int32)]
    one_ulp = [np.nextafter(ref[0], np.float32(np.inf)), ref[1]]
    assert_same_state(ref, one_ulp)
    near_zero = ref[0].copy()
    near_zero[0, 0] = 1e-9   # an element that cancelled to ~0: judged at the array's scale, not its own
    assert_same_state([near_zero, ref[1]], [near_zero + np.float32(1e-7), ref[1]])
    with pytest.raises(AssertionError, match=f"more than {ULPS} ulp"):
        assert_same_state(ref, [ref[0] * np.float32(1 - 3e-4), ref[1]])
    with pytest.raises(AssertionError):
        assert_same_state(ref, [ref[0], np.array(4, np.int32)])
    with pytest.raises(AssertionError, match="non-finite"):
        assert_same_state(ref, [np.where(ref[0] > 1, np.nan, ref[0]), ref[1]])


def test_metrics_within_float32_rounding_flags_exactly():
    ref = {"loss": np.float32(2.5), "ok": np.bool_(True), "bad": np.float32(np.nan)}
    assert_same_metrics(ref, {"loss": np.float32(2.5000002), "ok": np.bool_(True), "bad": np.float32(np.nan)})
    with pytest.raises(AssertionError):
        assert_same_metrics(ref, {**ref, "loss": np.float32(2.51)})
    with pytest.raises(AssertionError):
        assert_same_metrics(ref, {**ref, "ok": np.bool_(False)})
