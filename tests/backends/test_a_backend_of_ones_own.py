"""A new backend is one module plus one registry line: ``loopback_backend.py``, registered here, drives
the same connection, checks, commits and versions as the package's own (against the fake engine)."""

from __future__ import annotations

import pytest
from helpers import FakeEngine, lora_policy, tiny_qwen2
from loopback_backend import MAILBOXES

from lightning_vllm import EngineConfigError, VLLMUpdater
from lightning_vllm.backends.registry import register_backend

register_backend("loopback", "loopback_backend", "LoopbackBackend")  # the one registry line


class LoopbackEngine(FakeEngine):
    """The fake engine, built with ``weight_transfer_config={"backend": "loopback"}``: it takes what lands
    in its group's mailbox, and records whether generation was paused while it received."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.group = None
        self.paused = False
        self.received_while_paused: list[bool] = []

    def transfer_backend(self) -> str:
        return "loopback"

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.group = init_info["group"]

    def update_weights(self, update_info: dict) -> None:
        self._pending = {name: MAILBOXES[self.group][name] for name in update_info["names"]}
        self.received_while_paused.append(self.paused)

    def pause_generation(self, mode: str) -> None:
        self.paused = True

    def resume_generation(self) -> None:
        self.paused = False


def test_a_backend_defined_outside_the_package_pushes_and_commits():
    model = tiny_qwen2(seed=3)
    engine = LoopbackEngine(model)
    updater = VLLMUpdater(engine=engine, backend="loopback")
    stats = updater.push_weights(model)
    assert engine.holds(model) and engine.version == "1" == str(stats.weight_version)
    assert engine.received_while_paused == [True]  # it loads while receiving: paused around the transfer
    assert not engine.paused
    updater.close()
    assert engine.group not in MAILBOXES


def test_its_traits_decide_what_it_is_refused():
    engine = LoopbackEngine(tiny_qwen2(seed=3))
    with pytest.raises(EngineConfigError, match="adapter pushes need the gloo backend.*uses 'loopback'"):
        VLLMUpdater(engine=engine, lora="adapter").push_weights(lora_policy())
    assert engine.version == "default"
