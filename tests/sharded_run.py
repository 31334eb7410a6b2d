"""Two CPU processes train an FSDP2-sharded policy (Lightning's ModelParallelStrategy) while
VLLMWeightSync keeps a vLLM engine on rank 0 in sync; started by test_ranks.py.

One engine, six runs in a row (each a new engine would cost ~20 s, and two more processes as much):
  0. DDP (every rank holds the whole model): rank 0 alone pushes, rank 1 holds no engine and
     samples through rank 0's; no rank waits for a push;
  1. FSDP2: 4 steps, a push every 2 steps;
  2. a fit whose push fails on rank 1 (it cannot read its weights): both ranks raise the
     same error, vLLM keeps serving;
  3. a PEFT LoRA policy sharded with FSDP2 (bfloat16 compute, CPU offload): merged from
     gathered float32 shards, the live module untouched;
  4. FSDP1 and DeepSpeed ZeRO-3 driven by hand over the same process group: Lightning's
     FSDPStrategy and DeepSpeedStrategy refuse a CPU accelerator, so this drives torch's
     ``FullyShardedDataParallel`` and DeepSpeed (``DS_ACCELERATOR=cpu``) directly;
  5. the engine core is killed mid-run; the next push fails on rank 0 and both ranks raise
     the same error within the timeout.
Each rank writes what it saw to rank<N>.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported (step 4)

import torch  # noqa: E402
from helpers import (  # noqa: E402
    LORA_ENGINE,
    RolloutCausalLM,
    TinyCausalLM,
    build_llm,
    cpu_trainer,
    hf_prompt_logprobs,
    max_abs_diff,
    push_in_lockstep_and_record,
    shutdown,
    tensorboard_scalars,
    tiny_qwen2,
    token_batches,
    vllm_prompt_logprobs,
)
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

from lightning_vllm import VLLMUpdater, VLLMWeightSync  # noqa: E402
from lightning_vllm.core.weight_sync import WeightSync  # noqa: E402
from lightning_vllm.fronts.lightning.ranks import TrainerRanks  # noqa: E402
from lightning_vllm.fronts.lightning.roles import LockstepGathers  # noqa: E402


class ShardedCausalLM(RolloutCausalLM):
    """The tiny Qwen2, each decoder layer and the whole model sharded with FSDP2 over 2 ranks."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.model, FSDPModule):  # a second fit of the same module
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class ShardedLoraCausalLM(ShardedCausalLM):
    """A PEFT LoRA policy, sharded with FSDP2 with mixed precision (bfloat16 compute) and CPU offload."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

        if isinstance(self.model, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        options = dict(
            mesh=mesh,
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            offload_policy=CPUOffloadPolicy(pin_memory=False),  # pinning needs an accelerator
        )
        for layer in self.model.base_model.model.model.layers:
            fully_shard(layer, **options)
        fully_shard(self.model, **options)


def merged_full_model(module: ShardedLoraCausalLM) -> torch.nn.Module:
    """The trained LoRA policy gathered and merged into a plain model (every rank calls it)."""
    import copy

    from peft import LoraConfig, get_peft_model

    full = {name: param.full_tensor() for name, param in module.model.named_parameters()}
    config = copy.deepcopy(module.model.peft_config["default"])
    assert isinstance(config, LoraConfig)
    peft = get_peft_model(tiny_qwen2(seed=0), config)
    peft.load_state_dict(full)
    return peft.merge_and_unload().eval()


def full_model(module: ShardedCausalLM, build=tiny_qwen2) -> torch.nn.Module:
    """The trained weights gathered into a plain model ``build`` makes (a collective: every rank calls it)."""
    full = {name: param.full_tensor() for name, param in module.model.named_parameters()}
    model = build(seed=0)
    model.load_state_dict(full)
    return model.eval()


def trainer_for(out_dir: Path, sync: VLLMWeightSync, max_steps: int):
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    return cpu_trainer(out_dir, [sync], max_steps=max_steps, strategy=strategy, devices=2)


def lora_run(out_dir: Path, llm, rank: int) -> dict:
    """A PEFT LoRA policy under FSDP2 (bfloat16 compute, CPU offload) pushed as its adapter (gathered
    across ranks), then one more push by hand, around which the live (sharded) module must not change
    by a bit."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(44)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    module = ShardedLoraCausalLM(get_peft_model(tiny_qwen2(seed=0), config), lr=1e-2)
    sync = VLLMWeightSync(engine=llm, every_n_train_steps=2, timeout_seconds=20, lora="adapter")
    trainer_for(out_dir / "lora", sync, max_steps=4).fit(module, token_batches(num_batches=8))
    before = {name: param.to_local().clone() for name, param in module.model.named_parameters()}
    ranks = TrainerRanks(timeout_seconds=20)
    LockstepGathers(ranks).push(sync.updater, module)
    ranks.close()
    result = {
        "live_module_untouched": all(
            torch.equal(param.to_local(), before[name]) for name, param in module.model.named_parameters()
        ),
        "weight_version": sync.weight_version,
    }
    merged = merged_full_model(module)
    if rank == 0:
        served = vllm_prompt_logprobs(llm, lora_request=sync.updater.lora_request)
        result["max_logprob_diff"] = max_abs_diff(served, hf_prompt_logprobs(merged))
        pushed = [value for _, value in tensorboard_scalars(out_dir / "lora", "vllm/sync_bytes")]
        result["bytes"] = [*pushed, sync.updater.last_sync.num_bytes]
        result["adapter_bytes"] = sum(
            param.numel() * 4 for name, param in module.model.named_parameters() if ".lora_" in name
        )
    return result


