"""The memory planner's command line: what a recipe keeps in HBM, puts in host memory and recomputes.

    python -m recipes.train.plan --model FAMILY --preset PRESET --recipe qkv_offload --batch 2 --seq 8192
    python -m recipes.train.plan --model FAMILY --preset PRESET --recipe qkv_offload --batch 4 --seq 8192 --mesh fsdp=2
    python -m recipes.train.plan --model FAMILY --preset PRESET --recipe auto --batch 4 --seq 4096 \
        --hbm 141 --link 55 --flops 600
    python -m recipes.train.plan --model FAMILY --preset PRESET --set num_layers=4 --recipe NAME --seq 4096 \
        --max-batch --hbm 104.9 --optimizer sgd   # the largest batch that fits
    python -m recipes.train.plan --model FAMILY --preset PRESET --recipe auto --max-seq --opt-state host \
        --params host --set param_dtype=bfloat16 --hbm 133 --host 110   # the longest sequence that fits

The model flags are those of `python -m recipes.train` (recipes/train/settings/cli.py); the plan is `zoo.plan`
(zoo/plan/). Nothing is allocated: the model is built from shapes alone, so any size plans on a laptop.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax

import zoo
from recipes.train.settings import cli, config, job
from recipes.train.step import fit
from zoo.plan.peak import allocator_limit
from zoo.plan.types import OPTIMIZERS

# The planner's own words for flags it shares with the training command (their defaults and types are the run's).
SHARED = {
    "batch": {"default": None},   # None: --max-batch starts at 1; a plan at the run's default batch
    "mesh": {"help": "plan per device under a mesh of the axes dp, fsdp, tp, ep (e.g. fsdp=4,tp=2; the device count "
                     "is their product, no devices needed): each parameter, optimizer moment and saved activation "
                     "divided as the sharding rules split it (zoo.sharding); instead of --shard"},
    "opt_dtype": {"choices": (*config.OPT_DTYPES, "float16"), "help": "dtype of the optimizer moments"},
    "opt_state": {"help": "where the optimizer moments live between steps, as `recipes.train --opt-state`: host "
                          "moves them from the HBM figures to pinned host memory"},
    "params": {"help": "where the parameters live, as `recipes.train --params`: host counts a float32 copy of 16-bit "
                       "parameters (4 bytes a parameter) in pinned host memory, stream also the decoder stacks' "
                       "parameters and their gradients (one layer's in HBM at a time, the copies in the step time), "
                       "device none of them"},
    "grad_accum": {"help": "micro-batches per update, as `recipes.train --grad-accum`: activations are planned for "
                           "batch/K, with float32 gradient sums in the model state"},
    "hbm_limit": {"flags": ("--hbm", "--hbm-limit"), "type": cli.positive_float,
                  "help": "HBM budget per device, GiB: warned about; needed by --recipe auto (an H200: 141)"},
    "link": {"type": cli.positive_float,
             "help": "host link speed, GB/s per direction: for --recipe auto and the step-time estimate (default: "
                     "measured inside a step on --device, zoo/plan/links.py: H200 55.3)"},
    "overlap": {"metavar": "FRACTION",
                "help": "fraction of transfer time hidden under compute, 0..1 (default: measured on --device, H200 0: "
                        "XLA's copies run on the compute stream; else 0)"},
    "peak_tflops": {"flags": ("--flops", "--peak-tflops"), "type": cli.positive_float, "metavar": "TFLOPS",
                    "help": "matmul rate, TFLOP/s: for --recipe auto and the step-time estimate (an H200 in bf16: "
                            "~600-800)"},
}


def parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m recipes.train.plan", description=__doc__.split("\n\n")[0],
                           formatter_class=cli.HelpFormatter)
    cli.add_fields(p, config.RunConfig, ("model", "preset", "overrides", "recipe", "batch", "seq"), **SHARED)
    p.epilog = (f"--preset, --seq and --batch default to the training command's ({config.default('preset')}, "
                f"{config.default('seq')}, {config.default('batch')}). "
                "--recipe auto chooses each tag's placement for --hbm (default: the allocator's limit of the device "
                "present), --flops (default: the datasheet table, recipes/train/watching/meter.py) and --link and "
                "--overlap (default: the link measured on --device, zoo/plan/links.py).")
    p.add_argument("--shard", type=cli.positive_int, default=1, metavar="N",
                   help="devices the batch and the model state are split over (data parallel + FSDP); must divide "
                        "--batch; figures are then per device, every byte divided by N (see --mesh)")
    cli.add_fields(p, config.RunConfig, ("mesh",), **SHARED)
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adamw",
                   help="optimizer whose moments count as model state")
    cli.add_fields(p, config.RunConfig, ("opt_dtype", "opt_state", "params", "grad_accum", "loss_chunk", "hbm_limit"),
                   **SHARED)
    p.add_argument("--host", type=cli.positive_float, metavar="GIB",
                   help="host memory budget per device for --recipe auto, GiB (none: unbounded)")
    cli.add_fields(p, config.RunConfig, ("link", "overlap"), **SHARED)
    p.add_argument("--device", default=None, metavar="KIND",
                   help="the device planned for, e.g. H200 (default: the device present); the peak is compiled "
                        "only for the device present, else estimated")
    p.add_argument("--peak", choices=("auto", "compile", "estimate", "none"), default="auto",
                   help="peak HBM with XLA's temporaries: compile the training step on abstract inputs for the "
                        "device present, or estimate it; auto: compile on an accelerator, estimate on the CPU (a "
                        "full-size step compiles slowly there and says nothing of a GPU)")
    cli.add_fields(p, config.RunConfig, ("peak_tflops",), **SHARED)
    p.add_argument("--max-batch", nargs="?", type=cli.positive_int, const=1024, default=None, metavar="CAP",
                   help="print the largest batch (a power of two, up to CAP, default 1024) whose peak HBM fits --hbm "
                        "(default: the allocator limit of the GPU present) and the peak at each batch planned, "
                        "instead of a plan; --batch is then the first batch planned (zoo.plan.largest_batch). With "
                        "--peak auto each batch is compiled on a GPU (about 30 s for a large model), estimated on "
                        "the CPU")
    p.add_argument("--max-seq", nargs="?", type=cli.positive_int, const=1 << 20, default=None, metavar="CAP",
                   help="print the longest sequence (a power of two from 1024, up to CAP, default 1048576, and the "
                        "config's max_seq_len) whose step fits --hbm (default: the allocator limit of the GPU present) "
                        "and the host budget (XLA's pinned pool, this machine's RAM and --host, whichever is least), "
                        "for --recipe (auto: chosen per length), and each length planned, instead of a plan; --batch "
                        "defaults to 1 (zoo.plan.longest_seq). With --peak auto the lengths are compiled on a GPU, "
                        "starting where the estimates end, and estimated on the CPU")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also draw every recipe of the family as this plan is made (the same optimizer, --opt-state, "
                        "--params, --grad-accum, mesh and budget): HBM and pinned host bytes per tag as stacked bars, "
                        "with the HBM budget and the pinned pool (recipes/train/watching/plot.py; needs matplotlib). "
                        "A directory: "
                        "the chart is written in it as MODEL-PRESET.png; a name without a suffix is written as PNG "
                        "under that exact name")
    return p


def _present_kind() -> str:
    import jax
    return jax.devices()[0].device_kind


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.plot is not None:
        if args.max_batch is not None:
            ap.error("--plot draws every recipe at one batch and --max-batch searches batches for one recipe: run "
                     "them as two commands (--plot with --batch N draws the recipes at N)")
        from recipes.train.watching import plot
        try:
            args.plot = plot.check_output(args.plot, f"{args.model}-{args.preset}")   # before anything is planned
        except ValueError as e:
            ap.error(cli.in_flags(str(e)))
    if args.max_batch is not None and args.max_seq is not None:
        ap.error("--max-batch and --max-seq search one dimension each: give one of them")
    if args.max_batch is not None:
        return _max_batch(ap, args)
    if args.max_seq is not None:
        return _max_seq(ap, args)
    if args.batch is None:
        args.batch = config.default("batch")
    if args.recipe == "auto":
        from recipes.train.watching import meter
        from zoo.plan import links
        kind = args.device or _present_kind()
        measured = links.measured(kind)
        link = args.link or (measured.rate_gbps if measured is not None else None)
        # As `recipes.train --recipe auto`: the FLOP rate from the datasheet table for the device planned for, and
        # the HBM budget from the device present when it is the one planned for.
        args.peak_tflops = args.peak_tflops or meter.peak_tflops_of(kind)[0]
        if args.hbm_limit is None and (args.device is None or args.device.lower() in _present_kind().lower()):
            limit = allocator_limit(jax.devices()[0])
            args.hbm_limit = limit / 2 ** 30 if limit else None
            args.hbm_from_allocator = bool(limit)
        missing = [f for f, v in (("--hbm", args.hbm_limit), ("--link", link), ("--flops", args.peak_tflops))
                   if not v]
        if missing:
            ap.error(f"--recipe auto needs {', '.join(missing)} (the HBM budget in GiB, the host link in GB/s, "
                     f"the matmul rate in TFLOP/s), e.g. --hbm 141 --link 55 --flops 600"
                     + ("" if "--link" not in missing else
                        f"; no link is measured for {args.device or _present_kind()!r}: pass --link or --device "
                        f"({', '.join(m.device_kind for m in links.MEASURED)})"))
    if args.overlap is not None and not 0 <= args.overlap <= 1:
        ap.error(f"--overlap must be a fraction in [0, 1], got {args.overlap}")
    if args.mesh is not None and args.shard != 1:
        ap.error("give --shard or --mesh, not both (--shard N is a uniform split; --mesh follows the rules)")
    if args.batch % args.shard:
        ap.error(f"--shard {args.shard} does not divide --batch {args.batch}: each device must hold whole sequences")

    try:
        family = cli.family(args.model)
        model_cfg = cli.model_config(family, args.preset, args.overrides)
        recipe = "auto" if args.recipe == "auto" else cli.recipe(family, args.recipe)
        if recipe != "auto":
            cli.check_recipe_fits(family, recipe, args.recipe, model_cfg, args.seq)
        _check_state(args, model_cfg)
        p = zoo.plan.plan(model_cfg, recipe, batch=args.batch, seq=args.seq, hardware=_hardware(args),
                          parallel=_parallel(args), training=_training(args),
                          peak=None if args.peak == "none" else args.peak, model_name=f"{args.model} {args.preset}")
    except ValueError as e:
        ap.error(cli.in_flags(str(e)))
    if args.json:
        json.dump(zoo.plan.to_json(p), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        zoo.plan.render(_in_flags(p), console=cli.console())
        if getattr(args, "hbm_from_allocator", False) or (args.hbm_limit is None
                                                           and allocator_limit(jax.devices()[0])):
            print(f"HBM budget: the allocator's limit of the GPU present: {job.allocator_share()}")
    if args.plot:
        _plot(ap, args, family, model_cfg, p)
    return 0


def _in_flags(p: zoo.plan.Plan) -> zoo.plan.Plan:
    """The plan as the command prints it: its peak's source and its warnings in flags (`cli.in_flags`)."""
    peak = None if p.peak is None else dataclasses.replace(p.peak, source=cli.in_flags(p.peak.source))
    return dataclasses.replace(p, peak=peak, warnings=tuple(map(cli.in_flags, p.warnings)))


