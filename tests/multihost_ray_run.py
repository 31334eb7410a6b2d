"""The trainer of tests/engines/test_multihost_ray.py: a Ray driver on the head host whose vLLM
engine is an actor that Ray places on the inference host.

``python multihost_ray_run.py RAY_ADDRESS MODEL_DIR MASTER_ADDRESS SYNC_PORT OUT_JSON``:

1. a run with ``on_sync_error="warn"``: rollouts through the actor in every step; in step 2
   the actor is killed, that push point fails with a warning, and the user's callback below
   starts a replacement actor and hands it to the sync; the next push point reaches it;
2. a run with the default ``on_sync_error="raise"`` whose actor is killed: the fit ends with
   the sync's error.

What it saw goes to OUT_JSON, with the sockets this driver listens on.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import ray  # noqa: E402
import torch  # noqa: E402
from helpers import (  # noqa: E402
    TinyCausalLM,
    cpu_trainer,
    engine_kwargs,
    engine_prompt_logprobs,
    hf_prompt_logprobs,
    max_abs_diff,
    tiny_qwen2,
    token_batches,
)
from hosts import listened_on_by  # noqa: E402
from lightning.pytorch import Callback  # noqa: E402

from lightning_vllm import RayEngine, VLLMActor, VLLMWeightSync, WeightSyncError  # noqa: E402

PLACED = {"num_cpus": 1, "resources": {"inference_host": 1}}  # only the inference host has it


def start_actor(model_dir: str):
    return ray.remote(**PLACED)(VLLMActor).remote(**engine_kwargs(Path(model_dir)))


def host_of(actor) -> str:
    """The address of the node Ray placed ``actor`` on."""
    where = actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
    node_id = ray.get(where, timeout=300)  # the actor's vLLM engine starts first (~30 s on 2 idle cores)
    return next(node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == node_id)


class KillsTheActorAt(TinyCausalLM):
    """Samples through the sync's engine in every step and records the versions; kills the
    actor (as a crash of its host would) in step ``kill_at``, after sampling."""

    def __init__(self, model, kill_at: int) -> None:
        super().__init__(model, lr=1e-2)
        self.kill_at = kill_at
        self.seen: list[tuple[int, list[int], int]] = []

    def training_step(self, batch, batch_idx):
        from vllm import SamplingParams

        from lightning_vllm import generate
        from lightning_vllm.fronts.lightning.rollouts import sampler_of

        updater = sampler_of(self).updater
        if batch_idx > self.kill_at:  # a replacement serves nothing trained until its first push point
            return super().training_step(batch, batch_idx)
        rollouts = generate(self, [[1, 2, 3], [4, 5]], SamplingParams(max_tokens=2))
        self.seen.append((batch_idx, [r.weight_version for r in rollouts], updater.versions.trainer))
        if batch_idx == self.kill_at:
            engine = updater.engine
            assert isinstance(engine, RayEngine)
            ray.kill(engine.handle)
        return super().training_step(batch, batch_idx)


class ReplacesADeadActor(Callback):
    """The user's code: after a push point that failed, check the actor; if it is dead, start
    a new one on the inference host and hand it to the sync, whose next push point fills it."""

    def __init__(self, sync: VLLMWeightSync, model_dir: str) -> None:
        self.sync, self.model_dir = sync, model_dir
        self.failures_seen = 0
        self.replacements: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.sync.sync_failures == self.failures_seen:
            return
        self.failures_seen = self.sync.sync_failures
        engine = self.sync.updater.engine
        assert isinstance(engine, RayEngine)
        try:
            ray.get(engine.handle.__ray_ready__.remote(), timeout=30)
            return  # alive: the failure was something else
        except ray.exceptions.RayActorError:
            pass
        replacement = start_actor(self.model_dir)
        self.replacements.append(replacement)
        self.sync.updater.set_engine(replacement)


def main(address: str, model_dir: str, master_address: str, sync_port: int, out: str) -> None:
    ray.init(address=address, log_to_driver=False, configure_logging=False)
    result: dict = {"driver_listening_before": listened_on_by(os.getpid())}
    tmp = Path(out).parent

    # 1. on_sync_error="warn": the actor dies in step 2, a replacement takes the next push point.
    actor = start_actor(model_dir)
    result["actor_host"] = host_of(actor)
    module = KillsTheActorAt(tiny_qwen2(seed=0), kill_at=2)
    sync = VLLMWeightSync(
        engine=actor,
        every_n_train_steps=1,
        master_address=master_address,
        master_port=sync_port,
        on_sync_error="warn",
        timeout_seconds=60,
    )
    replacer = ReplacesADeadActor(sync, model_dir)
    cpu_trainer(tmp / "warn", [sync, replacer], max_steps=4, logger=False).fit(module, token_batches(num_batches=4))
    result["seen"] = module.seen
    result["sync_failures"] = sync.sync_failures
    result["weight_version"] = sync.weight_version
    result["replacements"] = len(replacer.replacements)
    replacement = replacer.replacements[0]
    result["replacement_host"] = host_of(replacement)
    engine = RayEngine(replacement)
    result["replacement_version"] = int(engine.get_weight_version())
    trained = module.model.eval()
    with torch.no_grad():
        result["replacement_gap"] = max_abs_diff(engine_prompt_logprobs(engine), hf_prompt_logprobs(trained))
    result["driver_listening"] = listened_on_by(os.getpid())

    # 2. on_sync_error="raise" (the default): the replacement dies in step 1, the fit ends with the sync's error.
    module = KillsTheActorAt(tiny_qwen2(seed=1), kill_at=1)
    sync = VLLMWeightSync(
        engine=replacement, every_n_train_steps=1, master_address=master_address, master_port=sync_port
    )
    try:
        cpu_trainer(tmp / "raise", [sync], max_steps=4, logger=False).fit(module, token_batches(num_batches=4))
        result["raised"] = None
    except WeightSyncError as error:
        result["raised"] = f"{type(error).__name__}: {error}"
    result["steps_run_before_the_error"] = len(module.seen)
    with open(out, "w") as file:
        json.dump(result, file)
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
