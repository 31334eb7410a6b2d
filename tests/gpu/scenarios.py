"""What a user does with an in-process engine on the GPU, as scenarios the ``ipc`` tier (``test_gpu_llm.py``) and the
``nccl`` tier (``nccl/test_nccl_llm.py``) both run against vLLM's own engine: ``Trainer.fit`` with ``VLLMWeightSync``,
rollouts during training, background and changed-only pushes, LoRA, failures half way (each recording what the
engine served afterwards and which version it reported), 100 pushes, and the engine core killed mid-push.

Each takes the engine and a prefix for the figures it records in ``gpu_helpers.FIGURES``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_helpers import (
    FIGURES,
    digests_equal,
    engine_core_pid,
    engine_digest,
    engine_gpu_memory,
    fit_lands_within_the_floor,
    gpu_trainer,
    hf_greedy,
    hf_prompt_logprobs,
    model_digest,
    push_killed_half_way,
    what_it_serves,
)
from helpers import (
    PROMPTS,
    TinyCausalLM,
    half_way,
    lora_policy,
    max_abs_diff,
    raises,
    tensorboard_scalars,
    tiny_qwen2,
    token_batches,
    vllm_greedy,
    vllm_prompt_logprobs,
)

from lightning_vllm import EngineConfigError, VLLMUpdater, VLLMWeightSync, WeightSyncError, generate
from lightning_vllm._waits import call_with_timeout
from lightning_vllm.core import after_failure
from lightning_vllm.engines import as_engine_target
from lightning_vllm.engines.base import mixed_weight_version, version_number

FLOOR_BOUND = 2 * 2.0e-4
"""Twice the engine's own float32 floor on the H200 (its kernels against HF's on the same weights, 2.0e-4)."""


def serves(llm: Any, model: torch.nn.Module, bound: float = FLOOR_BOUND) -> float:
    """The prompt-logprob gap between the engine and ``model``; fails above ``bound`` or on other greedy tokens."""
    measured = max_abs_diff(vllm_prompt_logprobs(llm), hf_prompt_logprobs(model))
    assert measured <= bound, f"served logprobs are {measured:.2e} from the model's (bound {bound:.1e})"
    assert vllm_greedy(llm) == hf_greedy(model)
    return measured


def fit_lands_with_its_scalars(llm: Any, tmp_path: Path, prefix: str = "") -> None:
    trainer, version = fit_lands_within_the_floor(llm, tmp_path, figures_prefix=prefix)
    versions = [value for _, value in tensorboard_scalars(trainer.logger.log_dir, "vllm/weight_version")]
    assert versions == [version + 1.0, version + 2.0, version + 3.0]
    assert len(tensorboard_scalars(trainer.logger.log_dir, "vllm/sync_seconds")) == 3
    assert len(tensorboard_scalars(trainer.logger.log_dir, "vllm/sync_bytes")) == 3


class RolloutPolicy(TinyCausalLM):
    """Samples rollouts in every training step, through the callback's engine, and keeps them."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, lr=1e-2)
        self.rollouts: list[tuple[int, list]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        from vllm import SamplingParams

        sync = next(c for c in self.trainer.callbacks if isinstance(c, VLLMWeightSync))
        rollouts = generate(self, PROMPTS[:2], SamplingParams(n=2, max_tokens=6, logprobs=0, temperature=1.0))
        self.rollouts.append((sync.weight_version, rollouts))
        return super().training_step(batch, batch_idx)


def rollouts_carry_their_version(llm: Any, tmp_path: Path) -> None:
    module = RolloutPolicy(tiny_qwen2(seed=2))
    sync = VLLMWeightSync(engine=llm, every_n_train_steps=1)
    start = version_number(llm.get_weight_version())

    gpu_trainer(tmp_path, [sync], max_steps=3).fit(module, token_batches(num_batches=3))

    assert [committed for committed, _ in module.rollouts] == [start + 1, start + 2, start + 3]
    for committed, rollouts in module.rollouts:
        assert len(rollouts) == 4  # 2 prompts, 2 samples each
        for rollout in rollouts:
            assert rollout.weight_version == committed and rollout.weight_version_exact
            assert len(rollout.token_ids) == 6 and len(rollout.logprobs) == 6
            assert all(logprob <= 0.0 for logprob in rollout.logprobs)
    serves(llm, module.hf)


def background_pushes_land(llm: Any, tmp_path: Path) -> None:
    module = TinyCausalLM(tiny_qwen2(seed=3), lr=1e-2)
    sync = VLLMWeightSync(engine=llm, every_n_train_steps=1, blocking=False, when_busy="wait")
    start = version_number(llm.get_weight_version())

    trainer = gpu_trainer(tmp_path, [sync], max_steps=3)
    trainer.fit(module, token_batches(num_batches=3))

    assert llm.get_weight_version() == str(sync.weight_version) == str(start + 4)  # fit start + 3 steps
    serves(llm, module.hf)
    assert len(tensorboard_scalars(trainer.logger.log_dir, "vllm/sync_stall_seconds")) == 4
    assert sync.pusher is not None and sync.pusher.memory.where == "device"  # the snapshots stayed on the GPU


def changed_only_leaves_a_frozen_embedding_out(llm: Any, tmp_path: Path) -> None:
    model = tiny_qwen2(seed=4)
    model.model.embed_tokens.weight.requires_grad_(False)
    module = TinyCausalLM(model, lr=1e-2)
    sync = VLLMWeightSync(engine=llm, every_n_train_steps=1)

    trainer = gpu_trainer(tmp_path, [sync], max_steps=2)
    trainer.fit(module, token_batches(num_batches=2))

    sent = [value for _, value in tensorboard_scalars(trainer.logger.log_dir, "vllm/sync_bytes")]
    embedding = model.model.embed_tokens.weight.numel() * 4
    total = sum(p.numel() * 4 for p in model.parameters())
    assert sent == [total, total - embedding, total - embedding]  # fit start sends it once
    serves(llm, module.hf)


def lora_goes_merged_and_its_adapter_alone_is_refused(llm: Any, tmp_path: Path) -> None:
    policy = lora_policy(seed=5)
    module = TinyCausalLM(policy, lr=1e-2)
    sync = VLLMWeightSync(engine=llm, every_n_train_steps=1)  # lora="auto"
    gpu_trainer(tmp_path, [sync], max_steps=2).fit(module, token_batches(num_batches=2))
    policy.eval()
    serves(llm, policy)  # the PEFT model's outputs: base plus adapter, merged
    with policy.disable_adapter():
        assert max_abs_diff(vllm_prompt_logprobs(llm), hf_prompt_logprobs(policy)) > 1e-2  # (the test can fail)

    version = llm.get_weight_version()
    updater = VLLMUpdater(engine=llm, lora="adapter")
    with pytest.raises(EngineConfigError, match="adapter pushes need the gloo backend"):
        updater.push_weights(policy)
    assert llm.get_weight_version() == version
    updater.close()


def the_trainers_gpu_answers() -> None:
    def answer() -> None:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()

    # A transfer left waiting for a peer would hold the trainer's stream: bounded, not a hang.
    call_with_timeout(answer, timeout=30, what="the trainer's GPU to answer after the failure")


def fails_half_way(
    llm: Any,
    name: str,
    at_half: Callable[[], None],
    timeout: float,
    after_error: Callable[[], None] = lambda: None,
    atomic: bool = False,
    prefix: str = "",
) -> dict[str, Any]:
    """A push of changed weights whose source calls ``at_half`` half way, after one that landed (1 MiB buckets:
    several chunks). It must raise a ``WeightSyncError`` within ``timeout`` plus a few seconds (``after_error`` runs
    then: a stopped engine core is continued), leave the trainer's GPU answering and the version uncommitted, and
    the next push must land on the same engine. Over an ``atomic`` backend the engine must serve, in between, the
    weights of the push that landed, digest-equal, under their version; over a streaming one (vLLM's ``nccl``,
    ``ipc``) it must report the mix (``"1+2"``) whenever it serves other weights than those. Records
    (``<prefix>failure_<name>`` in the figures) and returns the error, its seconds and :func:`what_it_serves` in
    between."""
    model = tiny_qwen2(seed=6).cuda()
    before = tiny_qwen2(seed=6).cuda()
    updater = VLLMUpdater(engine=llm, timeout_seconds=timeout, bucket_size_bytes=1 << 20)
    updater.push_weights(model)
    version = llm.get_weight_version()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.5)
    started = time.monotonic()
    with pytest.raises((WeightSyncError, RuntimeError)) as raised:
        updater.push_weights(half_way(model, at_half))
    seconds = time.monotonic() - started
    after_error()
    the_trainers_gpu_answers()
    record: dict[str, Any] = {"error": f"{type(raised.value).__name__}: {raised.value}"[:300], "seconds": seconds}
    FIGURES[f"{prefix}failure_{name}"] = record  # (kept even if what follows fails)
    if not atomic:  # the clean-up that closes the open update (and labels the mix) ends once the engine answers
        after_failure.wait_for(as_engine_target(llm), timeout=timeout + 30)
    record["in_between"] = what_it_serves(llm, before, model, bound=FLOOR_BOUND)
    record["in_between"]["reported"] = reported = llm.get_weight_version()
    if atomic:
        record["in_between"]["digest_equal_to_before"] = digests_equal(engine_digest(llm), model_digest(before))
    print(f"{name}: {record}")
    assert seconds < timeout + 5, record
    assert record["in_between"].get("version") == version_number(version), record  # answered; not committed
    if atomic:  # the last committed weights, exactly, under their version
        assert record["in_between"]["serves"] == "the weights before", record
        assert record["in_between"]["digest_equal_to_before"], record
        assert reported == version, record
    else:  # the weights before under their version, or the mix reported as such: never another version's name
        mixed = mixed_weight_version(version_number(version), version_number(version) + 1)
        assert reported == mixed or (reported == version and record["in_between"]["serves"] == "the weights before"), (
            record
        )
    with torch.no_grad():  # other weights than the failed push's: what lands is told apart from what it left
        model.lm_head.weight.mul_(1.1)
    updater.push_weights(model)  # the same engine, no restart
    assert version_number(llm.get_weight_version()) == version_number(version) + 1
    record["next_push"] = "landed"
    serves(llm, model)
    updater.close()
    return record