def _check_state(args, model_cfg) -> None:
    """An --hbm budget the model state alone is over is refused (ValueError) before anything is planned, as the
    training command refuses its --hbm-limit (`recipes.train.step.fit.check_state`)."""
    if args.hbm_limit is not None:
        state = zoo.plan.model_state(model_cfg, training=_training(args), parallel=_parallel(args))
        fit.check_state(state, int(args.hbm_limit * 2 ** 30), "--hbm", "--hbm")


def _hardware(args) -> zoo.plan.Hardware:
    return zoo.plan.Hardware(hbm_gib=args.hbm_limit, host_gib=args.host, link_gbps=args.link, overlap=args.overlap,
                             tflops=args.peak_tflops, device_kind=args.device)


def _parallel(args) -> zoo.plan.Parallelism:
    return zoo.plan.Parallelism(shard=args.shard, mesh=args.mesh)


def _training(args) -> zoo.plan.Training:
    return zoo.plan.Training(optimizer=args.optimizer, opt_dtype=args.opt_dtype, grad_accum=args.grad_accum,
                             opt_state=args.opt_state, params=args.params, loss_chunk=args.loss_chunk)


def _plot(ap: argparse.ArgumentParser, args, family, model_cfg, printed: zoo.plan.Plan) -> None:
    """--plot: every recipe of the family planned as the printed plan was (the same shapes, Training, Hardware and
    Parallelism; no peak: the bars are saved bytes); the printed recipe's bar is the printed plan itself, and a
    recipe --recipe auto chose is drawn beside the family's."""
    from recipes import registry
    from recipes.train.watching import plot
    try:
        plans, left_out = {}, []
        for name, r in registry.recipes_of(family).items():
            if r != printed.recipe and not _fits_the_model(family, model_cfg, name, r, args.seq):
                left_out.append(name)   # its tiles or groups do not fit this model or sequence
                continue
            plans[name] = (printed if r == printed.recipe else
                           zoo.plan.plan(model_cfg, r, batch=args.batch, seq=args.seq, parallel=_parallel(args),
                                    training=_training(args), hardware=_hardware(args), peak=None))
        if printed not in plans.values():
            plans[f"{args.recipe}: {printed.recipe.name}" if args.recipe == "auto" else printed.recipe.name] = printed
        sets = "".join(f" {k}={v}" for k, v in args.overrides)
        where = f", mesh {args.mesh}" if args.mesh else f", over {args.shard} devices" if args.shard > 1 else ""
        t = _training(args)
        how = "".join(f", {label} {value}" for label, value, default in (
            ("grad accum", t.grad_accum, 1), ("opt state", t.opt_state, "device"), ("params", t.params, "device"),
            ("optimizer", t.optimizer, "adamw"), ("moments", t.opt_dtype, "float32")) if value != default)
        written = plot.recipes_chart(plans, args.plot, title=f"{args.model} {args.preset}{sets}: batch {args.batch}, "
                                                             f"seq {args.seq}{where}{how}")
    except ValueError as e:
        ap.error(cli.in_flags(str(e)))
    skipped = (f"; left out, their tiles or groups do not fit this model or --seq: {', '.join(left_out)}"
               if left_out else "")
    print(f"wrote {args.plot}: HBM and host bytes per tag of {len(plans)} recipes ({', '.join(plans)})"
          + (f"; {written}" if written else "") + skipped, file=sys.stderr if args.json else sys.stdout)


