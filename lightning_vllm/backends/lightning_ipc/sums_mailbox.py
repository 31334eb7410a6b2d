"""``lightning_ipc``'s answer to the check after every push, posted to a mailbox in the trainer's memory: no reply
through vLLM.

The check holds what the engine's worker holds, per layer, against what the trainer sent (``core/landing_check.py``).
Asked through vLLM's ``collective_rpc``, the worker's answer took 2.3 ms after its sums were ready to reach the trainer
of an 8B push on an H100 (docs/runs.md, run 61): longer than its sums. With ``lightning_ipc`` the worker shares the
trainer's GPU and already records the trainer's event after each push's copies (``worker.py``). So the trainer lends
it one small tensor, a mailbox (:class:`SumsMailbox`, its CUDA IPC handle sent once per connection); the worker
queues its layers' fingerprints into it (``held_sums.LayerRows``: ``[layer_key, bits, squares]`` rows), then a header
naming the push, then records the event (:func:`post_sums`). Once the event has fired the rows are there, and the
trainer reads them in one copy.

The header's push number tells the trainer whether the rows are this push's: a worker that could not post them (no
summed replay yet, a report that holds more than sums of whole layers, a tensor too small) leaves the last push's
header, and the trainer's check asks through vLLM as before.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from lightning_vllm.weights.held_sums import LayerRows
from lightning_vllm.weights.layer_sums import layer_key, layer_of

_MARK = 0x6C76_6C6C_6D5F_7375  # the header's first value: rows left by this module ("lvllm_su")
_SPARE_ROWS = 64  # rows beyond the trainer's tensors: layers a worker holds that were never sent


class SumsMailbox:
    """The trainer's half: the tensor on its GPU the worker posts its sums to, and their reading.

    Args:
        device: the trainer's GPU, the worker's (``lightning_ipc`` shares one GPU).
        tensors: how many tensors a push sends at most: a worker's layers are fewer (each holds one or more).
    """

    def __init__(self, device: torch.device, tensors: int) -> None:
        self.tensor = torch.zeros(tensors + _SPARE_ROWS + 1, 3, dtype=torch.int64, device=device)
        self.handle: tuple[Any, ...] | None = reduce_tensor(self.tensor)[1]  # sent once, then None
        self.answered = False  # the worker posted its sums at the last push that asked
        self._push = 0
        self._asked = False  # the last push asked for its sums (next_push), not read yet
        self._layers: dict[int, str] = {}  # layer_key -> layer, of every tensor named so far
        self._named: list[str] | None = None

    def name(self, names: list[str]) -> None:
        """Learn the layers of ``names`` (the tensors of a push: the same list object is not read twice)."""
        if names is not self._named:
            self._named = names
            self._layers.update((layer_key(layer), layer) for layer in map(layer_of, names))

    def next_push(self) -> int:
        """The number the worker is to write in the header of the next push's sums."""
        self._push += 1
        self._asked = True
        return self._push

    def read(self) -> list[dict[str, Any]] | None:
        """The worker's report (``held_sums.held_layer_sums``'s form, one worker), if it posted this push's sums; call
        once its copies are done (the trainer's event fired). ``None``: it did not, or the push did not ask for them
        (:meth:`next_push`): ask it through vLLM."""
        if not self._asked:
            return None
        self._asked = False
        rows = self.tensor.tolist()
        mark, push, count = rows[0]
        self.answered = mark == _MARK and push == self._push and 0 <= count < len(rows)
        return [LayerRows.report(rows[1 : count + 1], self._layers)] if self.answered else None


def post_sums(into: torch.Tensor, push: int, rows: torch.Tensor | None) -> bool:
    """The worker's half: queue ``rows`` (``held_sums.LayerRows.rows``), then a header naming ``push``, into
    ``into`` on the current stream; nothing syncs. ``False``, and nothing written, where there are no rows or they do
    not fit."""
    if rows is None or rows.shape[0] + 1 > into.shape[0]:
        return False
    into[1 : rows.shape[0] + 1].copy_(rows)
    for position, value in enumerate((_MARK, push, rows.shape[0])):  # (fills: a copy from the host would sync)
        into[0, position].fill_(value)
    return True