def raising_half_way(llm: Any, timeout: float = 30.0, atomic: bool = False, prefix: str = "") -> dict[str, Any]:
    failing = raises(RuntimeError("the policy could not be read half way"))
    record = fails_half_way(llm, "source_raises", failing, timeout, atomic=atomic, prefix=prefix)
    assert "could not be read half way" in record["error"]
    return record


def timing_out_half_way(llm: Any, timeout: float = 5.0, atomic: bool = False, prefix: str = "") -> dict[str, Any]:
    """The source stalls past ``timeout``; it wakes up later, while the next push is under way."""
    stall = lambda: time.sleep(timeout + 3)  # noqa: E731
    record = fails_half_way(llm, "timed_out", stall, timeout, atomic=atomic, prefix=prefix)
    assert record["error"].startswith("WeightSyncTimeoutError"), record
    return record


def engine_frozen_half_way(
    llm: Any, timeout: float = 15.0, frozen_for: float = 5.0, atomic: bool = False, prefix: str = ""
) -> dict[str, Any]:
    """The engine core SIGSTOPped half way, continued (SIGCONT) once the push failed and ``frozen_for`` more
    seconds passed."""
    pid = engine_core_pid(llm)

    def resume() -> None:
        time.sleep(frozen_for)
        os.kill(pid, signal.SIGCONT)

    stop = lambda: os.kill(pid, signal.SIGSTOP)  # noqa: E731
    record = fails_half_way(llm, "engine_frozen", stop, timeout, after_error=resume, atomic=atomic, prefix=prefix)
    assert record["error"].startswith("WeightSyncTimeoutError"), record
    return record


