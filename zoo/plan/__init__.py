"""The memory planner: what a recipe keeps in HBM, puts in host memory and recomputes, before launch.

    p = zoo.plan.plan(cfg, recipe, batch=2, seq=8192)   # a zoo.Recipe, or "auto" with a budget, a link and a rate
    zoo.plan.render(p)                                # tables; p.to_dict() or zoo.plan.to_json(p) for JSON
    zoo.plan.largest_batch(cfg, recipe, seq=8192, hardware=zoo.plan.Hardware(hbm_gib=141))   # the largest batch

Its modules: docs/architecture.md. Calling the package is a TypeError naming `zoo.plan.plan` (docs/changes.md).
"""
from zoo import renames
from zoo.plan import measure
from zoo.plan.build import auto_recipe, model_state, plan
from zoo.plan.capacity import Capacity, largest_batch
from zoo.plan.fitting import Fitted, fit
from zoo.plan.inputs import Hardware, Parallelism, Training
from zoo.plan.longest import Longest, longest_seq
from zoo.plan.peak import allocator_limit
from zoo.plan.report import render, to_json
from zoo.plan.state import host_pool_bytes
from zoo.plan.types import POOL_ENV, ModelState, Plan, StackPlan, TagPlan, fmt_bytes

__all__ = ["POOL_ENV", "Capacity", "Fitted", "Hardware", "Longest", "ModelState", "Parallelism", "Plan", "StackPlan",
           "TagPlan", "Training", "allocator_limit", "auto_recipe", "fit", "fmt_bytes", "host_pool_bytes",
           "largest_batch", "longest_seq", "measure", "model_state", "plan", "render", "to_json"]

renames.called(__name__)   # `zoo.plan(...)` was the planner: a TypeError naming zoo.plan.plan (docs/changes.md)
