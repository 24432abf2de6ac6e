"""The one thing every offload-first layer can do besides computing: say which tags it emits.

`layer.tag_shapes(batch, seq)` traces the layer abstractly (no FLOPs, no memory) on a [batch, seq, dim] input
and returns {tag: shape and dtype} in the order the tags are made. For a config, build the layer with
`nnx.eval_shape` first: nothing is allocated either way.
"""
from __future__ import annotations

import jax
from flax import nnx

from zoo.emitted import emitted_by


class TaggedLayer(nnx.Module):
    """Base of layers over [B, S, dim] activations; subclasses set `self.dim` and `self.dtype`.

    Emits:
        the tags of the subclass (`zoo.tags.NAMES` is the vocabulary); `tag_shapes` lists them.

    Examples:
        >>> from flax import nnx
        >>> from zoo.layers import MLP
        >>> {tag: s.shape for tag, s in MLP(dim=8, hidden=16, rngs=nnx.Rngs(0)).tag_shapes(batch=2, seq=4).items()}
        {'mlpwi_0': (2, 4, 16), 'mlpwi_1': (2, 4, 16), 'mlpwo': (2, 4, 8)}
    """

    def tag_shapes(self, batch: int, seq: int) -> dict[str, jax.ShapeDtypeStruct]:
        """The tags the layer emits on a [batch, seq, dim] input, read from an abstract trace (nothing computed).

        Args:
            batch: the batch size B.
            seq: the sequence length S.

        Returns:
            {tag: its shape and dtype}, in the order the tags are made.
        """
        return emitted_by(self, jax.ShapeDtypeStruct((batch, seq, self.dim), self.dtype))
