"""The main job's command line: --set values converted by the field's type, and bad input answered by a message
naming it (exit 2, before anything is built), not a traceback."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zoo
from recipes.train.checkpoints.checkpoint import Checkpoints
from tests.train.cli_runs import RUN, cli, copy_ckpt, main


def test_set_values_are_converted_by_field_type(tmp_path, capsys):
    from recipes.train.settings import cli as recipes_cli
    fam = zoo.models.registry.family("llama3")

    def convert(field, text):
        return getattr(recipes_cli.model_config(fam, "tiny", [(field, text)]), field)

    assert convert("tie_embeddings", "false") is False
    assert convert("tie_embeddings", "True") is True
    assert convert("num_layers", "3") == 3
    assert convert("rope_theta", "1e4") == 10000.0
    assert convert("attention_impl", "none") is None
    assert convert("attention_impl", "xla") == "xla"
    assert convert("rope_scaling", "None") is None
    for field, text, message in [("tie_embeddings", "maybe", "bool"), ("num_layers", "3.5", "int"),
                                 ("rope_theta", "nan", "rope_theta"), ("rope_scaling", "{}", "rope_scaling"),
                                 ("num_layer", "3", "not a field of LlamaConfig")]:
        with pytest.raises(ValueError, match=f"--set {field}=.*{message}"):
            convert(field, text)
    rc, out, err = main(RUN + ["--set", "tie_embeddings=maybe"], capsys)
    assert rc == 2 and "--set tie_embeddings=maybe" in err and "bool" in err and "compiled" not in out
    # End to end: false unties (the LM head's parameters exist); 'false' as a string used to tie them.
    def n_params(tie):
        cfg = zoo.models.LlamaConfig.preset("tiny", num_layers=1, tie_embeddings=tie)
        return zoo.models.count_params(nnx.eval_shape(lambda: zoo.models.llama3(cfg, rngs=nnx.Rngs(0))))
    assert n_params(False) == n_params(True) + 256 * 64
    out = cli(RUN + ["--set", "tie_embeddings=false", "--stop-after", 1])
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"model llama3 tiny: {n_params(False):,} parameters" in out.stdout, out.stdout


def test_errors_are_messages_naming_the_input_not_tracebacks(base, tmp_path, capsys, tiny_model):
    if jax.devices()[0].platform != "gpu":
        rc, out, err = main(RUN + ["--set", "attention_impl=cudnn"], capsys)
        assert rc == 2 and "attention_impl='cudnn' cannot run here: cuDNN runs only on NVIDIA GPUs" in err
        assert "Traceback" not in err and "compiled" not in out
    # A Python list as tokens is accepted: converted to an int32 array.
    tokens = [[1, 2, 3], [4, 5, 6]]
    np.testing.assert_array_equal(tiny_model(tokens), tiny_model(jnp.asarray(tokens, jnp.int32)))
    with pytest.raises(ValueError, match=r"tokens must be an integer array \[batch, seq\], got float"):
        tiny_model([[1.5, 2.0]])
    # Resume with --lr nan: the flag is named.
    ckpt = copy_ckpt(base, tmp_path)
    rc, out, err = main(RUN + ["--ckpt-dir", ckpt, "--resume", "--lr", "nan"], capsys)
    assert rc == 2 and "--lr must be a finite number > 0, got nan" in err
    # A checkpoint record that is not JSON: the file is named, and the run resumes from the step before.
    record = ckpt / "6" / "record" / "metadata"
    record.write_text('{"step": 6, "run"')
    with pytest.raises(ValueError, match=f"checkpoint record {record} is unreadable"):
        Checkpoints(ckpt).record(6)
    out = cli(RUN + ["--ckpt-dir", ckpt, "--resume"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"checkpoint step 6 in {ckpt} is damaged (checkpoint record {record} is unreadable" in out.stdout
    assert f"resumed from {ckpt} at step 4" in out.stdout


@pytest.mark.parametrize("args, says", [
    (["--recipe", "context_tiles", "--seq", 100],
     "error: --recipe context_tiles cuts the sequence into 16 tiles and --seq 100 is not a multiple of 16: give "
     "--seq 96 or --seq 112, or --recipe context_save (the same placements) without tiles\n"),
    (["--recipe", "long_context", "--seq", 32, "--set", "num_layers=3"],
     "error: --recipe long_context recomputes the layers in groups of 2 and the stack 'layers' has 3 layers, not a "
     "multiple of 2: give --recipe context_tiles without groups, or --set num_layers=2 or --set num_layers=4\n"),
])
def test_a_recipes_tiles_or_group_that_do_not_fit_are_refused_before_compiling_in_the_flags_typed(args, says,
                                                                                                    capsys):
    """Tiles that do not divide --seq, a group that does not divide a stack: refused before anything compiles, in the
    flags typed (not `seq_tiles=16`), with the nearest values that work and a recipe without them (the command in
    this process: it stops before building anything)."""
    rc, out, err = main(["--model", "llama3", "--preset", "tiny", "--steps", 1, "--xla-flags", "none", *args], capsys)
    assert rc == 2 and err == says, out + err
    assert "compiling" not in out, out
