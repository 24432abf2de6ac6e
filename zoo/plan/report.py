"""The plan as tables (rich) and as JSON."""
from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table
from rich.text import Text

from zoo.plan.types import CARRY, Plan, fmt_bytes, fmt_flops

_SHORT = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}
# The width of output that is not a terminal (a log file, a pipe): wide enough that rich neither squeezes a table
# (cutting its cells to `…`) nor wraps a line, so tables print at their natural width and each line whole.
UNWRAPPED = 100_000


def new_console(**kwargs) -> Console:
    """A rich Console for tables: on a terminal, the terminal's width; otherwise (stdout redirected to a file or a
    pipe, whatever COLUMNS says) `UNWRAPPED` columns."""
    return Console(highlight=False, width=None if sys.stdout.isatty() else UNWRAPPED, **kwargs)


def render(p: Plan, console=None) -> None:
    """Print a plan as the command line shows it: a table per stack (one row per tag: its shape, bytes per layer and
    placement), a table of the stacks, the per-device totals (activations, host memory, recompute, the model state,
    the peak and the predicted step time), then, for recipe "auto", the reason for each placement, and the warnings.

    Args:
        p: the `zoo.plan.Plan`.
        console: the `rich.console.Console` to print on (None: `new_console()`: tables at their natural width
            where standard output is not a terminal, one line per warning).

    Examples:
        >>> import zoo
        >>> from zoo.models import LlamaConfig
        >>> recipe = zoo.Recipe("mlp_host", offload=("mlpwi_0", "mlpwi_1"))
        >>> p = zoo.plan.plan(LlamaConfig.preset("tiny"), recipe, batch=1, seq=8, peak=None)
        >>> from rich.console import Console
        >>> zoo.plan.render(p, Console(color_system=None, width=100))   # no styles: plain text
        LlamaConfig: recipe 'mlp_host', batch 1, seq 8
        ...
    """
    console = console or new_console()
    shard = f", split over {p.shard} devices (per-device figures)" if p.shard > 1 else ""
    if p.mesh:
        shard = f", mesh {p.mesh} ({p.shard} devices; per-device figures by the sharding rules)"
    accum = f" ({p.grad_accum} micro-batches of {p.batch // p.grad_accum})" if p.grad_accum > 1 else ""
    console.print(f"[bold]{p.model}[/]: recipe {p.recipe.name!r}, batch {p.batch}{accum}, seq {p.seq}{shard}")
    for s in p.stacks:
        console.print(_stack_table(s))
    console.print(_per_stack_table(p))
    console.print(_totals_table(p))
    if p.recipe.name == "auto":
        if p.link_source:
            console.print(f"link: {p.link_gbps:g} GB/s per direction, overlap {p.overlap} ({p.link_source})")
        console.print(f"[bold]chosen:[/] {p.recipe}")
        for tag, note in dict.fromkeys((tp.tag, tp.note) for s in p.stacks for tp in s.tags if tp.note):
            console.print(f"  [bold]{tag}[/]: {note}")
    for w in p.warnings:   # soft_wrap: one line each, however long (a log keeps it whole)
        console.print(Text.assemble(("warning:", "bold yellow"), f" {w}"), soft_wrap=True)


_COLOUR = {"device": "green", "offload": "cyan", "remat": "magenta"}


def _stack_table(s):
    """One row per tag of the stack `s` (a StackPlan): shape, bytes per layer, placement; then what has no tag."""
    t = Table(title=f"stack {s.name!r}: {s.num_layers} layers", title_justify="left")
    split = any(tp.device_shape is not None for tp in s.tags)
    for col in ("tag", "shape per device" if split else "shape", "per layer", "placement", "note"):
        t.add_column(col, justify="right" if col == "per layer" else "left", no_wrap=col != "note")
    for tp in s.tags:
        place = tp.placement if tp.residual else "-"
        note = "not a residual" if not tp.residual else "scan carry" if tp.tag == CARRY else ""
        shape = tp.shape if tp.device_shape is None else tp.device_shape
        t.add_row(tp.tag, "x".join(map(str, shape)) + " " + _SHORT.get(tp.dtype, tp.dtype),
                  fmt_bytes(tp.nbytes) if tp.residual else "0", f"[{_COLOUR.get(place, 'white')}]{place}[/]", note)
    if s.untagged_bytes:
        t.add_row("(untagged)", "", fmt_bytes(s.untagged_bytes), "[green]device[/]", "saved by JAX, no tag")
    if s.invariant_bytes:
        t.add_row("(invariant)", "", fmt_bytes(s.invariant_bytes), "[green]device[/]", "once per stack")
    return t


def _per_stack_table(p: Plan):
    """Each stack's HBM, host memory and recompute, per layer and in all."""
    st = Table(title="per stack", title_justify="left")
    for col in ("stack", "layers", "HBM/layer", "host/layer", "HBM", "host", "recompute/step"):
        st.add_column(col, justify="left" if col == "stack" else "right")
    for s in p.stacks:
        st.add_row(s.name, str(s.num_layers), fmt_bytes(s.device_bytes_per_layer), fmt_bytes(s.host_bytes_per_layer),
                   fmt_bytes(s.device_bytes), fmt_bytes(s.host_bytes), fmt_flops(s.num_layers * s.remat_flops))
    return st


def _totals_table(p: Plan):
    """Per device: activations, host memory, recompute, the model state, HBM and its peak, the predicted step."""
    tt = Table(title="per device (HBM before XLA's temporaries)", title_justify="left", show_header=False)
    tt.add_column("what")
    tt.add_column("value", justify="right")
    for r in _state_rows(p) + _peak_rows(p):
        tt.add_row(*r)
    return tt