def _fits_the_model(family, model_cfg, name: str, recipe: zoo.Recipe, seq: int) -> bool:
    """Whether `recipe`'s tiles and groups fit the model of `model_cfg` at `seq` (`cli.check_recipe_fits`, the check
    the command refuses with)."""
    try:
        cli.check_recipe_fits(family, recipe, name, model_cfg, seq)
    except ValueError:
        return False
    return True


def _max_batch(ap: argparse.ArgumentParser, args) -> int:
    """--max-batch: zoo.plan.largest_batch over the powers of two up to the cap, from --batch (default 1)."""
    for flag, bad in (("--recipe auto", args.recipe == "auto"), ("--shard", args.shard != 1),
                      ("--mesh", args.mesh is not None), ("--peak none", args.peak == "none")):
        if bad:
            ap.error(f"--max-batch plans one recipe on one device: {flag} does not apply")
    try:
        family, model_cfg = _model(args)
        recipe = cli.recipe(family, args.recipe)
        cli.check_recipe_fits(family, recipe, args.recipe, model_cfg, args.seq)
        _check_state(args, model_cfg)
        start = args.batch
        if start is not None and (start & (start - 1) or start > args.max_batch):
            raise ValueError(f"--batch {start} with --max-batch is the first batch planned: a power of two up to "
                             f"{args.max_batch}")
        c = zoo.plan.largest_batch(model_cfg, recipe, seq=args.seq,
                                   hardware=zoo.plan.Hardware(hbm_gib=args.hbm_limit, device_kind=args.device),
                                   training=zoo.plan.Training(optimizer=args.optimizer, opt_dtype=args.opt_dtype),
                                   peak=args.peak, start=start, cap=args.max_batch)
    except ValueError as e:
        ap.error(cli.in_flags(str(e)))
    return _found(args, c)