def engine_killed_half_way(llm: Any, prefix: str = "", timeout: float = 20.0) -> None:
    """Ends ``llm``: its engine core killed half way through a push."""
    error, elapsed = push_killed_half_way(llm, timeout)
    FIGURES[f"{prefix}kill_error_seconds"] = elapsed
    print(f"engine core killed mid-push: {type(error).__name__} after {elapsed:.1f} s: {error}")
    assert elapsed < timeout + 5
    the_trainers_gpu_answers()


def open_fds_and_threads() -> tuple[int, int]:
    """This process's open file descriptors and threads (an NCCL communicator holds sockets and threads)."""
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def engine_fds_and_threads(llm: Any) -> tuple[int, int]:
    def count(worker: Any) -> tuple[int, int]:  # runs in vLLM's worker (cloudpickled: defined here)
        import os

        return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))

    (result,) = llm.collective_rpc(count)
    return tuple(result)


def a_hundred_pushes_leave_memory_flat(llm: Any, prefix: str = "", groups: int = 1, count_leaks: bool = False) -> None:
    """100 pushes in ``groups`` updaters one after another (each joins a group with the engine, pushes, leaves):
    GPU memory flat on both sides. With ``count_leaks``, after every group left there are no more file descriptors
    nor threads on either side than after the warm-up's group left (an NCCL communicator left behind holds both);
    they are recorded either way."""
    model = tiny_qwen2(seed=7).cuda()
    updater = VLLMUpdater(engine=llm, timeout_seconds=60)
    for _ in range(10):  # warm-up: buffers and caches reach their size
        updater.push_weights(model)
    updater.close()
    time.sleep(1)
    resources_before = {"trainer": open_fds_and_threads(), "engine": engine_fds_and_threads(llm)}
    trainer, engine = [], []  # (allocated, reserved) after each push
    started = time.perf_counter()
    per_group = 100 // groups
    for _ in range(groups):
        updater = VLLMUpdater(engine=llm, timeout_seconds=60)
        for step in range(per_group):
            with torch.no_grad():
                model.lm_head.weight.add_(1e-4 * ((-1) ** step))
            updater.push_weights(model)
            torch.cuda.synchronize()
            trainer.append((torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))
            if step % 10 == 9:
                engine.append(engine_gpu_memory(llm))
        if groups > 1:
            updater.close()
    seconds = time.perf_counter() - started
    if groups == 1:
        updater.close()
    time.sleep(1)
    resources_after = {"trainer": open_fds_and_threads(), "engine": engine_fds_and_threads(llm)}

    # Flat: the second half never holds more than the first (a leak of a buffer or a handle per push would).
    # The trainer's reserved memory swings by one packed buffer: one stays shared with the worker until
    # torch's IPC reference counting lets the caching allocator reuse it.
    def growth(samples: list[tuple[int, int]], i: int) -> int:
        half = len(samples) // 2
        return max(v[i] for v in samples[half:]) - max(v[i] for v in samples[:half])

    growths = {
        f"{prefix}{side}_{kind}_growth": growth(samples, i)
        for side, samples in (("trainer", trainer), ("engine", engine))
        for i, kind in enumerate(("allocated", "reserved"))
    }
    swing = max(r for _, r in trainer) - min(r for _, r in trainer)
    FIGURES.update(
        {f"{prefix}soak_pushes": 100, f"{prefix}soak_groups": groups, f"{prefix}soak_seconds_per_push": seconds / 100},
        **{f"{prefix}trainer_reserved_swing": swing},
        **growths,
    )
    FIGURES[f"{prefix}soak_fds_threads"] = {"before": resources_before, "after": resources_after}
    assert all(value <= 0 for value in growths.values()), growths
    for side in ("trainer", "engine") if count_leaks else ():
        fds, threads = resources_after[side]
        assert fds <= resources_before[side][0] and threads <= resources_before[side][1], (
            resources_before,
            resources_after,
        )
    serves(llm, model)


