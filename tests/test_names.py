"""`zoo.names`, the one rule of every "did you mean": a close name is suggested (a swap of letters too), a far one
is not, and leading dashes do not make two flags alike."""
import pytest

from zoo.names import closest, did_you_mean


@pytest.mark.parametrize("name, choices, want", [
    ("tyni", ("llama3_1_8b", "llama3_1_70b", "llama3_1_405b", "tiny"), ["tiny"]),
    ("llama4", ("deepseek_v3", "llama3", "qwen3", "qwen3_moe"), ["llama3"]),
    ("gpt2", ("deepseek_v3", "llama3", "qwen3", "qwen3_moe"), []),
    ("fdsp", ("dp", "fsdp", "tp", "ep"), ["fsdp"]),
    ("--sequ", ("--seq", "--steps", "--preset"), ["--seq"]),
    ("--resume", ("--preset", "--recipe", "--mesh"), []),   # "--" alike, the rest not
])
def test_a_close_name_is_suggested_and_a_far_one_is_not(name, choices, want):
    assert closest(name, choices) == want
    assert did_you_mean(name, choices) == (f" (did you mean {want[0]}?)" if want else "")


def test_several_suggestions_nearest_first_and_quoted_on_request():
    assert closest("num_layer", ("dim", "num_layers", "num_heads"), n=3) == ["num_layers"]
    assert did_you_mean("qwen3moe", ("llama3", "qwen3", "qwen3_moe"), n=2, quote=True) == \
        " (did you mean 'qwen3_moe' or 'qwen3'?)"