def _max_seq(ap: argparse.ArgumentParser, args) -> int:
    """--max-seq: zoo.plan.longest_seq over the powers of two up to the cap, for --recipe (auto: per length)."""
    for flag, bad in (("--shard", args.shard != 1), ("--mesh", args.mesh is not None),
                      ("--peak none", args.peak == "none"), ("--plot", args.plot is not None)):
        if bad:
            ap.error(f"--max-seq plans on one device: {flag} does not apply")
    try:
        family, model_cfg = _model(args)
        recipe = "auto" if args.recipe == "auto" else cli.recipe(family, args.recipe)
        hardware = _hardware(args)
        if recipe == "auto":
            hardware = _auto_inputs(ap, args, hardware)
        found = zoo.plan.longest_seq(model_cfg, recipe, batch=args.batch or 1, hardware=hardware,
                                     training=_training(args), peak=args.peak, cap=args.max_seq, progress=_tried)
    except ValueError as e:
        ap.error(cli.in_flags(str(e)))
    return _found(args, found)


def _tried(t) -> None:
    """--max-seq's progress on stderr: each length as it is planned (a long step compiles for a minute or more)."""
    print(f"planned {t.seq}: peak {zoo.plan.fmt_bytes(t.peak_bytes)}, host {zoo.plan.fmt_bytes(t.host_bytes)}, "
          f"{'fits' if t.fits else 'does not fit'} ({t.peak_source})", file=sys.stderr, flush=True)


def _model(args):
    """(the family of --model, its config: --preset with --set)."""
    family = cli.family(args.model)
    return family, cli.model_config(family, args.preset, args.overrides)


def _found(args, found) -> int:
    """Print what --max-batch or --max-seq found: JSON with --json, else its line."""
    if args.json:
        json.dump(found.to_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(f"{args.model} {args.preset}: " + cli.in_flags(found.render()))
    return 0


def _auto_inputs(ap: argparse.ArgumentParser, args, hardware: zoo.plan.Hardware) -> zoo.plan.Hardware:
    """--recipe auto's link and FLOP rate where the flags leave them out: the device's measured link and table."""
    from recipes.train.watching import meter
    kind = args.device or _present_kind()
    tflops = args.peak_tflops or meter.peak_tflops_of(kind)[0]
    if tflops is None:
        ap.error("--recipe auto needs --flops (the matmul rate in TFLOP/s): no datasheet peak is known for "
                 f"{kind!r}")
    return dataclasses.replace(hardware, tflops=tflops)


if __name__ == "__main__":
    sys.exit(main())