def push_beside_a_request_in_flight(engine: Any, mode: str, prefix: str = "") -> None:
    """An ``AsyncLLM`` target pushed to in pause mode ``mode`` while a long request is being served: the request
    runs to its end (``keep``, ``wait``) or is aborted; the push lands."""
    from helpers import engine_prompt_logprobs
    from vllm import SamplingParams

    model = tiny_qwen2(seed={"keep": 11, "wait": 12, "abort": 13}[mode]).cuda()
    updater = VLLMUpdater(engine=engine, pause_mode=mode, timeout_seconds=60)
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    in_flight = engine.submit(engine.generate_async([PROMPTS[0]], long))
    time.sleep(0.2)  # the request is being served when the push pauses generation

    stats = updater.push_weights(model)

    try:
        (generation,) = in_flight.result(timeout=120)
        outcome = f"{len(generation.token_ids)} tokens, versions {generation.weight_versions}"
        if mode != "abort":  # kept, or waited for: it runs to its end
            assert len(generation.token_ids) == 200
    except Exception as error:  # noqa: BLE001  # an aborted request may end in an error of its own
        assert mode == "abort", error
        outcome = f"{type(error).__name__}: {error}"
    FIGURES[f"{prefix}async_{mode}_push_seconds"] = stats.seconds
    print(f"pause_mode={mode}: the request in flight ended with {outcome}")
    measured = max_abs_diff(engine_prompt_logprobs(engine), hf_prompt_logprobs(model))
    assert measured <= FLOOR_BOUND, measured
    assert engine.get_weight_version() == str(stats.weight_version)
    updater.close()


# Qwen2.5-1.5B's shape; its vocabulary (151936 = 64 x 2374) needs no padding in vLLM's embedding,
# whose padded rows would hold dummy values no push writes.
QWEN2_1_5B = dict(
    vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1000000.0,
)  # fmt: skip


