"""``lightning_ipc`` on vLLM's own engine on one GPU: each tensor's CUDA IPC handle goes once while the
trainer's storage stays put, the workers replay their recorded copies, and what lands is what was sent,
also when a storage moves or every tensor is computed anew for each push."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch
from gpu_helpers import (
    FIGURES,
    digests_equal,
    engine_core_pid,
    engine_digest,
    model_digest,
    trainer_engine,
    worker_state,
)
from helpers import half_way, raises, tiny_qwen2

from lightning_vllm import VLLMUpdater
from lightning_vllm._waits import call_with_timeout
from lightning_vllm.errors import WeightSyncTimeoutError

pytestmark = pytest.mark.gpu


def kept_replay_slots(llm: Any) -> int:
    """How many slots the worker's kept replay names (0: none kept)."""

    def read(worker: Any) -> int:  # runs in vLLM's worker
        kept = worker.weight_transfer_engine._replay
        return 0 if kept is None else len(kept[0])

    (found,) = llm.collective_rpc(read)
    return int(found)


def test_handles_go_once_while_storages_stay_put_and_again_when_one_moves(lightning_ipc_llm):
    model = tiny_qwen2(seed=61).cuda()
    updater = VLLMUpdater(engine=lightning_ipc_llm, timeout_seconds=120, changed_only=False)
    updater.push_weights(model)
    engine = trainer_engine(updater)
    assert engine.updates_in_one_call  # an in-process vllm.LLM takes start, update and finish as one RPC
    num_tensors = engine.handles_sent
    assert num_tensors == len(list(model.parameters()))
    slots, replayed = worker_state(lightning_ipc_llm)
    assert slots == num_tensors
    for step in range(3):  # an optimizer step writes in place: no handle, the copies replayed
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.001 * (step + 1))
        updater.push_weights(model)
        assert digests_equal(engine_digest(lightning_ipc_llm), model_digest(model)), step
        assert engine.handles_sent == num_tensors
    assert worker_state(lightning_ipc_llm) == (num_tensors, replayed + 3)
    assert kept_replay_slots(lightning_ipc_llm) == num_tensors  # the same slots: the last push's copies, run again
    up_proj = model.model.layers[0].mlp.up_proj.weight
    up_proj.data = up_proj.data.clone() + 0.5  # a storage that moved: one new handle, the old slot released
    updater.push_weights(model)
    assert digests_equal(engine_digest(lightning_ipc_llm), model_digest(model))
    assert engine.handles_sent == num_tensors + 1
    assert worker_state(lightning_ipc_llm)[0] == num_tensors
    updater.close()


def test_tensors_computed_for_each_push_get_new_handles_and_the_old_slots_are_released(lightning_ipc_llm):
    model = tiny_qwen2(seed=62).cuda()
    updater = VLLMUpdater(engine=lightning_ipc_llm, timeout_seconds=120, changed_only=False)
    for push in range(3):
        with torch.no_grad():
            model.model.norm.weight.add_(0.01)
        updater.push_weights({name: tensor.clone() for name, tensor in model.state_dict().items()})
        assert digests_equal(engine_digest(lightning_ipc_llm), model_digest(model)), push
        num_tensors = len(model.state_dict())
        assert trainer_engine(updater).handles_sent == num_tensors * (push + 1)
        assert worker_state(lightning_ipc_llm)[0] == num_tensors  # the last push's, the earlier ones released
    updater.close()
    updater = VLLMUpdater(engine=lightning_ipc_llm, timeout_seconds=120)
    updater.push_weights(tiny_qwen2(seed=0).cuda())  # the shared engine serves what it started from again
    updater.close()


def test_a_push_that_fails_on_either_side_of_the_one_call_leaves_the_engine_serving_and_the_next_push_lands(
    lightning_ipc_llm,
):
    model = tiny_qwen2(seed=63).cuda()
    updater = VLLMUpdater(engine=lightning_ipc_llm, timeout_seconds=120, changed_only=False)
    updater.push_weights(model)
    before = engine_digest(lightning_ipc_llm)
    # The trainer's side: its source fails half way through, before the call.
    with pytest.raises(RuntimeError, match="could not be read"):
        updater.push_weights(half_way(model, raises(RuntimeError("the policy could not be read"))))
    assert digests_equal(engine_digest(lightning_ipc_llm), before)

    # The worker's side: it lost its slots (as after a restart), so the slot-only update it is sent fails inside
    # the one call; vLLM's worker ends that update, and the next push joins again and sends every handle.
    def forget(worker: Any) -> None:  # runs in vLLM's worker
        worker.weight_transfer_engine._forget_slots()

    updater.push_weights(model)
    lightning_ipc_llm.collective_rpc(forget)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01)
    with pytest.raises(Exception, match="has not opened"):
        updater.push_weights(model)
    updater.push_weights(model)
    assert digests_equal(engine_digest(lightning_ipc_llm), model_digest(model))
    assert lightning_ipc_llm.get_weight_version() == str(updater.weight_version)
    updater.close()
    updater = VLLMUpdater(engine=lightning_ipc_llm, timeout_seconds=120)
    updater.push_weights(tiny_qwen2(seed=0).cuda())  # the shared engine serves what it started from again
    updater.close()


def test_a_push_the_trainer_gave_up_on_never_lands_once_the_frozen_engine_core_is_continued(lightning_ipc_llm):
    """The engine core SIGSTOPped while the trainer reads the push's tensors, continued 5 s after the trainer's
    timeout: the update it had queued reaches the worker late and is refused (issue 46). Before, the engine ran
    it and reported the version the trainer had called not committed."""
    timeout = 15.0
    model = tiny_qwen2(seed=64).cuda()
    updater = VLLMUpdater(engine=lightning_ipc_llm, timeout_seconds=timeout, changed_only=False)
    updater.push_weights(model)
    version, before = lightning_ipc_llm.get_weight_version(), engine_digest(lightning_ipc_llm)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.5)
    pid = engine_core_pid(lightning_ipc_llm)
    started = time.monotonic()
    try:
        with pytest.raises(WeightSyncTimeoutError) as raised:
            updater.push_weights(half_way(model, lambda: os.kill(pid, signal.SIGSTOP)))
        seconds = time.monotonic() - started
        time.sleep(5.0)  # frozen past the trainer's deadline
    finally:
        os.kill(pid, signal.SIGCONT)
    served = call_with_timeout(engine_digest, lightning_ipc_llm, timeout=60, what="the continued engine's weights")
    served_version = lightning_ipc_llm.get_weight_version()
    FIGURES["lightning_ipc_engine_frozen"] = {
        "error": f"{type(raised.value).__name__}: {raised.value}"[:300],
        "seconds": seconds,
        "serves_the_last_committed": digests_equal(served, before),
        "serves_the_given_up_push": digests_equal(served, model_digest(model)),
        "version_before": version,
        "version_after": served_version,
    }
    print(f"lightning_ipc, engine frozen: {FIGURES['lightning_ipc_engine_frozen']}")
    assert timeout <= seconds < timeout + 5
    assert f"after {timeout:g} s" in str(raised.value)  # the seconds it waited
    assert digests_equal(served, before) and served_version == version  # the last committed weights, their version

    updater.push_weights(model)  # the same engine, no restart
    assert digests_equal(engine_digest(lightning_ipc_llm), model_digest(model))
    assert lightning_ipc_llm.get_weight_version() == str(updater.weight_version)
    updater.close()
