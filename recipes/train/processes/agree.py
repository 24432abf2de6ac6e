"""Several processes agree before they train: on the command, and on what process 0 decides for all of them.

- `same_command(flags)`: every process publishes its flags (JAX's coordination service, its key-value store) and
  reads everyone's. The flags that change the numbers or what runs (seed, steps, batch, seq, model, preset, recipe,
  --set, lr, the checkpoint directory, the data, the mesh, ...) must be equal on every process: otherwise each
  process stops with the same one-line ValueError (`Shared`) naming each differing flag and its value on each
  process. Before this check, processes started with different seeds trained silently on a mix of the two, and
  different --steps or --ckpt-dir hung in a collective. `LOCAL` lists the flags a process may set for itself.
- `decided_by_0(name, decide)`: process 0 runs `decide()` (taking the checkpoint directory's lock); a ValueError
  there is raised on every process, with the same message, and nothing else starts on any of them.

One process: both do nothing more than the single process would (`decide()` runs, no flags compared).
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import jax

from recipes.train.processes import mesh

PREFIX = "offload_zoo/agree/"


class Shared(ValueError):
    """An error every process raises alike (a disagreement, process 0's refusal): they may all end as a finished
    run does, through JAX's shutdown at exit, which meets them all (and so ends process 0's coordination service
    at once)."""


# What a process may set for itself: where it writes (process 0 alone writes --metrics and --tensorboard), what it
# prints, how long it waits, and warnings. Everything else must match.
LOCAL = frozenset({"metrics", "tensorboard", "log_every", "coordinator_timeout", "heartbeat_timeout", "distributed",
                   "max_drop_warn", "force"})
PATHS = frozenset({"ckpt_dir", "data", "tokenizer"})   # compared as absolute paths: "ckpt" in two working dirs differ


def _client():
    return mesh._coordination_client() if jax.process_count() > 1 else None


def _timeout_ms(seconds: float) -> int:
    return int(max(1.0, seconds) * 1000)


def fingerprint(flags: dict[str, Any]) -> dict[str, str]:
    """The flags a process must share with the others, each as JSON text (paths made absolute)."""
    out = {}
    for key, value in sorted(flags.items()):
        if key in LOCAL:
            continue
        if key in PATHS and isinstance(value, str):
            value = os.path.abspath(value)
        out[key] = json.dumps(value, default=str)
    return out


def differences(prints: list[dict[str, str]]) -> str | None:
    """The flags on which the processes' fingerprints differ, with each process's value; None if they agree."""
    keys = sorted({k for p in prints for k in p if len({q.get(k) for q in prints}) > 1})
    if not keys:
        return None
    def shown(p: dict, k: str) -> str:
        return p[k] if k in p else "(not given)"
    return "; ".join(f"--{k.replace('_', '-')}: " + ", ".join(f"process {i} {shown(p, k)}"
                                                              for i, p in enumerate(prints)) for k in keys)


def same_command(flags: dict[str, Any], timeout: float, *, client=None, process: int | None = None,
                 count: int | None = None) -> None:
    """ValueError on every process unless every process was given the same flags (but `LOCAL`)."""
    client = client if client is not None else _client()
    me = jax.process_index() if process is None else process
    n = jax.process_count() if count is None else count
    if client is None or n == 1:
        return
    mine = fingerprint(flags)
    client.key_value_set(f"{PREFIX}flags/{me}", json.dumps(mine), allow_overwrite=True)
    prints = [mine if p == me else json.loads(client.blocking_key_value_get(f"{PREFIX}flags/{p}", _timeout_ms(timeout)))
              for p in range(n)]
    client.wait_at_barrier(f"{PREFIX}flags", _timeout_ms(timeout))   # every process has read them all
    diff = differences(prints)
    if diff:
        raise Shared(f"the {n} processes were not started with the same command ({diff}): every process must "
                         f"run the same command (only {', '.join('--' + k.replace('_', '-') for k in sorted(LOCAL))} "
                         f"may differ)")


def decided_by_0(name: str, decide: Callable[[], Any], timeout: float = 300.0, *, client=None,
                 process: int | None = None, count: int | None = None) -> Any:
    """`decide()` on process 0 (its result returned there, None elsewhere); its ValueError raised on every
    process."""
    client = client if client is not None else _client()
    me = jax.process_index() if process is None else process
    n = jax.process_count() if count is None else count
    if client is None or n == 1:
        return decide()
    key = f"{PREFIX}decided/{name}"
    if me == 0:
        try:
            result = decide()
        except ValueError as e:
            client.key_value_set(key, "error:" + str(e), allow_overwrite=True)
            raise Shared(str(e)) from None
        client.key_value_set(key, "ok", allow_overwrite=True)
        return result
    try:
        said = client.blocking_key_value_get(key, _timeout_ms(timeout))
    except Exception as e:   # JAX's runtime error: a deadline, or the service gone
        raise ValueError(f"process 0 did not share its decision on {name} within {timeout:g} s "
                         f"({mesh.first_line(e)}): see its log") from None
    if said.startswith("error:"):
        raise Shared(said[len("error:"):])
    return None
