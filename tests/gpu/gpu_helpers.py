"""Engines, measurements and trainers of the GPU tier (vLLM's own engine on one CUDA GPU)."""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helpers
import torch
from helpers import PROMPTS, VLLMServer
from lightning.pytorch import Trainer

HOST_SETUP = "make gpu-carry here, then on the GPU host: make test-gpu (docs/gpu.md)"

FIGURES: dict[str, Any] = {}
"""What the GPU tier measured, by name; written to ``$OUT/gpu_figures.json`` (or printed) when the session ends."""

# What vLLM's engine needs on the GPU host: its compiled kernels are torch-native stand-ins there
# (tests/gpu/host/vllm_native_C.py), which eager mode and vLLM's native custom ops reach, and Triton attention.
GPU_ENGINE: dict[str, Any] = dict(
    enforce_eager=True, attention_backend="TRITON_ATTN", compilation_config={"custom_ops": ["none"]}
)


def engine_settings(model_dir: Path, backend: str = "ipc", **overrides: Any) -> dict[str, Any]:
    """Arguments of a small float32 engine on the GPU (``vllm.LLM`` or ``AsyncEngineArgs``)."""
    settings: dict[str, Any] = dict(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=32,
        gpu_memory_utilization=0.06,
        seed=0,
        weight_transfer_config={"backend": backend},
        **GPU_ENGINE,
    )
    return {**settings, **overrides}


def gpu_llm(model_dir: Path, **overrides: Any) -> Any:
    """A ``vllm.LLM`` of :func:`engine_settings`, started once the GPU's free memory has settled."""
    from vllm import LLM

    gpu_memory_settled()
    return LLM(**engine_settings(model_dir, **overrides))


def gpu_memory_settled(timeout: float = 60.0, interval: float = 0.5, tolerance: int = 64 << 20) -> None:
    """Return once the GPU's free memory has stayed within ``tolerance`` bytes for three readings ``interval`` apart
    (at most ``timeout`` seconds): before an engine starts. vLLM's memory profiling asserts that no other process
    freed GPU memory while it ran (``init_free_memory >= free_gpu_memory``, gpu_worker.py), and an engine stopped or
    killed just before gives its memory back while its process winds down."""
    deadline = time.monotonic() + timeout
    readings = [torch.cuda.mem_get_info(0)[0]]
    while time.monotonic() < deadline:
        time.sleep(interval)
        readings = [*readings[-2:], torch.cuda.mem_get_info(0)[0]]
        if len(readings) == 3 and max(readings) - min(readings) <= tolerance:
            return
    raise AssertionError(f"the GPU's free memory did not settle within {timeout:g} s: {readings}")


# Qwen3-30B-A3B's layer shape (its 48 layers hold 30.5B parameters). Its vocabulary (151936 = 64 x 2374) needs
# no padding in vLLM's embedding, whose padded rows would hold dummy values no push writes.
QWEN3_30B_A3B_LAYER: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
)  # fmt: skip
MOE_10B_LAYERS = 16
"""Layers of the MoE of that shape the GPU tier and ``benchmarks/gpu/moe_ipc_push.py`` push: 10,592,262,144
parameters (21.2 GB in bf16), sent as 6,291 tensors (each routed expert's gate, up and down projections apart)."""


