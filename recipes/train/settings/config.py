"""What a training run is: `RunConfig`, the one place for each setting's default, help text and checks.

`python -m recipes.train`'s command line is generated from these fields (`recipes.train.settings.cli.add_fields`), and
`python -m recipes.train.plan` takes the shared ones (model, shape, optimizer state, budget, link, mesh) from the same
fields, so the two commands cannot disagree on a default. Each field's `metadata` holds what argparse needs beyond
the field's type and default: the flag names, the help, a metavar, choices, a stricter argparse type.

Training defaults per preset (the first section below, `for_preset` and `warmup`): the peak learning rate and the
warm-up, from the published runs; `--lr` and `--warmup` given on the command line always win.

Dtypes (the configs' own defaults, kept): parameters in float32, activations in bf16 (`dtype`), softmax/norm
statistics and the loss in float32, AdamW moments in float32 (`--opt-dtype`): the usual mixed precision.
`--opt-dtype bfloat16` halves the optimizer state (moments kept in bf16 "without observable degradation" in a
published 671B run).

Importing this module imports no JAX (the training command applies its XLA flags before JAX starts); a RunConfig's
checks that need the library import it when a config is made, and so do the training defaults.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from typing import Any

from recipes.train.settings import flags
from recipes.train.settings.cli import INT32_MAX, family, field_override, positive_int

OPT_DTYPES = ("float32", "bfloat16")


def flag(default: Any, help: str, *names: str, **argparse_kwargs) -> Any:
    """A dataclass field with its command-line flag: `names` (default: --the-field-name), `help`, and argparse's
    keywords where the field's type and default do not say it all (metavar, choices, a checking type)."""
    meta = {"help": help, **argparse_kwargs}
    if names:
        meta["flags"] = names
    return dataclasses.field(default=default, metadata=meta)


def loss_chunk_arg(text: str) -> int | str | None:
    """--loss-chunk: "auto", "none" or 0 (unchunked), or a positive integer (checked against --seq later)."""
    text = text.strip().lower()
    if text in ("auto", "none"):
        return None if text == "none" else text
    try:
        return int(text) or None
    except ValueError:
        raise argparse.ArgumentTypeError(f"--loss-chunk takes a number of positions, auto or none, "
                                         f"got {text!r}") from None


# -- training defaults per preset -------------------------------------------------------------------------------
# A family declares the published schedules of its presets (`zoo.models.registry.Family.train_defaults`, in its
# package). The tiny preset keeps the CPU demo's 3e-3 (a 100k parameter model learns in 60 steps); a full-size preset
# with no published schedule gets 3e-4 and a 2000-step warm-up (the common peak and warm-up of published 7-8B runs):
# the tiny rate made an 8B run's loss rise (12.27 -> 14.53, issue 11). The warm-up is a tenth of the schedule (at
# least one step), capped at the published warm-up, so a short run warms up briefly and a long one as the paper did.
DEFAULT_MODEL = "llama3"  # --model's default: the family of the README's main job

# (peak learning rate, warm-up cap, where from) of a preset its family publishes no schedule for
TINY = (3e-3, None, "the CPU demo (README's main job)")
FULL_SIZE = (3e-4, 2000, "a full-size default: the common 3e-4 peak and 2000 warm-up steps of published 7-8B runs")


def for_preset(model: str, preset: str):
    """The preset's `zoo.models.registry.TrainDefaults`: what its family publishes for it, else `TINY` for the
    tiny preset, else `FULL_SIZE`. Imports the library (JAX) when called, not when this module is imported."""
    from zoo.models.registry import TrainDefaults
    published = family(model).train_defaults.get(preset)
    return published if published is not None else TrainDefaults(*(TINY if preset == "tiny" else FULL_SIZE))


