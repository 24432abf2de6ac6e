"""Inputs out of range are refused with a message naming the flag, before JAX sees them:
integers too large for a step counter, a shape or a PRNG seed; a non-finite or negative --peak-tflops;
--ckpt-every without --ckpt-dir. No compile: every case stops in the checks."""
from __future__ import annotations

import pytest

from recipes import train
from recipes.train import loop


@pytest.mark.parametrize("flags,message", [
    (["--steps", 10**20], "--steps must be in [1, 2,147,483,647], got 100,000,000,000,000,000,000"),
    (["--seed", 2**40], "--seed must be in [0, 2,147,483,647], got 1,099,511,627,776"),
    (["--seed", -1], "--seed must be in [0, 2,147,483,647], got -1"),
    (["--warmup", 2**31], "--warmup must be in [0, 2,147,483,647], got 2,147,483,648"),
    (["--batch", 2**20, "--seq", 2**12], "--batch 1048576 x --seq 4096: a step of more than 2**31 - 1 tokens"),
    (["--peak-tflops", "nan"], "--peak-tflops must be a finite number > 0, got nan"),
    (["--peak-tflops", "-5"], "--peak-tflops must be a finite number > 0, got -5.0"),
    (["--ckpt-every", 2], "--ckpt-every 2 needs --ckpt-dir (nothing would be saved)"),
    (["--log-every", 2**31], "--log-every must be in [1, 2,147,483,647]"),
    (["--set", f"num_layers={10**20}"], "--set num_layers=100000000000000000000: an integer field must be within"),
])
def test_out_of_range_flags_are_one_line_errors(flags, message, capsys):
    """The command exits 2 with one `error:` line naming the flag (no traceback, nothing compiled)."""
    rc = train.main([str(f) for f in flags] + ["--xla-flags", "none"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_library_config_checks_types_too():
    """RunConfig is the one place the ranges live: the library gets the same errors (a float step count too)."""
    with pytest.raises(ValueError, match="--steps must be an integer, got 6.5"):
        loop.RunConfig(steps=6.5)
    with pytest.raises(ValueError, match="--coordinator-timeout must be a finite number > 0"):
        loop.RunConfig(coordinator_timeout=float("inf"))


def test_shape_flags_are_bounded_by_argparse(capsys):
    """--batch and --seq (shared with `recipes.train.plan`) are parsed as positive int32 values: argparse's usage
    error."""
    with pytest.raises(SystemExit) as e:
        train.parser().parse_args(["--batch", str(10**11)])
    assert e.value.code == 2
    assert "argument --batch: expected a positive integer up to 2,147,483,647, got '100000000000'" in \
        capsys.readouterr().err



@pytest.mark.parametrize("argv, message", [
    (["--batch", "x"], "error: argument --batch: expected a positive integer, got 'x'"),
    (["--seq", "8", "--nope"], "error: unrecognized arguments: --nope; `{prog} --help` lists the flags"),
    (["--sequ", "8"], "error: unrecognized arguments: --sequ 8 (did you mean --seq?); `{prog} --help` lists the flags"),
    (["--presett", "tiny"], "error: unrecognized arguments: --presett tiny (did you mean --preset?); `{prog} --help`"),
    (["--verbose"], "error: unrecognized arguments: --verbose; `{prog} --help` lists"),   # nothing close
    (["--opt-state", "disk"], "error: argument --opt-state: invalid choice: 'disk' (choose from "),   # quoting: 3.12.8+
])
@pytest.mark.parametrize("command", ["recipes.train", "recipes.train.plan"])
def test_both_commands_say_no_in_one_line_without_the_usage_block(command, argv, message, capsys):
    """A flag argparse refuses: one `error:` line naming the flag and the fix, exit 2; the usage only for --help."""
    import importlib
    parser = importlib.import_module(command).parser()
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(message.format(prog=f"python -m {command}")), err
    assert err.count("\n") == 1 and "usage" not in err, err
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--help"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith(f"usage: python -m {command}")