def bf16_model_on_gpu(config: Any, model_dir: Path) -> torch.nn.Module:
    """A causal LM of ``config``'s shape (its ``architectures[0]``) in bf16 on the GPU, weights drawn from N(0, 0.02)
    by a seeded generator there: made on the meta device and materialized on the GPU, so it never exists in
    float32 nor on the CPU. Its config is saved to ``model_dir``: all vLLM's dummy loader reads."""
    import transformers

    config.save_pretrained(model_dir)
    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])._from_config(config, torch_dtype=torch.bfloat16)
    model.to_empty(device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def qwen3_moe_bf16(model_dir: Path, num_hidden_layers: int = MOE_10B_LAYERS) -> torch.nn.Module:
    """A bf16 Qwen3-MoE of :data:`QWEN3_30B_A3B_LAYER`'s shape on the GPU (:func:`bf16_model_on_gpu`)."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        **QWEN3_30B_A3B_LAYER,
        num_hidden_layers=num_hidden_layers,
        architectures=["Qwen3MoeForCausalLM"],
        torch_dtype="bfloat16",
    )
    return bf16_model_on_gpu(config, model_dir)


MOE_FAMILY = "qwen3_moe"


def moe_policy() -> torch.nn.Module:
    """The tiny float32 Qwen3-MoE the engine starts from (``helpers.tiny_moe``, seed 0), its experts looped over in
    plain torch (transformers 5's ``eager`` experts: the most direct reference, as ``moe_engine_probe.py`` uses)."""
    model = helpers.tiny_moe(MOE_FAMILY, seed=0)
    if hasattr(model, "set_experts_implementation"):  # transformers 5
        model.set_experts_implementation("eager")
    return model


def moe_llm_over(backend: str, model_dir: Path) -> Any:
    """A float32 ``vllm.LLM`` of :func:`moe_policy` saved to ``model_dir``, over ``backend``. Its engine core starts
    with ``TRITON_F32_DEFAULT=ieee``: Triton's float32 dots in TF32 (its default) would raise the engine's floor."""
    import pytest

    helpers.save_model(moe_policy(), model_dir)
    with pytest.MonkeyPatch.context() as scoped:
        scoped.setenv("TRITON_F32_DEFAULT", "ieee")  # the engine core takes the environment it starts with
        return gpu_llm(model_dir, backend=backend)


def dummy_bf16_llm(
    model_dir: Path, num_bytes: int, backend: str, headroom_bytes: int = 4 << 30, **overrides: Any
) -> Any:
    """A ``vllm.LLM`` of the bf16 model whose config is in ``model_dir``, from dummy weights, given the GPU memory
    its ``num_bytes`` of weights take plus ``headroom_bytes`` (the activations of vLLM's profile run, of
    ``max_num_seqs * max_model_len`` = 1024 tokens; a KV cache of a few short sequences), as a fraction of this GPU:
    what a large model needs beside a trainer holding its own copy (0.17 of an H200 for the 10B MoE). ``overrides``:
    other ``vllm.LLM`` arguments (a quantization, a recipe's)."""
    total = torch.cuda.get_device_properties(0).total_memory
    return gpu_llm(
        model_dir,
        **{
            "backend": backend,
            "dtype": "bfloat16",
            "load_format": "dummy",
            "gpu_memory_utilization": math.ceil(1000 * (num_bytes + headroom_bytes) / total) / 1000,
            "max_model_len": 256,
            "max_num_seqs": 4,
            **overrides,
        },
    )


FP8_BLOCK_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
}
"""Qwen3-8B-FP8's ``quantization_config``: block-wise e4m3, a float32 scale per 128 x 128 block."""


def with_fp8_config(directory: Path, config_dir: Path | None = None) -> Path:
    """``directory`` given ``config_dir``'s config (its own by default) with :data:`FP8_BLOCK_CONFIG`: what an engine
    of the FP8 checkpoint form reads (with ``load_format="dummy"``, all it reads)."""
    import json

    config = json.loads(((config_dir or directory) / "config.json").read_text())
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": FP8_BLOCK_CONFIG}, indent=1))
    return directory


def trainer_engine(updater: Any) -> Any:
    """The updater's trainer-side transfer engine for its one engine (``KeptHandlesIPCTrainerEngine`` over
    ``lightning_ipc``); ``updater`` a ``WeightSync`` or a ``VLLMUpdater``, which has one."""
    from lightning_vllm.core.weight_sync import HoldsWeightSync

    core = updater.weight_sync if isinstance(updater, HoldsWeightSync) else updater
    return core._engine_set.connections[0].sender.engine


def worker_state(llm: Any) -> tuple[int, int]:
    """``lightning_ipc``'s worker: (slots it holds open, loads it replayed so far)."""

    def read(worker: Any) -> tuple[int, int]:  # runs in vLLM's worker (cloudpickled: defined here)
        engine = worker.weight_transfer_engine
        return len(engine._slots), int(engine.loads.replayed)

    (state,) = llm.collective_rpc(read)
    return tuple(state)


def stop_llm(llm: Any) -> None:
    """End the engine core (a test may have killed it already) and wait, at most 30 s, until its process is gone."""
    from lightning_vllm.engines.serialization import engine_core_processes

    processes = engine_core_processes(llm.llm_engine.engine_core)
    try:
        llm.llm_engine.engine_core.shutdown(timeout=2.0)
    except Exception:  # noqa: BLE001  # a killed engine core has nothing left to stop
        pass
    for process in processes:
        process.join(30)


def engine_core_pid(llm: Any) -> int:
    from lightning_vllm.engines.serialization import engine_core_processes

    (process,) = engine_core_processes(llm.llm_engine.engine_core)
    return int(process.pid)


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def fit_lands_within_the_floor(
    llm: Any, tmp_path: Path, figures_prefix: str = "", model: torch.nn.Module | None = None
) -> tuple[Trainer, int]:
    """``Trainer.fit`` of 6 steps with ``VLLMWeightSync`` pushing into ``llm`` every 2, then what it must show:
    every weight landed exactly (digests), the served logprobs within 2x the engine's own float32 floor (measured
    first: its kernels against HF's on the same weights) and the same greedy tokens, while before the sync they
    were at least 100x the floor away; versions 1..3 after the one the engine served. Returns the trainer and
    that version. ``figures_prefix`` names the figures it records; ``model`` is the float32 Hugging Face model
    the fit starts from, of the engine's architecture: a fresh ``tiny_qwen2(seed=0)`` by default.

    Its weights are pushed first, and the floor is measured on them: an engine shared by a tier's tests serves what
    the test before pushed (the nccl tier's replicas test ran first on the H200, and the floor then read 0.57:
    another model's gap)."""
    from lightning_vllm import VLLMUpdater, VLLMWeightSync
    from lightning_vllm.engines.base import version_number

    start = model if model is not None else helpers.tiny_qwen2(seed=0)
    updater = VLLMUpdater(engine=llm, timeout_seconds=60)
    try:
        updater.push_weights(start.cuda())
    finally:
        updater.close()
    module = helpers.TinyCausalLM(start, lr=1e-2)
    served_before, version = helpers.vllm_prompt_logprobs(llm), version_number(llm.get_weight_version())
    floor = helpers.max_abs_diff(served_before, hf_prompt_logprobs(module.hf))
    module.hf.cpu()
    sync = VLLMWeightSync(engine=llm, every_n_train_steps=2, push_on_fit_start=False)

    trainer = gpu_trainer(tmp_path, [sync], max_steps=6)
    trainer.fit(module, helpers.token_batches(num_batches=6))

    before_sync = helpers.max_abs_diff(served_before, hf_prompt_logprobs(module.hf))
    after_sync = helpers.max_abs_diff(helpers.vllm_prompt_logprobs(llm), hf_prompt_logprobs(module.hf))
    figures = {"fit_floor": floor, "fit_gap_before_sync": before_sync, "fit_gap_after_sync": after_sync}
    FIGURES.update({figures_prefix + name: value for name, value in figures.items()})
    assert digests_equal(engine_digest(llm), model_digest(module.hf))  # every weight landed exactly
    assert after_sync <= 2 * floor, (after_sync, floor)
    assert before_sync >= 100 * floor, (before_sync, floor)
    assert helpers.vllm_greedy(llm) == hf_greedy(module.hf)
    assert llm.get_weight_version() == str(sync.weight_version) == str(version + 3)  # steps 2, 4, 6
    return trainer, version


def what_it_serves(
    engine: Any,
    before: torch.nn.Module,
    pushed: torch.nn.Module,
    reference: Callable[[torch.nn.Module], list[list[float]]] | None = None,
    wait: float = 60.0,
    bound: float = 2 * 2.0e-4,
) -> dict[str, Any]:
    """After a push (one that failed, or the one after it): the version ``engine`` (a ``vllm.LLM`` or a target)
    reports, and how far its served prompt logprobs are from ``before`` (the weights it served before the push) and
    from ``pushed`` (the push's), each read within ``wait`` seconds, and which of them it serves (within ``bound``,
    twice the engine's float32 floor on the H200), or "a mix". An engine that does not answer is recorded, not
    raised: the caller's assertions then show it beside what came before. ``reference``: the Hugging Face model's
    logprobs (:func:`hf_prompt_logprobs` on the GPU by default)."""
    from lightning_vllm._waits import call_with_timeout

    reference = reference or hf_prompt_logprobs
    started = time.monotonic()
    try:
        served = call_with_timeout(helpers.served_logprobs, engine, timeout=wait, what="the engine to serve")
        version = call_with_timeout(helpers.served_version, engine, timeout=wait, what="the engine's weight version")
    except Exception as error:  # noqa: BLE001
        return {
            "error": f"{type(error).__name__}: {error}"[:400],
            "after_seconds": round(time.monotonic() - started, 2),
        }
    gap_before = helpers.max_abs_diff(served, reference(before))
    gap_pushed = helpers.max_abs_diff(served, reference(pushed))
    which = "the weights before" if gap_before <= bound else "the push's" if gap_pushed <= bound else "a mix"
    return {
        "answered_after_seconds": round(time.monotonic() - started, 2),
        "version": version,
        "gap_to_before": gap_before,
        "gap_to_pushed": gap_pushed,
        "serves": which,
    }


def push_killed_half_way(llm: Any, timeout: float) -> tuple[BaseException, float]:
    """A push into ``llm`` whose source kills its engine core half way (after a push that lands, 1 MiB buckets:
    several chunks): the error it raised, which must be a ``WeightSyncError``, and its seconds."""
    import pytest

    from lightning_vllm import VLLMUpdater, WeightSyncError

    model = helpers.tiny_qwen2(seed=8).cuda()
    updater = VLLMUpdater(engine=llm, timeout_seconds=timeout, bucket_size_bytes=1 << 20)
    updater.push_weights(model)
    pid = engine_core_pid(llm)
    started = time.monotonic()
    with pytest.raises(WeightSyncError) as raised:
        updater.push_weights(helpers.half_way(model, lambda: kill(pid)))
    return raised.value, time.monotonic() - started


def hf_prompt_logprobs(model: torch.nn.Module, prompts: list[list[int]] = PROMPTS) -> list[list[float]]:
    """The Hugging Face model's prompt logprobs on the GPU, where the engine's own float32 floor was measured
    (Lightning moves a module back to the CPU when fit ends)."""
    return helpers.hf_prompt_logprobs(model.cuda().eval(), prompts)


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]] = PROMPTS, max_tokens: int = 8) -> list[list[int]]:
    return helpers.hf_greedy(model.cuda().eval(), prompts, max_tokens)