def warmup(model: str, preset: str, schedule_steps: int) -> int:
    """A tenth of the schedule, at least 1, at most the published warm-up."""
    steps = max(1, schedule_steps // 10)
    cap = for_preset(model, preset).warmup_cap
    return steps if cap is None else min(steps, cap)


# -- the run ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: str = flag(DEFAULT_MODEL, "model family: a name in the zoo's model table (zoo.models.registry; a name "
                      "not there lists them)", metavar="FAMILY")
    preset: str = flag("tiny", "a size of the family (a key of its config's PRESETS; a name not there lists them), "
                       "e.g. tiny", metavar="NAME")
    overrides: tuple[tuple[str, Any], ...] = flag(
        (), "replace a config field, e.g. --set num_layers=3 or --set tie_embeddings=false; the value is checked "
        "against the field's type (repeatable)", "--set", type=field_override, action="append",
        metavar="FIELD=VALUE")
    recipe: str | None = flag(None, "a key of the family's RECIPES (recipes/<family>.py), or auto (the planner's "
                              "choice for the device; recipes.train.step.fit); default: the family's study recipe",
                              metavar="NAME")
    batch: int = flag(8, "global batch (sequences per step)", type=positive_int)
    seq: int = flag(64, "sequence length (tokens)", type=positive_int)
    steps: int = flag(60, "train up to this step")
    schedule_steps: int | None = flag(
        None, "the learning-rate schedule's length (default: --steps); steps past it run at its final learning "
        "rate, lr/10: resume with a larger --steps and the same --schedule-steps to train on past a finished run",
        metavar="N")
    lr: float | None = flag(None, "peak learning rate (default: 3e-3 for tiny, the published peak of a full-size "
                            "preset (its family's training defaults), else 3e-4: recipes/train/settings/config.py)")
    warmup: int | None = flag(None, "warm-up steps (default: schedule steps // 10, at most the preset's published "
                              "warm-up)")
    opt_dtype: str = flag("float32", "dtype of AdamW's moments, whatever the parameters' dtype", choices=OPT_DTYPES)
    opt_state: str = flag("device", "where the optimizer's moments live between steps: device (HBM) or host (pinned "
                          "host memory; each step streams them into HBM for the update and back, a layer slice at a "
                          "time)", choices=("device", "host"))   # zoo.opt_state.OPT_STATE_PLACES (no JAX here)
    params: str = flag("device", "where the parameters live: device (the parameters in HBM, in their dtype, and "
                       "nothing else), host (a float32 master copy of 16-bit parameters in pinned host memory: the "
                       "update is computed on it and the parameters in HBM are its rounding) or stream (the master "
                       "and the decoder stacks' 16-bit parameters in pinned host memory: each layer's slice is "
                       "brought into HBM as the scan reaches it and its gradient goes back as the backward pass makes "
                       "it; --grad-accum 1); host and stream need --set param_dtype=bfloat16",
                       choices=("device", "host", "stream"))   # zoo.opt_state.PARAMS_PLACES
    grad_accum: int = flag(1, "micro-batches per optimizer update: --batch is the global batch, split into K "
                           "micro-batches of batch/K sequences whose gradients are summed (in float32) before one "
                           "update; K must divide --batch. Activation memory is a micro-batch's", type=positive_int,
                           metavar="K")
    loss_chunk: int | str | None = flag(
        "auto", "positions of the sequence per chunk of the LM head and its cross-entropy, so the [batch, seq, vocab] "
        "float32 logits never exist whole (a divisor of --seq); auto: the largest divisor whose chunk's logits fit "
        "512 MiB, unchunked where the whole sequence's do; 0 or none: unchunked", type=loss_chunk_arg, metavar="N")
    hbm_limit: float | None = flag(None, "device memory budget the compiled step's peak must fit (default: the "
                                   "device's bytes_limit; on the CPU, the machine's RAM)", "--hbm-limit", "--hbm",
                                   metavar="GIB")
    link: float | None = flag(None, "--recipe auto: host link GB/s per direction (default: the one measured for the "
                              "device, zoo.plan.links)", metavar="GBPS")
    overlap: float | None = flag(None, "--recipe auto: fraction of transfer time hidden under compute (default: "
                                 "measured; 0 with --link)", metavar="F")
    force: bool = flag(False, "launch even if the compiled step's peak exceeds the budget or its host bytes the "
                       "pinned pool")
    clip: float = flag(1.0, "global gradient-norm clip")
    weight_decay: float = flag(0.1, "AdamW's decoupled weight decay")
    seed: int = flag(0, "seeds the parameters and the data")
    mesh: str | None = flag(None, "device mesh over every device of every process, axes dp, fsdp, tp, ep (e.g. "
                            "fsdp=4,tp=2; missing axes are 1; their product must be the device count); default: all "
                            "devices on fsdp", metavar="AXIS=N,...")
    distributed: bool = flag(False, "multi-host: call jax.distributed.initialize() first (automatic when "
                             "JAX_COORDINATOR_ADDRESS is set; JAX_NUM_PROCESSES and JAX_PROCESS_ID name the "
                             "processes; see README)")
    data: str | None = flag(None, "a token file (flat little-endian uint16/uint32 ids, see "
                            "recipes/train/inputs/data.py), or text: a .txt or .jsonl file or a directory of them, "
                            "with --tokenizer (recipes/train/inputs/text.py); "
                            "default: synthetic Markov-chain sequences", metavar="PATH")
    data_dtype: str | None = flag(None, "ids' type in a token file (default: uint16 if the vocabulary fits, else "
                                  "uint32)", choices=("uint16", "uint32"))
    allow_data_change: bool = flag(False, "--resume although --data is not the file the checkpoint's run read "
                                   "(another path, size or content)")
    coordinator_timeout: float = flag(300.0, "multi-host: how long to wait for the coordinator and every process "
                                      "before giving up", metavar="SECONDS")
    tokenizer: str | None = flag(None, "text --data: a Hugging Face tokenizer.json (or its directory); the text is "
                                 "tokenized once and cached by content (pip install -e \".[text]\")", metavar="DIR")
    text_encoding: str | None = flag(None, "text --data: the files' encoding (e.g. latin-1); default UTF-8, and a "
                                     "file that is not UTF-8 is refused naming the byte", metavar="ENC")
    eval_every: int = flag(0, "every K steps (and at the end), the loss and perplexity on held-out data: the last "
                           "--heldout of --data, or unseen synthetic sequences (0: never)", metavar="K")
    heldout: float | None = flag(None, "fraction of --data kept out of training for --eval-every (default: 0.01 "
                                 "with --eval-every, else 0; refused without --eval-every, which alone reads it)",
                                 metavar="FRACTION")
    eval_batches: int = flag(16, "at most N held-out batches per evaluation", metavar="N")
    tensorboard: str | None = flag(None, "write TensorBoard scalars here (losses, grad norm, lr, TFLOP/s, MFU, HBM, "
                                   "host bytes, drops; pip install -e \".[watch]\"); one run per directory: "
                                   "another run's event files there are refused, --resume continues its own",
                                   metavar="DIR")
    profile: str | None = flag(None, "write a profiler trace of one step here: the run's second (its first when it "
                               "runs one); TensorBoard's profile plugin (xprof) or Perfetto reads it, and the traced "
                               "step's own time includes the tracing", metavar="DIR")
    metrics: str | None = flag(None, "write one JSON line per logged step", metavar="PATH")
    log_every: int = flag(10, "print (and write to --metrics) every K steps")
    ckpt_dir: str | None = flag(None, "orbax checkpoints here", metavar="DIR")
    ckpt_every: int = flag(0, "checkpoint every K steps (and at the end)", metavar="K")
    resume: bool = flag(False, "continue from the latest checkpoint in --ckpt-dir")
    peak_tflops: float | None = flag(None, "the device's peak TFLOP/s, for MFU and --recipe auto (default: a table)",
                                     "--peak-tflops", "--flops")
    max_drop_warn: float = flag(0.01, "warn when MoE capacity dispatch drops more than this fraction of a step's "
                                "token copies", metavar="FRACTION")
    stop_after: int | None = flag(None, "debug: stop after step K without a final checkpoint, as if preempted",
                                  metavar="K")
    poison_step: int | None = flag(None, "debug: set the loss weights of step K's batch to NaN (a corrupted record) "
                                   "to see the NaN guard stop the run", metavar="K")

    def __post_init__(self):
        # The library's own checks, imported here rather than at the top: the command line is parsed (this module
        # imported) before JAX may start.
        from zoo.opt_state import check_places
        from zoo.train_step import check_grad_accum, check_loss_chunk
        check_ranges(self)
        for field in ("steps", "batch", "seq", "log_every"):
            if getattr(self, field) <= 0:
                raise ValueError(f"--{field.replace('_', '-')} must be positive, got {getattr(self, field)}")
        if self.schedule_steps is not None and self.schedule_steps <= 0:
            raise ValueError(f"--schedule-steps must be positive, got {self.schedule_steps}")
        for flag_, value, lowest, strict in (("lr", self.peak_lr, 0, True), ("clip", self.clip, 0, True),
                                             ("weight-decay", self.weight_decay, 0, False)):
            if not (math.isfinite(value) and (value > lowest if strict else value >= lowest)):
                raise ValueError(f"--{flag_} must be a finite number {'>' if strict else '>='} {lowest}, got {value}")
        if self.warmup is not None and not 0 <= self.warmup < self.total_schedule:
            raise ValueError(f"--warmup must be >= 0 and less than the schedule's {self.total_schedule} steps "
                             f"(--schedule-steps, default --steps), got {self.warmup}")
        if self.link is not None and not (math.isfinite(self.link) and self.link > 0):
            raise ValueError(f"--link must be a positive number of GB/s, got {self.link}")
        if self.overlap is not None and not 0 <= self.overlap <= 1:
            raise ValueError(f"--overlap must be in [0, 1], got {self.overlap}")
        if self.hbm_limit is not None and not (math.isfinite(self.hbm_limit) and self.hbm_limit > 0):
            raise ValueError(f"--hbm-limit must be a positive number of GiB, got {self.hbm_limit}")
        check_grad_accum(self.batch, self.grad_accum)
        check_loss_chunk(self.seq, self.loss_chunk)
        check_places(opt_state=self.opt_state, params=self.params)
        if self.opt_dtype not in OPT_DTYPES:
            raise ValueError(f"--opt-dtype must be float32 or bfloat16, got {self.opt_dtype!r}")
        if not 0 <= self.max_drop_warn <= 1:
            raise ValueError(f"--max-drop-warn must be a fraction in [0, 1], got {self.max_drop_warn}")
        self._check_outputs()

    def _check_outputs(self) -> None:
        """Checkpoints, evaluation and text data: flags that need another flag."""
        if self.ckpt_every < 0:
            raise ValueError(f"--ckpt-every must be >= 0, got {self.ckpt_every}")
        if self.resume and not self.ckpt_dir:
            raise ValueError("--resume needs --ckpt-dir")
        if self.ckpt_every and not self.ckpt_dir:
            raise ValueError(f"--ckpt-every {self.ckpt_every} needs --ckpt-dir (nothing would be saved)")
        if self.eval_every < 0 or self.eval_batches <= 0:
            raise ValueError(f"--eval-every must be >= 0 and --eval-batches positive, got {self.eval_every} and "
                             f"{self.eval_batches}")
        if not 0 <= self.held_out < 1:
            raise ValueError(f"--heldout must be a fraction in [0, 1), got {self.heldout}")
        self._check_eval()
        if self.profile and os.path.exists(self.profile) and not os.path.isdir(self.profile):
            raise ValueError(f"--profile {self.profile} is a file: give a directory for the trace")
        if self.tokenizer and not self.data:
            raise ValueError("--tokenizer needs --data (text files to tokenize)")
        if self.text_encoding and not self.tokenizer:
            raise ValueError("--text-encoding needs text --data and --tokenizer (it says how to read the text)")
        if self.text_encoding:
            from recipes.train.inputs.text import check_encoding
            check_encoding(self.text_encoding)

    def _check_eval(self) -> None:
        """--heldout and --eval-every go together: a held-out share nothing evaluates would only be lost to
        training, and an evaluation of an empty share would never happen."""
        if self.heldout is None:
            return
        if not self.data:
            raise ValueError(f"--heldout {self.heldout:g} is a share of --data, and there is no --data (the synthetic "
                             f"data has held-out sequences of its own): drop --heldout")
        if not self.eval_every and self.heldout > 0:
            raise ValueError(f"--heldout {self.heldout:g} keeps {100 * self.heldout:g}% of --data out of training, "
                             f"but nothing evaluates it without --eval-every: add --eval-every K (every K steps and "
                             f"at the end), or drop --heldout")
        if self.eval_every and self.heldout == 0:
            raise ValueError(f"--eval-every {self.eval_every} with --heldout 0 has no held-out data to evaluate: "
                             f"give --heldout a fraction above 0 (default 0.01), or drop --eval-every")

    @property
    def micro_batch(self) -> int:
        """Sequences per micro-batch: what a forward and backward pass holds activations for."""
        return self.batch // self.grad_accum

    @property
    def held_out(self) -> float:
        """The fraction of --data kept for evaluation (the synthetic source has held-out streams of its own)."""
        if self.heldout is not None:
            return self.heldout
        return 0.01 if self.eval_every and self.data else 0.0

    @property
    def total_schedule(self) -> int:
        return self.schedule_steps if self.schedule_steps is not None else self.steps

    @property
    def total_warmup(self) -> int:
        return self.warmup if self.warmup is not None else warmup(self.model, self.preset, self.total_schedule)

    @property
    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else for_preset(self.model, self.preset).lr

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed: everything that changes the numbers (not --steps, where to
        stop: a resumed run may go on past its schedule at the final learning rate)."""
        keys = ("model", "preset", "overrides", "batch", "seq", "lr", "clip", "weight_decay", "seed", "data",
                "data_dtype")
        ident = {k: getattr(self, k) for k in keys}
        ident.update(schedule_steps=self.total_schedule, warmup=self.total_warmup, lr=self.peak_lr)
        if self.opt_dtype != "float32":   # records written before --opt-dtype match the float32 default
            ident["opt_dtype"] = self.opt_dtype
        if self.grad_accum != 1:          # sums in another order: equal up to rounding, not bit for bit
            ident["grad_accum"] = self.grad_accum
        # not --opt-state: where the moments live changes no number, and a run may resume with them elsewhere
        if self.params != "device":       # a float32 master copy: other numbers, and more optimizer state
            ident["params"] = self.params
        if self.tokenizer:                # likewise: only where text data or a held-out split change the data
            ident["tokenizer"] = self.tokenizer
        if self.text_encoding:
            ident["text_encoding"] = self.text_encoding
        if self.held_out:
            ident["heldout"] = self.held_out
        return json.loads(json.dumps(ident))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Launch:
    """The training command's settings that are not the run's: they act before `recipes.train.loop.run` (the XLA flags
    before JAX starts, the peers' heartbeat around it)."""
    heartbeat_timeout: float = flag(60.0, "multi-host: a process not heard from for this long (killed, crashed) "
                                    "stops the others with a message (exit 1); restart all with --resume",
                                    metavar="SECONDS")
    xla_flags: str = flag(flags.DEFAULT, "XLA flag set for overlap, applied before JAX starts "
                          "(see recipes/train/settings/flags.py)",
                          choices=tuple(flags.FLAG_SETS))


def default(name: str) -> Any:
    """RunConfig's default for the field `name` (what both commands default to)."""
    return RunConfig.__dataclass_fields__[name].default


# Integer flags that reach JAX or NumPy as 32-bit values (step counters, shapes, PRNG seeds): their ranges, checked
# before anything is built (a larger value would overflow with a traceback from deep inside JAX).
INT_RANGES = {"steps": (1, INT32_MAX), "grad_accum": (1, INT32_MAX),
              "schedule_steps": (1, INT32_MAX), "warmup": (0, INT32_MAX),
              "batch": (1, INT32_MAX), "seq": (1, INT32_MAX - 1), "seed": (0, INT32_MAX), "log_every": (1, INT32_MAX),
              "ckpt_every": (0, INT32_MAX), "stop_after": (1, INT32_MAX), "poison_step": (1, INT32_MAX)}


def check_ranges(settings: RunConfig) -> None:
    """ValueError naming the flag for an integer out of its range (INT_RANGES: before the finer checks of
    __post_init__), a batch of more than 2**31 - 1 tokens, or a float that must be finite and positive."""
    for field, (low, high) in INT_RANGES.items():
        value = getattr(settings, field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"--{field.replace('_', '-')} must be an integer, got {value!r}")
        if not low <= value <= high:
            raise ValueError(f"--{field.replace('_', '-')} must be in [{low}, {high:,}], got {value:,}")
    if settings.batch * (settings.seq + 1) > INT32_MAX:
        raise ValueError(f"--batch {settings.batch} x --seq {settings.seq}: a step of more than 2**31 - 1 tokens "
                         f"cannot be indexed in int32")
    for flag_, value in (("peak-tflops", settings.peak_tflops),
                         ("coordinator-timeout", settings.coordinator_timeout)):
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"--{flag_} must be a finite number > 0, got {value}")