ZERO3_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3},
    "zero_allow_untested_optimizer": True,
}


def by_hand_run(llm, rank: int, build=tiny_qwen2) -> dict:
    """FSDP1 and DeepSpeed ZeRO-3 driven by hand over Lightning's process group (gloo): every rank takes
    part in each push of a model ``build(seed)`` makes through one updater, rank 0 sends."""
    import deepspeed

    # What DeepSpeed reads to find the process group; Lightning removes WORLD_SIZE when a fit ends.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the group FSDP1 uses too
    ranks = TrainerRanks(timeout_seconds=30)
    updater = VLLMUpdater(engine=llm, timeout_seconds=30).weight_sync  # (the core: the roles push through it)
    result: dict = {}
    fsdp1_cases(result, updater, ranks, llm, build)
    zero3_cases(result, updater, ranks, llm, build)
    updater.close()
    ranks.close()
    return result


def fsdp1_cases(result: dict, updater: WeightSync, ranks: TrainerRanks, llm, build=tiny_qwen2) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    for seed, use_orig_params, in_lightning_module in ((5, True, False), (6, False, False), (7, True, True)):
        reference = build(seed=seed)
        decoder_layer = type(reference.model.layers[0])  # each decoder layer an FSDP unit
        # As Lightning's FSDPStrategy does: the LightningModule itself is the FSDP root.
        model = FSDP(
            TinyCausalLM(build(seed=seed)) if in_lightning_module else build(seed=seed),
            auto_wrap_policy=ModuleWrapPolicy({decoder_layer}),
            device_id=torch.device("cpu"),
            use_orig_params=use_orig_params,
        )
        case = "LightningModule" if in_lightning_module else f"use_orig_params={use_orig_params}"
        push_in_lockstep_and_record(result, f"FSDP1 {case}", updater, ranks, model, reference, llm)


def zero3_cases(result: dict, updater: WeightSync, ranks: TrainerRanks, llm, build=tiny_qwen2) -> None:
    import deepspeed

    # A Hugging Face model, then a LightningModule holding one, as DeepSpeedStrategy wraps it.
    for seed, in_lightning_module in ((8, False), (9, True)):
        reference = build(seed=seed)
        model = TinyCausalLM(build(seed=seed)) if in_lightning_module else build(seed=seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ZERO3_CONFIG)
        case = "LightningModule" if in_lightning_module else "model"
        push_in_lockstep_and_record(result, f"ZeRO-3 {case}", updater, ranks, engine, reference, llm)


def engine_gone_run(out_dir: Path, llm, rank: int) -> dict:
    """Rank 0's engine core is SIGKILLed in step 2: the push after it must fail on every rank."""

    class KillsTheEngine(ShardedCausalLM):
        """No rollouts (they would report the dead engine first): the push finds it gone."""

        def training_step(self, batch, batch_idx):
            if batch_idx == 1 and rank == 0:
                os.kill(llm.llm_engine.engine_core.resources.engine_manager.processes[0].pid, signal.SIGKILL)
            return TinyCausalLM.training_step(self, batch, batch_idx)

    module = KillsTheEngine(tiny_qwen2(seed=0), lr=1e-2)
    sync = VLLMWeightSync(engine=llm, every_n_train_steps=2, timeout_seconds=20)
    return failed_fit(lambda: trainer_for(out_dir, sync, max_steps=4).fit(module, token_batches(num_batches=8)))


