"""A zoo layer's weights in the same layer of transformers, and torch autograd's gradients back in the zoo's layout.

Tensors move through the zoo's own Hugging Face key tables (`zoo.hf.keymap` and the families' `hf.py`: rows of
(zoo path below the decoder layer, HF key below `model.layers.{i}.`, n_in)), with the decoder layer's prefix
removed (`unit_rows`): the same map the checkpoints use, not a second copy. One difference is transformers' own:
since transformers 5 a MoE layer holds its experts fused in memory (`experts.gate_up_proj` [E, 2F, D],
`experts.down_proj` [E, D, F]) while checkpoints keep one tensor per expert and projection; `load` and `grads`
fuse and split those.

Imported only by tests that have already skipped without torch and transformers.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from zoo.hf.keymap import Entry

torch.set_num_threads(1)  # two pytest workers on two cores
_EXPERT = re.compile(r"^(?P<pre>.*)experts\.\{e\}\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def unit_rows(rows, zoo_prefix: str = "", hf_prefix: str = "") -> list[tuple[str, str, int | None]]:
    """Rows of a decoder-layer key table for the sub-layer under `zoo_prefix` / `hf_prefix` (e.g. "attn." and
    "self_attn."), with those prefixes removed; rows of other sub-layers are left out."""
    return [(z[len(zoo_prefix):], h[len(hf_prefix):], n) for z, h, n in rows
            if z.startswith(zoo_prefix) and h.startswith(hf_prefix)]


def _get(tree, dotted: str):
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def _entry(row) -> Entry:
    zoo, hf, n_in = row
    return Entry(tuple(zoo.split(".")), hf, n_in)


def hf_tensors(module: nnx.Module, rows) -> dict[str, np.ndarray]:
    """{HF key: tensor in the checkpoint's layout} for every row's parameter of `module` (per expert where the HF
    key holds "{e}")."""
    state = nnx.to_pure_dict(nnx.state(module))
    out = {}
    for row in rows:
        array, entry = np.asarray(_get(state, row[0]), np.float32), _entry(row)
        if "{e}" in row[1]:
            for e in range(array.shape[0]):
                out[row[1].format(e=e)] = entry.to_hf(array[e])
        else:
            out[row[1]] = entry.to_hf(array)
    return out


def _fused_experts(tensors: dict[str, np.ndarray], names) -> dict[str, np.ndarray]:
    """Per-expert checkpoint tensors -> transformers' fused in-memory experts, where the torch module has them."""
    out, per = {}, {}
    for key, t in tensors.items():
        m = _EXPERT.match(re.sub(r"experts\.\d+\.", "experts.{e}.", key))
        fused = m and f"{m['pre']}experts.gate_up_proj" in names
        if not fused:
            out[key] = t
            continue
        e = int(re.search(r"experts\.(\d+)\.", key).group(1))
        per.setdefault((m["pre"], m["proj"]), {})[e] = t
    for (pre, proj), by_e in per.items():
        per[(pre, proj)] = np.stack([by_e[e] for e in range(len(by_e))])
    for pre in {p for p, _ in per}:
        out[f"{pre}experts.gate_up_proj"] = np.concatenate([per[(pre, "gate_proj")], per[(pre, "up_proj")]], axis=1)
        out[f"{pre}experts.down_proj"] = per[(pre, "down_proj")]
    return out


def load(torch_module: torch.nn.Module, module: nnx.Module, rows) -> None:
    """Copy `module`'s parameters into `torch_module` through the key table `rows`; every parameter and
    buffer of the torch module that the table names is set, and every torch parameter must be named."""
    named = dict(torch_module.named_parameters()) | dict(torch_module.named_buffers())
    tensors = _fused_experts(hf_tensors(module, rows), named)
    missing = sorted(set(dict(torch_module.named_parameters())) - set(tensors))
    unknown = sorted(set(tensors) - set(named))
    assert not missing and not unknown, f"key table and torch module differ: missing {missing}, unknown {unknown}"
    with torch.no_grad():
        for key, t in tensors.items():
            assert tuple(named[key].shape) == t.shape, (key, tuple(named[key].shape), t.shape)
            named[key].copy_(torch.from_numpy(np.array(t, np.float32)))


def grads(torch_module: torch.nn.Module, module: nnx.Module, rows) -> dict[str, np.ndarray]:
    """{zoo path: torch's gradient of that parameter, in the zoo's layout} after a backward pass, for the rows
    that name a torch parameter (buffers, such as the routing bias, have none)."""
    params = dict(torch_module.named_parameters())
    state = nnx.to_pure_dict(nnx.state(module))
    out = {}
    for row in rows:
        zoo, hf, _ = row
        shape, entry = np.shape(_get(state, zoo)), _entry(row)
        if "{e}" not in hf:
            if hf in params:
                out[zoo] = entry.to_zoo(params[hf].grad.numpy(), shape)
            continue
        if hf.format(e=0) in params:
            slices = [params[hf.format(e=e)].grad.numpy() for e in range(shape[0])]
        else:   # fused in memory
            m = _EXPERT.match(hf)
            if m["proj"] == "down_proj":
                fused = params[f"{m['pre']}experts.down_proj"].grad.numpy()
            else:
                gate_up = params[f"{m['pre']}experts.gate_up_proj"].grad.numpy()
                half = gate_up.shape[1] // 2
                fused = gate_up[:, :half] if m["proj"] == "gate_proj" else gate_up[:, half:]
            slices = list(fused)
        out[zoo] = np.stack([entry.to_zoo(s, shape[1:]) for s in slices])
    return out


def torch_vjp(forward, x: np.ndarray, ct: np.ndarray):
    """(forward(x), the gradient of <forward(x), ct> w.r.t. x) in torch float32; parameters' .grad are set too."""
    xt = torch.tensor(x, dtype=torch.float32, requires_grad=True)
    out = forward(xt)
    (out * torch.from_numpy(ct)).sum().backward()
    return out.detach().numpy(), xt.grad.numpy()


def jax_vjp(module: nnx.Module, x: np.ndarray, ct: np.ndarray, forward=lambda m, x: m(x)):
    """(forward(module, x), d<out, ct>/dx, {zoo path: d<out, ct>/dparam}) in JAX, for the module's `nnx.Param`s."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def loss(p, x):
        out = forward(nnx.merge(graphdef, p, rest, copy=True), x)
        return jnp.sum(out * ct), out

    (_, out), (g_params, g_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, jnp.asarray(x))
    flat = {}

    def walk(tree, prefix):
        for k, v in tree.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[f"{prefix}{k}"] = np.asarray(v)
    walk(nnx.to_pure_dict(g_params), "")
    return np.asarray(out), np.asarray(g_x), flat


def causal_mask(seq: int) -> torch.Tensor:
    """The additive causal mask [1, 1, S, S] that transformers' eager attention takes."""
    return torch.full((seq, seq), float("-inf")).triu(1)[None, None]