def every_bf16_push_lands_exactly(
    tmp_path: Path, backend: str, prefix: str = "", starting: Callable[[], AbstractContextManager[Any]] = nullcontext
) -> None:
    """A bf16 model of Qwen2.5-1.5B's shape (1.54B parameters, tied embeddings) pushed 4 times into an engine started
    from dummy weights (inside ``starting()``: the environment its engine core takes): after every push the engine
    holds exactly the trainer's weights (digests)."""
    from gpu_helpers import digests_equal, engine_digest, gpu_llm, model_digest, stop_llm
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**QWEN2_1_5B, architectures=["Qwen2ForCausalLM"], torch_dtype="bfloat16")
    config.save_pretrained(tmp_path)  # all vLLM's dummy loader reads
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    with starting():
        llm = gpu_llm(tmp_path, backend=backend, dtype="bfloat16", load_format="dummy", gpu_memory_utilization=0.1)
    try:
        num_parameters = sum(p.numel() for p in model.parameters())
        assert 1.5e9 < num_parameters < 1.6e9
        assert not digests_equal(engine_digest(llm), model_digest(model))  # the check can fail
        updater = VLLMUpdater(engine=llm, timeout_seconds=120)
        seconds = []
        for round_ in range(4):
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(torch.randn_like(parameter), alpha=1e-3)
            stats = updater.push_weights(model)
            seconds.append(stats.seconds)
            assert digests_equal(engine_digest(llm), model_digest(model)), f"push {round_ + 1} did not land exactly"
            assert llm.get_weight_version() == str(stats.weight_version)
        FIGURES.update(
            {
                f"{prefix}bf16_1_5b_parameters": num_parameters,
                f"{prefix}bf16_1_5b_push_seconds_median": sorted(seconds)[2],
            }
        )
        updater.close()
    finally:
        stop_llm(llm)


class InProcessEngineScenarios:
    """The scenarios above as tests, against the fixture ``llm`` a tier's subclass gives (an in-process ``vllm.LLM``
    over its backend): one list of what a user does, run by the ``ipc`` and the ``nccl`` tiers alike.

    Attributes:
        prefix: what the figures of the tier's engine are named with.
        soak_groups: how many updaters the 100 pushes are spread over (each joins a group and leaves it).
        count_leaks: whether the soak holds file descriptors and threads to their count before it.
        atomic: whether a failed push must leave the last committed weights, digest-equal (a staging backend).
    """

    prefix: str = ""
    soak_groups: int = 1
    count_leaks: bool = False
    atomic: bool = False

    def test_fit_pushes_land_within_the_engines_own_float32_floor(self, llm: Any, tmp_path: Path) -> None:
        fit_lands_with_its_scalars(llm, tmp_path, prefix=self.prefix)

    def test_rollouts_in_training_step_carry_the_version_that_produced_them(self, llm: Any, tmp_path: Path) -> None:
        rollouts_carry_their_version(llm, tmp_path)

    def test_background_pushes_land_and_the_last_is_served(self, llm: Any, tmp_path: Path) -> None:
        background_pushes_land(llm, tmp_path)

    def test_changed_only_leaves_a_frozen_embedding_out(self, llm: Any, tmp_path: Path) -> None:
        changed_only_leaves_a_frozen_embedding_out(llm, tmp_path)

    def test_lora_goes_merged_and_its_adapter_alone_is_refused_before_a_byte_moves(
        self, llm: Any, tmp_path: Path
    ) -> None:
        lora_goes_merged_and_its_adapter_alone_is_refused(llm, tmp_path)

    def test_a_hundred_pushes_leave_gpu_memory_flat_on_both_sides(self, llm: Any) -> None:
        a_hundred_pushes_leave_memory_flat(llm, self.prefix, groups=self.soak_groups, count_leaks=self.count_leaks)

    def test_a_push_that_times_out_half_way_fails_in_time_and_the_next_push_lands(self, llm: Any) -> None:
        timing_out_half_way(llm, timeout=5, atomic=self.atomic, prefix=self.prefix)

    def test_a_source_that_raises_half_way_fails_the_push_and_the_next_push_lands(self, llm: Any) -> None:
        raising_half_way(llm, atomic=self.atomic, prefix=self.prefix)

    def test_the_engine_core_frozen_mid_push_times_out_and_serves_again_once_continued(self, llm: Any) -> None:
        engine_frozen_half_way(llm, atomic=self.atomic, prefix=self.prefix)

    @pytest.mark.ends_engine
    def test_the_engine_core_killed_mid_push_is_an_error_within_the_timeout(self, llm: Any) -> None:
        """Last: it ends the shared engine."""
        engine_killed_half_way(llm, prefix=self.prefix)