def failed_fit(fit) -> dict:
    """Run ``fit``, which should fail: its error and how long it took to come."""
    result: dict = {}
    start = time.monotonic()
    try:
        fit()
    except Exception as error:  # noqa: BLE001
        result["failure"] = f"{type(error).__name__}: {error}"
    result["failure_seconds"] = time.monotonic() - start
    return result


def ddp_run(out_dir: Path, llm, rank: int) -> dict:
    """Lightning's DDP over the same two processes: rank 0 pushes alone, no rank waits for it."""
    module = RolloutCausalLM(tiny_qwen2(seed=0), lr=1e-2)
    sync = VLLMWeightSync(engine=llm, every_n_train_steps=2, timeout_seconds=60)
    trainer = cpu_trainer(out_dir, [sync], max_steps=4, strategy="ddp", devices=2)
    trainer.fit(module, token_batches(num_batches=8))
    result = {"weight_version": sync.weight_version, "rollouts": module.seen}
    if rank == 0:
        result["staleness"] = [value for _, value in tensorboard_scalars(trainer.logger.log_dir, "vllm/staleness")]
        module.hf.eval()
        result["max_logprob_diff"] = max_abs_diff(vllm_prompt_logprobs(llm), hf_prompt_logprobs(module.hf))
        result["engine_version"] = llm.get_weight_version()
    return result


def run(model_dir: Path, out_dir: Path) -> None:
    # Lightning's launcher starts rank 1 by running this script again with LOCAL_RANK=1.
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    llm = build_llm(model_dir, **LORA_ENGINE) if rank == 0 else None
    result: dict = {"rank": rank, "ddp": ddp_run(out_dir, llm, rank)}
    module = ShardedCausalLM(tiny_qwen2(seed=0), lr=1e-2)
    sync = VLLMWeightSync(engine=llm, every_n_train_steps=2, timeout_seconds=20)
    trainer = trainer_for(out_dir, sync, max_steps=4)
    trainer.fit(module, token_batches(num_batches=8))
    model = full_model(module)
    result["weight_version"] = sync.weight_version
    result["rollouts"] = list(module.seen)
    if rank == 0:
        result["staleness"] = [value for _, value in tensorboard_scalars(trainer.logger.log_dir, "vllm/staleness")]
        result["max_logprob_diff"] = max_abs_diff(vllm_prompt_logprobs(llm), hf_prompt_logprobs(model))
        result["engine_version"] = llm.get_weight_version()
    # A second run whose push fails on rank 1: it cannot read its weights (building the payload's source fails).
    failing = VLLMWeightSync(engine=llm, every_n_train_steps=1, timeout_seconds=20)
    import lightning_vllm.core.payload_choice as payloads

    readable = payloads.weights_from
    if rank == 1:

        def cannot_read(policy, *args, **kwargs):  # weights_from's place
            raise RuntimeError("rank 1 cannot read its weights")

        payloads.weights_from = cannot_read
    try:
        result.update(
            failed_fit(lambda: trainer_for(out_dir, failing, max_steps=1).fit(module, token_batches(num_batches=2)))
        )
    finally:
        payloads.weights_from = readable
    if rank == 0:
        result["engine_version_after_failure"] = llm.get_weight_version()
        result["max_logprob_diff_after_failure"] = max_abs_diff(vllm_prompt_logprobs(llm), hf_prompt_logprobs(model))
    # A third run, on the same engine: a LoRA policy.
    result["lora"] = lora_run(out_dir, llm, rank)
    # FSDP1 and ZeRO-3, outside Lightning, over the same processes and engine.
    result["by_hand"] = by_hand_run(llm, rank)
    # The last: the engine is killed mid-run (SIGKILL of its engine core).
    result["engine_gone"] = engine_gone_run(out_dir, llm, rank)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    if llm is not None:
        shutdown(llm)


if __name__ == "__main__":
    run(Path(sys.argv[1]), Path(sys.argv[2]))
