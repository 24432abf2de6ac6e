"""The XLA options a training step compiles with: a step that offloads gets its copies off the compute stream (command
buffers off for that executable only), a step that offloads nothing keeps XLA's defaults, the user's XLA_FLAGS win,
and the options reach XLA through the one compile of the step (zoo.train_step.compile_abstract)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import zoo
from recipes.llama3 import RECIPES
from zoo import compile_options
from zoo.models.registry import family
from zoo.train_step import compile_abstract

OFFLOADS, SAVES = RECIPES["qkv_offload"], RECIPES["save_qkv"]


def test_an_offloading_step_on_a_gpu_turns_command_buffers_off():
    opts = compile_options.for_step(OFFLOADS, "gpu", xla_flags="")
    assert opts.options == {"xla_gpu_enable_command_buffer": ""}
    assert "0.79x" in opts.reason and "0.91x" in opts.reason        # says why, with the measurement
    assert opts.describe().startswith("--xla_gpu_enable_command_buffer= (")


@pytest.mark.parametrize("recipe, platform, why", [
    (SAVES, "gpu", "offloads nothing"),
    (zoo.Recipe.full(), "gpu", "offloads nothing"),
    (None, "gpu", "offloads nothing"),
    (OFFLOADS, "cpu", "no copy streams to free on cpu"),
])
def test_other_steps_keep_xlas_defaults(recipe, platform, why):
    opts = compile_options.for_step(recipe, platform, xla_flags="")
    assert opts.options == {} and why in opts.reason and opts.describe().startswith("XLA's defaults")


@pytest.mark.parametrize("flags", ["--xla_gpu_enable_command_buffer=FUSION",
                                   "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_command_buffer="])
def test_the_users_xla_flags_win(flags):
    opts = compile_options.for_step(OFFLOADS, "gpu", xla_flags=flags)
    assert opts.options == {} and "yours win" in opts.reason


def test_the_environment_is_read_when_no_flags_are_given(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=CUBLAS")
    assert compile_options.for_step(OFFLOADS, "cuda").options == {}
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=true")
    assert compile_options.for_step(OFFLOADS, "cuda").options == compile_options.HIDE_COPIES


def test_xla_accepts_the_options():
    """The option's name and value parse in this jaxlib (XLA applies GPU debug options on any backend's compile):
    a renamed flag would fail here, not silently on the GPU."""
    f = jax.jit(lambda x: jnp.sin(x) * 2).lower(jnp.ones(4))
    assert float(f.compile(compiler_options=compile_options.HIDE_COPIES)(jnp.ones(4))[0]) == pytest.approx(
        2 * float(jnp.sin(1.0)))


def test_the_steps_one_compile_passes_the_options_to_xla(monkeypatch):
    """compile_abstract compiles with for_step's options: a bad value planted there reaches XLA's parser."""
    bad = compile_options.StepOptions({"xla_gpu_enable_command_buffer": "NOT_A_COMMAND"}, "planted")
    monkeypatch.setattr(compile_options, "for_step", lambda recipe, platform, xla_flags=None: bad)
    cfg = zoo.models.LlamaConfig.preset("tiny")
    with pytest.raises(Exception, match="NOT_A_COMMAND"):
        compile_abstract(family("llama3"), cfg, OFFLOADS, batch=2, seq=8)


def test_the_chunking_hint_is_shown_only_where_the_mlp_is_offloaded_in_one_piece_on_a_gpu():
    """The gate/up copies wait for their whole tensor; the hint names the setting measured to hide more of them."""
    mlp = zoo.Recipe("mlp", offload=("mlpwi_0", "mlpwi_1"))
    hint = compile_options.chunking_hint(mlp, 1, "gpu")
    assert hint.startswith("hint: --set mlp_seq_chunks=2 ") and "docs/offload-profile.md" in hint
    assert compile_options.chunking_hint(zoo.Recipe("up", offload=("mlpwi_1",)), 1, "cuda") == hint
    assert compile_options.chunking_hint(mlp, 2, "gpu") is None            # already chunked
    assert compile_options.chunking_hint(mlp, 1, "cpu") is None            # no copies to hide
    assert compile_options.chunking_hint(OFFLOADS, 1, "gpu") is None       # the MLP is not offloaded
    assert compile_options.chunking_hint(zoo.Recipe.full(), 1, "gpu") is None
