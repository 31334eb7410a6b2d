"""VLLMUpdater against a real vLLM engine: pushes, versions, errors and waits."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import (
    FakeEngine,
    assert_serves,
    build_llm_in_process,
    served_version,
    shutdown,
    tiny_qwen2,
    vllm_prompt_logprobs,
)

from lightning_vllm import EngineConfigError, VLLMUpdater, WeightSyncError, WeightSyncTimeoutError, vLLMUpdater
from lightning_vllm.errors import PartialPushError


@pytest.mark.engine
def test_push_replaces_the_served_weights_and_commits_a_version(llm):
    first, second = tiny_qwen2(seed=11), tiny_qwen2(seed=12)
    updater = VLLMUpdater(engine=llm, timeout_seconds=60)
    updater.init(VLLMUpdater.get_model_metadata(first))

    v = served_version(llm)  # the shared engine's count goes on
    stats = updater.push_weights(first)
    assert_serves(llm, first)
    assert (stats.weight_version, updater.weight_version, llm.get_weight_version()) == (v + 1, v + 1, str(v + 1))
    assert stats.num_bytes == sum(p.numel() * 4 for p in first.parameters()) and stats.seconds > 0

    updater.push_weights(second)
    assert_serves(llm, second)
    assert llm.get_weight_version() == str(v + 2)
    updater.close()


@pytest.mark.engine
def test_small_buckets_split_large_tensors_into_slices(llm):
    model = tiny_qwen2(seed=13)
    # The embedding (512 x 128 float32 = 256 KiB) is four times this bucket; tensors of
    # 64 KiB travel alone (from the model's memory), smaller ones are packed.
    updater = VLLMUpdater(engine=llm, bucket_size_bytes=64 * 1024)
    updater.push_weights(model)  # init happens on the first push
    assert_serves(llm, model)
    second = tiny_qwen2(seed=23)
    updater.push_weights(second)  # the staging ring starts again from its beginning
    assert_serves(llm, second)
    updater.close()


@pytest.mark.engine
def test_the_workers_kept_receive_buffers_are_not_part_of_the_served_model(llm):
    model = tiny_qwen2(seed=25)
    updater = VLLMUpdater(engine=llm, bucket_size_bytes=64 * 1024)
    updater.push_weights(model)
    (num_bytes,) = llm.collective_rpc("scribble_on_receive_buffers")
    assert num_bytes >= sum(p.numel() * 4 for p in model.parameters())  # one model's worth is kept
    assert_serves(llm, model)  # vLLM copied everything out of them
    updater.push_weights(model)  # and the next sync reuses them
    assert_serves(llm, model)
    updater.close()


@pytest.mark.engine
def test_a_push_after_close_joins_again(llm):
    model = tiny_qwen2(seed=14)
    updater = VLLMUpdater(engine=llm)
    version = updater.push_weights(tiny_qwen2(seed=15)).weight_version
    updater.close()
    assert not updater.initialized
    updater.push_weights(model)
    assert_serves(llm, model)
    assert llm.get_weight_version() == str(version + 1)
    updater.close()


def test_post_hooks_run_in_order_after_each_push():
    calls = []
    updater = VLLMUpdater(engine=FakeEngine(tiny_qwen2()))
    updater.register_post_hook(lambda: calls.append(("first", updater.weight_version)))
    updater.register_post_hook(lambda: calls.append(("second", updater.weight_version)))
    updater.push_weights(tiny_qwen2(seed=16))
    updater.push_weights(tiny_qwen2(seed=17))
    assert calls == [("first", 1), ("second", 1), ("first", 2), ("second", 2)]
    assert len(updater.post_hooks) == 2
    updater.close()


@pytest.mark.engine
def test_backend_mismatch_is_refused_before_any_byte_moves(llm):
    model = tiny_qwen2(seed=18)
    VLLMUpdater(engine=llm).push_weights(model)
    version = llm.get_weight_version()
    with pytest.raises(EngineConfigError, match="expects weight-transfer backend 'gloo' but this updater uses 'nccl'"):
        VLLMUpdater(engine=llm, backend="nccl").init(VLLMUpdater.get_model_metadata(model))
    with pytest.raises(EngineConfigError, match="vllm_tp_size=2 but the engine runs with tensor_parallel_size=1"):
        VLLMUpdater(engine=llm, vllm_tp_size=2).init(VLLMUpdater.get_model_metadata(model))
    assert llm.get_weight_version() == version
    assert_serves(llm, model)


@pytest.mark.engine
def test_weights_that_do_not_match_the_metadata_are_refused(llm):
    model = tiny_qwen2(seed=19)
    updater = VLLMUpdater(engine=llm)
    version = updater.push_weights(model).weight_version
    other = tiny_qwen2(seed=20)
    other.model.layers = other.model.layers[:1]  # one layer fewer
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.self_attn.q_proj.weight'"):
        updater.push_weights(other)
    assert llm.get_weight_version() == str(version)
    assert_serves(llm, model)
    updater.close()


def test_push_needs_weights():
    with pytest.raises(ValueError, match="push_weights needs the weights"):
        VLLMUpdater().push_weights(None)


def test_init_without_an_engine_says_how_to_give_one():
    with pytest.raises(EngineConfigError, match="pass engine="):
        VLLMUpdater().init(VLLMUpdater.get_model_metadata(torch.nn.Linear(2, 2)))


def test_torchrl_spelling_is_the_same_class():
    assert vLLMUpdater is VLLMUpdater


class SilentEngine(FakeEngine):
    """An engine behind a network that never answers: every control call blocks."""

    def __init__(self) -> None:
        super().__init__(tiny_qwen2())
        self.expected = None  # nothing to check against: the engine cannot be asked
        self.never = threading.Event()

    def init_weight_transfer_engine(self, init_info):
        self.never.wait()

    def start_weight_update(self):
        self.never.wait()

    def update_weights(self, update_info):
        self.never.wait()

    def finish_weight_update(self, weight_version=None):
        self.never.wait()

    def shutdown_weight_transfer_engine(self):
        self.never.wait()

    def reset_prefix_cache(self):
        self.never.wait()

    def pause_generation(self, mode):
        self.never.wait()

    def resume_generation(self):
        self.never.wait()


def test_an_engine_that_never_answers_fails_within_the_timeout():
    updater = VLLMUpdater(engine=SilentEngine(), timeout_seconds=1)
    start = time.monotonic()
    with pytest.raises(WeightSyncTimeoutError, match="Timed out after 1 s waiting for "):
        updater.push_weights(tiny_qwen2())
    assert time.monotonic() - start < 10
    assert not updater.initialized


class EngineWithoutWorkers(SilentEngine):
    """Answers at once but its worker never joins the group."""

    def init_weight_transfer_engine(self, init_info):
        return None

    def get_weight_version(self):
        return None

    def resume_generation(self):
        return None


def test_workers_that_never_join_fail_within_the_timeout():
    updater = VLLMUpdater(engine=EngineWithoutWorkers(), timeout_seconds=2)
    metadata = VLLMUpdater.get_model_metadata(tiny_qwen2())  # (built outside the time measured: a busy CPU)
    start = time.monotonic()
    with pytest.raises(WeightSyncTimeoutError, match=r"0 of 1 vLLM worker\(s\) joined. The trainer listened on 127"):
        updater.init(metadata)
    assert time.monotonic() - start < 10


@pytest.fixture(scope="module")
def llm_without_transfer(model_dir):
    engine = build_llm_in_process(model_dir, backend=None)
    yield engine
    shutdown(engine)


@pytest.mark.engine
def test_engine_without_weight_transfer_config_gets_a_clear_error(llm_without_transfer):
    model = tiny_qwen2(seed=21)
    before = vllm_prompt_logprobs(llm_without_transfer)
    with pytest.raises(
        EngineConfigError, match=r"without a weight-transfer config.*weight_transfer_config=\{'backend': 'gloo'\}"
    ):
        VLLMUpdater(engine=llm_without_transfer, timeout_seconds=10).push_weights(model)
    assert vllm_prompt_logprobs(llm_without_transfer) == before


def listening_addresses() -> set[tuple[str, int]]:
    import os

    import psutil

    process = psutil.Process(os.getpid())
    return {(c.laddr.ip, c.laddr.port) for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}


def test_the_trainer_listens_on_loopback_only_by_default():
    model = tiny_qwen2()
    before = listening_addresses()
    updater = VLLMUpdater(engine=FakeEngine(model))
    updater.init(VLLMUpdater.get_model_metadata(model))
    opened = listening_addresses() - before
    assert opened, "the rendezvous store should be listening"
    assert {ip for ip, _ in opened} == {"127.0.0.1"}
    updater.close()


def test_worker_ids_select_engines_by_id_or_device():
    model = tiny_qwen2(seed=22)
    engine = FakeEngine(model)
    updater = VLLMUpdater(engine=engine)
    assert updater.all_worker_ids() == [0]
    updater.push_weights(model, worker_ids=0)
    updater.push_weights(model, worker_ids=[0])
    updater.push_weights(model, worker_ids=torch.device("cpu"))
    assert engine.get_weight_version() == "3"
    with pytest.raises(ValueError, match=r"Unknown worker id 1; this updater's engines are \[0\]"):
        updater.push_weights(model, worker_ids=[1])
    with pytest.raises(ValueError, match="selects no engine"):
        updater.push_weights(model, worker_ids=torch.device("cuda"))
    assert engine.get_weight_version() == "3"
    updater.close()


def bad_inputs(model):
    """Each kind of bad input, as a dict of weights built from a good model."""
    good = {name: param.detach() for name, param in model.named_parameters()}
    unknown = {**good, "model.layers.2.mlp.up_proj.weight": torch.zeros(256, 128)}
    missing = {name: tensor for name, tensor in good.items() if name != "model.norm.weight"}
    wrong_shape = {**good, "model.norm.weight": torch.ones(64)}
    wrong_dtype = {**good, "model.norm.weight": torch.ones(128, dtype=torch.int64)}
    return {
        "unknown tensor 'model.layers.2.mlp.up_proj.weight'": unknown,
        "missing tensor 'model.norm.weight'": missing,
        r"tensor 'model.norm.weight' has shape \(64,\), the engine's has \(128,\)": wrong_shape,
        "tensor 'model.norm.weight' has dtype torch.int64, which cannot be sent as torch.float32": wrong_dtype,
    }


@pytest.mark.engine
def test_each_kind_of_bad_input_is_refused_and_vllm_keeps_serving(llm):
    from lightning_vllm import WeightsMismatchError

    model = tiny_qwen2(seed=23)
    updater = VLLMUpdater(engine=llm)
    hook_calls = []
    updater.register_post_hook(lambda: hook_calls.append(updater.weight_version))
    v = updater.push_weights(model).weight_version
    served = vllm_prompt_logprobs(llm)
    for problem, weights in bad_inputs(model).items():
        with pytest.raises(WeightsMismatchError, match=problem):
            updater.push_weights(weights)
        # Also refused before joining, when the metadata itself is wrong.
        with pytest.raises(WeightsMismatchError, match=problem):
            VLLMUpdater(engine=llm).init(VLLMUpdater.get_model_metadata(weights))
    assert llm.get_weight_version() == str(v) and updater.weight_version == v
    assert vllm_prompt_logprobs(llm) == served
    assert hook_calls == [v]  # never after a failed push
    updater.push_weights(model)  # the group survived the refusals
    assert llm.get_weight_version() == str(v + 1)
    updater.close()


class FailsAtStart(FakeEngine):
    """A fake engine whose next update fails (as a server that went away mid-push)."""

    failing = False

    def start_weight_update(self) -> None:
        if self.failing:
            raise WeightSyncError("the engine went away (test)")
        super().start_weight_update()


def test_a_push_that_fails_on_one_engine_still_reaches_the_others_and_reports_each():
    model = tiny_qwen2(seed=0)
    first, second = FailsAtStart(model), FakeEngine(model)
    hook_calls: list[int] = []
    updater = VLLMUpdater(engine=[first, second], timeout_seconds=5)
    updater.register_post_hook(lambda: hook_calls.append(updater.weight_version))
    updater.init(VLLMUpdater.get_model_metadata(model))
    first.failing = True
    message = r"reached engine\(s\) \[1\] but failed on engine 0.*went away"
    with pytest.raises(PartialPushError, match=message) as caught:
        updater.push_weights(model)
    stats = caught.value.stats
    assert (stats.weight_version, stats.engine_indices, stats.failed_engine_indices) == (1, (1,), (0,))
    assert list(caught.value.failures) == [0] and updater.last_sync == stats
    # The engine that took it serves version 1, which is committed; the other keeps its weights.
    assert second.version == "1" and second.holds(model) and first.version == "default"
    assert updater.weight_version == 1 and updater.versions.missed == 0 and hook_calls == [1]
    # When no engine takes a push, its own error is raised and nothing is committed.
    second_fails = FailsAtStart(model)
    updater.set_engine([first, second_fails])
    second_fails.failing = True
    with pytest.raises(WeightSyncError, match="went away") as caught_all:
        updater.push_weights(model)
    assert not isinstance(caught_all.value, PartialPushError)
    assert updater.weight_version == 1 and updater.versions.missed == 1 and hook_calls == [1]


class DiesAtStart(FakeEngine):
    """A fake engine whose core dies before its next update (vLLM's own error for it)."""

    dead = False

    def start_weight_update(self) -> None:
        if self.dead:
            from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDeadError

            raise VLLMEngineDeadError()
        super().start_weight_update()


class DiesClosingItsSockets(FakeEngine):
    """A fake engine whose core has died, and whose client fails the next call with the error of its closed socket
    (vLLM's client closes them once it saw the core exit; a call racing that gets ``ZMQError``, not vLLM's
    ``EngineDeadError``)."""

    dead = False

    def is_dead(self) -> bool:
        return self.dead

    def start_weight_update(self) -> None:
        if self.dead:
            raise OSError("Socket operation on non-socket")
        super().start_weight_update()


def test_an_interrupt_or_another_ranks_failure_is_not_taken_for_a_dead_engine():
    from lightning_vllm import EngineDeadError
    from lightning_vllm.engines.failures import engine_death
    from lightning_vllm.errors import PushAborted

    dead = DiesClosingItsSockets(tiny_qwen2(seed=0))
    dead.dead = True
    assert engine_death(KeyboardInterrupt(), dead, "during a push") is None
    assert engine_death(PushAborted("The push failed on trainer rank 1"), dead, "during a push") is None
    assert isinstance(engine_death(OSError(), dead, "during a push"), EngineDeadError)  # (no message either)


@pytest.mark.parametrize(
    ("dying_engine", "cause"),
    [(DiesAtStart, "EngineDeadError"), (DiesClosingItsSockets, "OSError: Socket operation on non-socket")],
)
def test_an_engine_that_died_is_named_with_what_to_do_and_can_be_replaced(dying_engine, cause):
    from lightning_vllm import EngineDeadError

    model = tiny_qwen2(seed=0)
    dying = dying_engine(model)
    updater = VLLMUpdater(engine=dying, timeout_seconds=5)
    updater.push_weights(model)
    dying.dead = True
    with pytest.raises(EngineDeadError, match=rf"died during a push \({cause}.*hand it to the updater.*set_engine"):
        updater.push_weights(model)
    assert updater.weight_version == 1 and updater.versions.missed == 1
    replacement = FakeEngine(model)
    updater.set_engine(replacement)  # the user's replacement gets the whole model at the next push
    stats = updater.push_weights(model)
    assert replacement.holds(model) and replacement.version == str(stats.weight_version) == str(updater.weight_version)
