"""The main job's command line: train a zoo model under a recipe and show what the recipe costs.

    python -m recipes.train --preset tiny --recipe qkv_offload --steps 60     # --model FAMILY: another family

Runs on the CPU by default (the tiny preset, batch 8 x seq 64: under a minute); the same command with a
full-size preset trains on a GPU. The XLA flag set (`--xla-flags`) is applied before JAX is imported: this
module imports nothing of JAX until the arguments are parsed. The loop itself is `recipes/train/loop.py`.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback

from recipes.train.settings import cli, config, flags


def parser() -> argparse.ArgumentParser:
    """Every field of the run (`recipes.train.settings.config.RunConfig`) and of the launch
    (`recipes.train.settings.config.Launch`) as a flag."""
    p = cli.ArgumentParser(prog="python -m recipes.train", description=__doc__.split("\n\n")[0],
                           formatter_class=cli.HelpFormatter)
    cli.add_fields(p, config.RunConfig)
    cli.add_fields(p, config.Launch)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:   # Ctrl-C while JAX was still being imported (the loop catches it from then on)
        print("SIGINT: stopped before training started; nothing to save (exit 130)", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    args = parser().parse_args(argv)
    chosen = flags.apply(args.xla_flags)

    import jax  # only now: the flags are set

    from recipes.train import loop
    from recipes.train.checkpoints.checkpoint import CheckpointError
    from recipes.train.processes import agree, mesh
    from recipes.train.processes.interrupt import Interrupted

    launch = {f.name for f in dataclasses.fields(config.Launch)}
    kwargs = {k: v for k, v in vars(args).items() if k not in launch}
    watch = None   # several processes: recipes.train.processes.mesh.PeerWatch
    try:
        if mesh.maybe_initialize(args.distributed, args.coordinator_timeout, args.heartbeat_timeout):
            # (before JAX touches a device)
            print(f"distributed: process {jax.process_index()} of {jax.process_count()}, "
                  f"{jax.local_device_count()} local of {jax.device_count()} devices", flush=True)
            agree.same_command(vars(args), args.coordinator_timeout)   # ValueError on every process
            watch = mesh.PeerWatch(args.heartbeat_timeout)
        mesh.check_backend()
        if jax.default_backend() != "cpu":   # the flags are GPU flags: on the CPU they parse and do nothing
            print(f"XLA flag set {args.xla_flags!r}: {' '.join(chosen) or '(none)'}; "
                  f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
        # text: converted by the field's type (recipes.train.settings.cli)
        kwargs["overrides"] = tuple(kwargs["overrides"])
        result = loop.run(config.RunConfig(**kwargs))
    except ValueError as e:       # a bad flag, file or directory: found before training
        print(f"error: {e}", file=sys.stderr)
        code = 2
        if watch is not None and isinstance(e, agree.Shared):   # every process stops alike: end as a finished run
            watch.close(done=True)
            return code
    except (CheckpointError, OSError) as e:   # failed while training: the last checkpoint written is intact
        print(f"error: {e}", file=sys.stderr)
        code = 1
    except Interrupted as e:   # SIGINT/SIGTERM before training started (recipes.train.processes.interrupt)
        print(f"{e}: stopped before training started; nothing to save (exit {e.exit_code})", file=sys.stderr)
        code = e.exit_code
    except Exception as e:
        if watch is None:
            raise
        if isinstance(e, jax.errors.JaxRuntimeError):   # e.g. gloo: "Connection reset by peer"
            print(f"error: {mesh.peer_lost(f'a collective with the other processes failed ({mesh.first_line(e)})')}",
                  file=sys.stderr)
        else:
            traceback.print_exc()
        code = 1
    else:
        if watch is not None:
            watch.close(done=True)   # every process got here: JAX's shutdown at exit meets them all
        return result.exit_code or (1 if result.stopped == "nonfinite" else 0)
    if watch is not None:
        # Failed on this process: stop saying it is alive (the others stop too, `PeerWatch`), and leave without JAX's
        # shutdown at exit, which would wait for processes that are gone and then abort with a C++ stack trace.
        watch.close(done=False)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
