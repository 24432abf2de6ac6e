"""The main job: train a zoo model under a recipe and show what the recipe costs.

    python -m recipes.train --model llama3 --preset tiny --recipe qkv_offload --steps 60

Runs on the CPU by default (the tiny preset, batch 8 x seq 64: under a minute); the same command with a
full-size preset trains on a GPU. The XLA flag set (`--xla-flags`) is applied before JAX is imported: this
module imports nothing of JAX until the arguments are parsed. The loop itself is `recipes/loop.py`.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

from recipes import cli, flags


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipes.train", description=__doc__.split("\n\n")[0],
                                formatter_class=cli.HelpFormatter)
    cli.add_model_args(p, **cli.DEFAULTS)
    p.add_argument("--steps", type=int, default=60, help="train up to this step")
    p.add_argument("--schedule-steps", type=int, default=None, metavar="N",
                   help="the learning-rate schedule's length (default: --steps); steps past it run at its final "
                        "learning rate, lr/10: resume with a larger --steps and the same --schedule-steps to "
                        "train on past a finished run")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: 3e-3 for tiny, the published peak for a full-size preset: "
                        "recipes/defaults.py)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up steps (default: schedule steps // 10, at most the preset's published warm-up)")
    p.add_argument("--opt-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of AdamW's moments, whatever the parameters' dtype")
    p.add_argument("--opt-state", choices=("device", "host"), default="device",
                   help="where the optimizer's moments live between steps: device (HBM) or host (pinned host "
                        "memory; each step streams them into HBM for the update and back, one parameter at a time)")
    p.add_argument("--grad-accum", type=cli.positive_int, default=1, metavar="K",
                   help="micro-batches per optimizer update: --batch is the global batch, split into K micro-batches "
                        "of batch/K sequences whose gradients are summed (in float32) before one update; K must "
                        "divide --batch. Activation memory is a micro-batch's")
    p.add_argument("--hbm-limit", "--hbm", type=float, default=None, metavar="GIB",
                   help="device memory budget the compiled step's peak must fit (default: the device's "
                        "bytes_limit; on the CPU, the machine's RAM)")
    p.add_argument("--link", type=float, default=None, metavar="GBPS",
                   help="--recipe auto: host link GB/s per direction (default: the one measured for the device, "
                        "zoo.plan.links)")
    p.add_argument("--overlap", type=float, default=None, metavar="F",
                   help="--recipe auto: fraction of transfer time hidden under compute (default: measured; 0 with "
                        "--link)")
    p.add_argument("--force", action="store_true",
                   help="launch even if the compiled step's peak exceeds the budget or its host bytes the pinned pool")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's decoupled weight decay")
    p.add_argument("--seed", type=int, default=0, help="seeds the parameters and the data")
    p.add_argument("--mesh", default=None, metavar="AXIS=N,...",
                   help="device mesh over every device of every process, axes dp, fsdp, tp, ep (e.g. fsdp=4,tp=2; "
                        "missing axes are 1; their product must be the device count); default: all devices on fsdp")
    p.add_argument("--distributed", action="store_true",
                   help="multi-host: call jax.distributed.initialize() first (automatic when JAX_COORDINATOR_ADDRESS "
                        "is set; JAX_NUM_PROCESSES and JAX_PROCESS_ID name the processes; see README)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="a token file (flat little-endian uint16/uint32 ids, see recipes/data.py), or text: a .txt "
                        "or .jsonl file or a directory of them, with --tokenizer (recipes/text.py); default: "
                        "synthetic Markov-chain sequences")
    p.add_argument("--data-dtype", choices=("uint16", "uint32"), default=None,
                   help="ids' type in a token file (default: uint16 if the vocabulary fits, else uint32)")
    p.add_argument("--allow-data-change", action="store_true",
                   help="--resume although --data is not the file the checkpoint's run read (another path, size "
                        "or content)")
    p.add_argument("--coordinator-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="multi-host: how long to wait for the coordinator and every process before giving up")
    p.add_argument("--heartbeat-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="multi-host: a process not heard from for this long (killed, crashed) stops the others "
                        "with a message (exit 1); restart all with --resume")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="text --data: a Hugging Face tokenizer.json (or its directory); the text is tokenized once "
                        "and cached by content (pip install -e \".[text]\")")
    p.add_argument("--eval-every", type=int, default=0, metavar="K",
                   help="every K steps (and at the end), the loss and perplexity on held-out data: the last "
                        "--heldout of --data, or unseen synthetic sequences (0: never)")
    p.add_argument("--heldout", type=float, default=None, metavar="FRACTION",
                   help="fraction of --data kept out of training for --eval-every (default: 0.01 with "
                        "--eval-every, else 0)")
    p.add_argument("--eval-batches", type=int, default=16, metavar="N",
                   help="at most N held-out batches per evaluation")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="write TensorBoard scalars here (losses, grad norm, lr, TFLOP/s, MFU, HBM, host bytes, "
                        "drops; pip install -e \".[watch]\")")
    p.add_argument("--metrics", default=None, metavar="PATH", help="write one JSON line per logged step")
    p.add_argument("--log-every", type=int, default=10, help="print (and write to --metrics) every K steps")
    p.add_argument("--ckpt-dir", default=None, metavar="DIR", help="orbax checkpoints here")
    p.add_argument("--ckpt-every", type=int, default=0, metavar="K", help="checkpoint every K steps (and at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    p.add_argument("--peak-tflops", "--flops", type=float, default=None,
                   help="the device's peak TFLOP/s, for MFU and --recipe auto (default: a table)")
    p.add_argument("--max-drop-warn", type=float, default=0.01, metavar="FRACTION",
                   help="warn when MoE capacity dispatch drops more than this fraction of a step's token copies")
    p.add_argument("--xla-flags", choices=tuple(flags.FLAG_SETS), default=flags.DEFAULT,
                   help="XLA flag set for overlap, applied before JAX starts (see recipes/flags.py)")
    p.add_argument("--stop-after", type=int, default=None, metavar="K",
                   help="debug: stop after step K without a final checkpoint, as if preempted")
    p.add_argument("--poison-step", type=int, default=None, metavar="K",
                   help="debug: set the loss weights of step K's batch to NaN (a corrupted record) to see the "
                        "NaN guard stop the run")
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

    from recipes import loop, mesh
    from recipes.checkpoint import CheckpointError
    from recipes.interrupt import Interrupted

    kwargs = {k: v for k, v in vars(args).items() if k not in ("xla_flags", "heartbeat_timeout")}
    watch = None   # several processes: recipes.mesh.PeerWatch
    try:
        if mesh.maybe_initialize(args.distributed, args.coordinator_timeout, args.heartbeat_timeout):
            # (before JAX touches a device)
            print(f"distributed: process {jax.process_index()} of {jax.process_count()}, "
                  f"{jax.local_device_count()} local of {jax.device_count()} devices", flush=True)
            watch = mesh.PeerWatch(args.heartbeat_timeout)
        mesh.check_backend()
        if jax.default_backend() != "cpu":   # the flags are GPU flags: on the CPU they parse and do nothing
            print(f"XLA flag set {args.xla_flags!r}: {' '.join(chosen) or '(none)'}; "
                  f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
        kwargs["overrides"] = tuple(kwargs["overrides"])   # text: converted by the field's type (recipes.cli)
        result = loop.run(loop.RunConfig(**kwargs))
    except ValueError as e:       # a bad flag, file or directory: found before training
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except (CheckpointError, OSError) as e:   # failed while training: the last checkpoint written is intact
        print(f"error: {e}", file=sys.stderr)
        code = 1
    except Interrupted as e:   # SIGINT/SIGTERM before training started (recipes.interrupt)
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

if __name__ == "__main__":
    sys.exit(main())