def gpu_trainer(tmp_path: Path, callbacks: list, **kwargs: Any) -> Trainer:
    """:func:`helpers.cpu_trainer` on the GPU, in float32."""
    return helpers.cpu_trainer(tmp_path, callbacks, accelerator="gpu", precision="32-true", **kwargs)


def engine_digest(llm: Any) -> tuple[float, float, float]:
    """The float64 sum, sum of squares and sum of magnitudes of every parameter vLLM's model holds, on its GPU.

    They are the same whether vLLM fuses q/k/v and gate/up into one tensor or not, so they are held
    against the trainer's (:func:`model_digest`) across the two layouts.
    """

    def digest(worker: Any) -> tuple[float, float, float]:  # runs in vLLM's worker (cloudpickled: defined here)
        import torch

        sums = torch.zeros(3, dtype=torch.float64, device="cuda")
        for parameter in worker.get_model().parameters():
            values = parameter.detach().double()
            sums += torch.stack([values.sum(), (values * values).sum(), values.abs().sum()])
        return tuple(float(value) for value in sums.tolist())

    (result,) = llm.collective_rpc(digest)
    return tuple(result)


@torch.no_grad()
def model_digest(model: torch.nn.Module) -> tuple[float, float, float]:
    """:func:`engine_digest` of a Hugging Face model (tied embeddings once, as vLLM holds them)."""
    model.cuda()
    sums = torch.zeros(3, dtype=torch.float64, device="cuda")
    for parameter in model.parameters():
        values = parameter.detach().double()
        sums += torch.stack([values.sum(), (values * values).sum(), values.abs().sum()])
    return tuple(float(value) for value in sums.tolist())


