"""The compiled step's host bytes as the main job reports them: XLA's host temporaries, except where the state lives
in pinned host memory, where XLA reports none and the plan's figure stands in (said as such)."""
import types

from recipes.train.watching import meter


def compiled_with(host_temps):
    analysis = types.SimpleNamespace(host_temp_size_in_bytes=host_temps)
    return types.SimpleNamespace(memory_analysis=lambda: analysis)


def test_host_temporaries_are_xlas_figure_unless_the_state_is_on_the_host():
    assert meter.host_bytes(compiled_with(3 << 30)) == 3 << 30
    assert meter.host_bytes(compiled_with(0)) == 0                         # a recipe that offloads nothing
    assert meter.host_bytes(compiled_with(0), state_on_host=True) is None  # not a measurement: XLA says nothing
    assert meter.host_bytes(compiled_with(3 << 30), state_on_host=True) == 3 << 30


def test_the_note_says_when_the_figure_is_the_plans():
    plan = types.SimpleNamespace(host_bytes=3 << 30)
    assert meter.host_note(1 << 30, plan, "gpu") == "; host memory for offloaded values: 1.0 GiB"
    note = meter.host_note(None, plan, "gpu")
    assert "not reported by XLA" in note and "planned 3.0 GiB" in note
    assert meter.host_note(None, plan, "cpu") == ""
    assert meter.host_note(None, types.SimpleNamespace(host_bytes=0), "gpu") == ""
