"""The weights of a model partitioned by DeepSpeed ZeRO-3, one layer group at a time.

Each rank keeps a partition of every parameter; the parameter itself is an empty
placeholder whose full shape is ``param.ds_shape``. Names and shapes are read from
the placeholders (no gather); a layer group is gathered with
``deepspeed.zero.GatheredParameters(group, modifier_rank=None)`` only while its
tensors are read: a collective, so every rank must walk the groups in the same
order (``fronts/lightning/roles.LockstepWeights``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, layerwise_groups

from lightning_vllm.weights.base import Weights
from lightning_vllm.weights.model import canonical_name


class ZeRO3Weights(Weights):
    """The parameters of a ZeRO-3 model (a Hugging Face model, or DeepSpeed's engine around one)
    under their checkpoint names, gathered one layer group at a time.

    Args:
        module: the model whose parameters ZeRO-3 partitioned.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._params = {canonical_name(name): param for name, param in module.named_parameters()}

    def declare(self) -> list[ParamMeta]:
        return [ParamMeta(name, param.dtype, tuple(_full_shape(param))) for name, param in self._params.items()]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        import deepspeed

        for group in layerwise_groups(list(self._params)):
            params = [self._params[name] for name in group]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                for name, param in zip(group, params):
                    # The gathered data lives only inside the context; the transfer may read it later.
                    yield name, param.data.detach().clone()


def _full_shape(param: torch.Tensor) -> torch.Size:
    return getattr(param, "ds_shape", param.shape)