def digests_equal(engine: tuple[float, float, float], trainer: tuple[float, float, float]) -> bool:
    """Equal up to the float64 rounding of sums that add the same values in other orders."""
    (total_e, squares_e, scale), (total_t, squares_t, _) = engine, trainer
    return abs(total_e - total_t) <= 1e-12 * scale and abs(squares_e - squares_t) <= 1e-12 * squares_t


def engine_gpu_memory(llm: Any) -> tuple[int, int]:
    """What vLLM's worker process has allocated and reserved through torch on its GPU, in bytes."""

    def memory(worker: Any) -> tuple[int, int]:
        import torch

        torch.cuda.synchronize()
        return int(torch.cuda.memory_allocated()), int(torch.cuda.memory_reserved())

    (result,) = llm.collective_rpc(memory)
    return result


def gpu_server(
    model_dir: Path,
    log_path: Path,
    backend: str = "ipc",
    env: dict[str, str] | None = None,
    extra_args: list[str] | tuple[str, ...] = (),
) -> VLLMServer:
    """``vllm serve`` on the GPU over ``backend`` (with the variable ipc needs), started once the GPU's free memory
    has settled; returns once it is healthy, so that no other engine starts or stops while it profiles memory.
    ``env``: more of its environment (an NCCL host id); ``extra_args``: more of its command line."""
    gpu_memory_settled()
    server = VLLMServer(
        model_dir,
        log_path,
        backend=backend,
        extra_args=[
            "--attention-backend", "TRITON_ATTN",
            "--compilation-config", '{"custom_ops": ["none"]}',
            "--gpu-memory-utilization", "0.06",
            "--max-model-len", "256",
            *extra_args,
        ],
        env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", **(env or {})},
    )  # fmt: skip
    try:
        server.wait_until_healthy(timeout=300)
    except BaseException:
        server.stop()
        raise
    return server


