"""Fixtures of the layers' unit tests."""
import pytest


@pytest.fixture
def hf():
    """`tests.layers.hf_layers` (transformers' layers with a zoo layer's weights); the test is skipped where torch or
    transformers is absent (they are in CI's Python 3.11 environment only)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.layers import hf_layers
    return hf_layers