def _state_rows(p: Plan) -> list[tuple[str, str]]:
    """(what, value) of the saved activations, host memory, recompute and the model state."""
    ms = p.state
    hosted = [f"{what} {fmt_bytes(n)}" for what, n, there in (("optimizer state", ms.optimizer, ms.optimizer_host),
                                                               ("float32 master", ms.master, ms.master_host),
                                                               ("streamed parameters and gradients",
                                                                2 * ms.streamed, ms.streamed > 0)) if there]
    rows = [("saved activations in HBM", fmt_bytes(p.activation_bytes)),
            ("host memory (pinned)", f"{fmt_bytes(p.host_total)} of a {fmt_bytes(p.host_pool)} pool"
             + (f" (activations {fmt_bytes(p.host_bytes)}, {', '.join(hosted)})" if ms.host else "")),
            ("recomputed per step", f"{fmt_flops(p.remat_flops)} (forward {fmt_flops(p.forward_flops)})"),
            (f"parameters ({ms.num_params:,})", fmt_bytes(ms.params)),
            ("gradients", fmt_bytes(ms.grads))]
    if ms.accum:
        rows.append((f"gradient sums (float32, over {p.grad_accum} micro-batches)", fmt_bytes(ms.accum)))
    rows.append((f"optimizer state ({ms.optimizer_name})" + (", in pinned host memory between steps: not HBM"
                                                              if ms.optimizer_host else ""), fmt_bytes(ms.optimizer)))
    if ms.master:
        rows.append(("float32 master copy" + (", in pinned host memory between steps: not HBM" if ms.master_host
                                               else ""), fmt_bytes(ms.master)))
    if ms.streamed:
        rows.append(("of which the stacks' parameters and gradients, in pinned host memory (streamed a layer at a "
                     "time): not HBM", fmt_bytes(2 * ms.streamed)))
        rows.append(("HBM for the layers in flight (their parameters and gradients)", fmt_bytes(ms.streamed_window)))
    if ms.other:
        rows.append(("other variables", fmt_bytes(ms.other)))
    return rows


def _peak_rows(p: Plan) -> list[tuple[str, str]]:
    """(what, value) of the HBM total against the budget, the step's peak, and the predicted step time."""
    rows = [("HBM: activations + model state", fmt_bytes(p.hbm_bytes)
             + (f" of {fmt_bytes(p.hbm_budget)}" if p.hbm_budget is not None else ""))]
    if p.peak is not None:
        rows.append((f"peak HBM of the step, {p.peak.source}", fmt_bytes(p.peak.bytes)
                     + (f" of {fmt_bytes(p.hbm_budget)}" if p.hbm_budget is not None else "")))
        if not p.peak.compiled and "loss_f32_logits_and_grads" in p.peak.detail:
            chunk = p.peak.detail.get("loss_chunk")
            loss = p.peak.detail["loss_f32_logits_and_grads"]
            rows.append(("of which the loss's float32 logits and gradient ("
                         + (f"chunks of {chunk} positions)" if chunk else
                            "the whole sequence at once: unchunked)"), fmt_bytes(loss)))
            rows.append(("of which one group's backward pass beyond the saved tensors",
                         fmt_bytes(p.peak.detail["one_group_backward"])))
        if p.peak.compiled and p.peak.detail.get("host_temp"):
            rows.append(("host memory, compiled (XLA's host temporaries)", fmt_bytes(p.peak.detail["host_temp"])))
        if p.peak.compiled and p.peak.detail.get("host_argument"):
            rows.append(("host memory, compiled (state in pinned host memory)",
                         fmt_bytes(p.peak.detail["host_argument"])))
    est = p.step_time()
    if est is not None:
        link = "" if p.link_gbps is None else f", {p.link_gbps:g} GB/s, overlap {p.overlap}"
        att = ("" if p.attention_tflops is None else
               f", attention ({p.attention_kernel}) at {p.attention_tflops:g} TFLOP/s")
        rows.append((f"predicted step time at {est['rate_tflops']:g} TFLOP/s executed{att}{link}",
                     f"{est['total_s'] * 1e3:,.1f} ms (compute {est['compute_s'] * 1e3:,.1f}, recompute "
                     f"{est['remat_s'] * 1e3:,.1f}, exposed copies {est['exposed_transfer_s'] * 1e3:,.1f})"))
    return rows


def to_json(p: Plan) -> dict:
    """A plan as JSON-ready values, as the command line prints them with `--json`: `p.to_dict()`, and, when the recipe
    was chosen ("auto"), the reason for each placement under "reasons".

    Args:
        p: the `zoo.plan.Plan`.

    Returns:
        a dict of plain values (`json.dumps` takes it).

    Examples:
        >>> import zoo
        >>> from zoo.models import LlamaConfig
        >>> recipe = zoo.Recipe("mlp_host", offload=("mlpwi_0", "mlpwi_1"))
        >>> p = zoo.plan.plan(LlamaConfig.preset("tiny"), recipe, batch=1, seq=8, peak=None)
        >>> out = zoo.plan.to_json(p)
        >>> out["recipe"], out["offload"], out["totals"]["host_bytes"]
        ('mlp_host', ['mlpwi_0', 'mlpwi_1'], 16384)
    """
    out = p.to_dict()
    if p.recipe.name == "auto":
        out["reasons"] = {t.tag: t.note for s in p.stacks for t in s.tags if t.note}
    return out