def written_and_read(llm: Any) -> tuple[list[str], list[str], dict[str, Any], dict[str, Any]]:
    """In the engine's worker, after a push: the parameters its last load summed as it wrote them, all of its
    parameters, and the check's report from those sums beside the report from reading every weight again."""

    def run(worker: Any) -> tuple[list[str], list[str], dict[str, Any], dict[str, Any]]:  # (in vLLM's worker)
        from lightning_vllm.weights.held_sums import held_layer_sums

        written = worker.weight_transfer_engine.written_sums() or {}
        model = worker.get_model()
        names = sorted(name for name, _ in model.named_parameters())
        return sorted(written), names, held_layer_sums(model, written), held_layer_sums(model)

    (result,) = llm.collective_rpc(run)
    return result


def records_forgotten(llm: Any) -> None:
    """The engine's recorded loads dropped, if it keeps any (and its own ``load_weights`` back, if a test replaced
    it): the next push goes through vLLM's loaders, recorded again."""

    def run(worker: Any) -> None:  # (in vLLM's worker)
        from lightning_vllm.backends.lightning_ipc.recorded_loads import RecordedLoads

        engine = worker.weight_transfer_engine
        engine.model.__dict__.pop("load_weights", None)
        if not hasattr(engine, "loads"):  # (vLLM's own ipc and nccl engines load through the loaders every time)
            return
        engine.loads = RecordedLoads(engine.sums.summed if engine.sums else None)
        engine._replay = None
        if hasattr(engine, "_bound"):
            engine._bound = {}

    llm.collective_rpc(run)


def replay_one_row_off(llm: Any, name: str) -> None:
    """From the next push on, the engine's recorded copy of the trainer's tensor ``name`` writes one row further into
    its parameter than the loader did (a replay gone wrong)."""

    def run(worker: Any) -> None:  # (in vLLM's worker)
        import dataclasses

        engine = worker.weight_transfer_engine
        record = engine.loads._records[name]
        step = record.steps[0]
        view = step.destination
        shifted = view.as_strided(view.size(), view.stride(), view.storage_offset() + view.stride(0))
        record.steps[0] = dataclasses.replace(step, destination=shifted)
        engine._replay = None
        if hasattr(engine, "_bound"):
            engine._bound = {}

    llm.collective_rpc(run)


def changed_after_loading(llm: Any, parameter: str) -> None:
    """From the next push on, the engine's model changes one value of vLLM's ``parameter`` right after its loaders
    copied the push in (a load that leaves a value other than it was sent); its records dropped, so it loads so."""
    records_forgotten(llm)

    def run(worker: Any) -> None:  # (in vLLM's worker)
        import torch

        model = worker.weight_transfer_engine.model
        load = type(model).load_weights

        def load_weights(weights: Any) -> Any:
            loaded = load(model, weights)
            with torch.no_grad():
                dict(model.named_parameters())[parameter].view(-1)[0] += 0.5
            return loaded

        model.load_weights = load_weights

    llm.collective_rpc(run)


def pushes_sum_what_they_write(llm: Any, model: torch.nn.Module, updater: Any, pushes: int = 2) -> None:
    """``pushes`` pushes of ``model`` (a value of one layer changed before each), every tensor sent, into an engine
    whose loads replay recorded copies: each replay sums every parameter as it writes it, those sums are what a
    read of every weight gives, and the check compares every layer."""
    for step in range(pushes):
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] += 0.01 * (step + 1)
        stats = updater.push_weights(model)
        written, parameters, from_sums, from_reading = written_and_read(llm)
        assert written == parameters, sorted(set(parameters) - set(written))  # every parameter written whole
        assert from_sums == from_reading  # the kernel's sums are those a read of every weight takes
        assert stats.checked_layers[0] == stats.checked_layers[1] > 0
    assert digests_equal(engine_digest(llm), model_digest(model))
