"""The check after every push, on a real vLLM engine: a layer corrupted inside the engine is named."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from helpers import assert_serves, tiny_qwen2

from lightning_vllm import VLLMUpdater
from lightning_vllm.errors import LandedWeightsMismatchError

NORM = "model.layers.1.post_attention_layernorm"


@pytest.mark.engine
def test_a_layer_corrupted_in_the_engine_is_named_by_the_next_push_and_mended_by_the_one_after(llm, caplog):
    model = tiny_qwen2(seed=41)
    updater = VLLMUpdater(engine=llm, timeout_seconds=60)  # verify_pushes: on by default
    with caplog.at_level(logging.WARNING, logger="lightning_vllm.core.landing_check"):
        updater.push_weights(model)
        updater.push_weights(model)
    assert updater.last_sync is not None and updater.last_sync.timing.check_seconds > 0
    # vLLM's CPU build packs the linear layers for oneDNN: fingerprinted as it packs them, every layer is checked.
    assert [record.getMessage() for record in caplog.records] == []
    version = updater.weight_version

    # A faulty load behind the trainer's back, then a changed-only push of another layer.
    (value,) = llm.collective_rpc("add_to_parameter", args=(f"{NORM}.weight", 0.5))
    assert value == pytest.approx(1.5)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.01)
    with pytest.raises(LandedWeightsMismatchError, match=rf"engine 0 .*1 layer\(s\), {NORM}\b") as caught:
        updater.push_weights(model)
    assert caught.value.layers == {0: [NORM]}
    assert caught.value.stats.num_bytes < sum(p.numel() * p.element_size() for p in model.parameters())
    # Committed (the engine holds that version), and the next push sends every tensor again.
    assert updater.weight_version == version + 1 and llm.get_weight_version() == str(version + 1)
    updater.push_weights(model)
    assert updater.last_sync.num_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert_serves(llm, model)
    updater.close()


@pytest.mark.engine
def test_with_verify_pushes_off_nothing_is_checked(llm):
    model = tiny_qwen2(seed=42)
    updater = VLLMUpdater(engine=llm, timeout_seconds=60, verify_pushes=False)
    updater.push_weights(model)
    assert updater.last_sync is not None and updater.last_sync.timing.check_seconds < 1e-3
    (value,) = llm.collective_rpc("add_to_parameter", args=(f"{NORM}.weight", 0.5))
    updater.push_weights(model)  # nothing changed on the trainer: nothing sent, nothing noticed
    updater.close()
    VLLMUpdater(engine=llm, timeout_seconds=60).push_weights(model)  # a new connection, checked (the default): all
    assert_serves(llm, model)


# -- engine-free: what the check does with what an engine reports -------------------------------------------


class ReportingEngine:
    """An engine target's check-side half only: the per-layer reports it answers (a unit test's stand-in)."""

    description = "test engine"

    def __init__(self, reports=None, problem=None, delay: float = 0.0) -> None:
        self.reports, self.problem, self.delay = reports or [], problem, delay
        self.asked = 0

    def layer_sums_problem(self):
        return self.problem

    def layer_sums(self):
        import time

        self.asked += 1
        time.sleep(self.delay)
        return self.reports


def _pushed(check, tensors: dict, held: bool = False) -> None:
    sums = check.tally_for(carries_base=True, every_rank=None)
    for name, tensor in tensors.items():
        sums.tally(name, tensor, tensor.dtype, held)
    check.push_ended(committed=True)


def test_a_check_that_is_off_or_cannot_ask_sums_nothing(caplog):
    from lightning_vllm.core.landing_check import LandingCheck

    assert LandingCheck.for_engine(ReportingEngine(), enabled=False, timeout_seconds=5) is None
    with caplog.at_level(logging.WARNING, logger="lightning_vllm.core.landing_check"):
        unable = ReportingEngine(problem="built without the extension")
        assert LandingCheck.for_engine(unable, enabled=True, timeout_seconds=5) is None
        bare = object.__new__(type("Bare", (), {"description": "bare"}))
        assert LandingCheck.for_engine(bare, True, 5) is None  # type: ignore[arg-type]
    check = LandingCheck.for_engine(ReportingEngine(), enabled=True, timeout_seconds=5)
    assert check is not None and check.tally_for(carries_base=False, every_rank=None) is None
    assert "Pushes to test engine are not checked: built without the extension." in caplog.text
    assert "does not declare ReportsLayerSums" in caplog.text


def test_the_engines_report_is_held_against_what_was_sent_and_unverifiable_layers_are_not_summed_again(caplog):
    from lightning_vllm.core.landing_check import LandingCheck
    from lightning_vllm.weights.layer_sums import tensor_sums

    norm, attention = "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight"
    report = {
        "sharded": {},
        "replicated": {"model.layers.0.input_layernorm": tensor_sums(torch.ones(3)).tolist()[:2]},
        "unverifiable": {"model.layers.0.self_attn": "repacked"},
    }
    engine = ReportingEngine([report])
    check = LandingCheck.for_engine(engine, enabled=True, timeout_seconds=5)
    _pushed(check, {norm: torch.ones(3), attention: torch.ones(4)})
    with caplog.at_level(logging.WARNING, logger="lightning_vllm.core.landing_check"):
        first = check.check_result()
        assert first.differing == [] and first.covered == (1, 2)  # the norm compared; attention cannot be
        again = check.check_result()  # nothing pushed since: the engine is not asked again, and nothing compared
        assert again.differing == [] and again.covered == (0, 0)
    assert engine.asked == 1 and caplog.text.count("cannot be verified") == 1
    _pushed(check, {norm: torch.full((3,), 2.0), attention: torch.full((4,), 5.0)})
    assert check.sent._held[attention] == tuple(tensor_sums(torch.ones(4)).tolist())  # the first push's: not summed
    assert check.check_result().differing == ["model.layers.0.input_layernorm"]  # the engine still reports ones


def test_an_engine_that_does_not_report_in_time_leaves_the_push_as_it_was(caplog):
    from lightning_vllm.core.landing_check import LandingCheck

    check = LandingCheck.for_engine(ReportingEngine(delay=2.0), enabled=True, timeout_seconds=0.2)
    _pushed(check, {"lm_head.weight": torch.ones(2)})
    with caplog.at_level(logging.WARNING, logger="lightning_vllm.core.landing_check"):
        assert check.check_result().differing == []
    assert "could not be checked" in caplog.text


def test_the_trainers_sums_of_held_tensors_run_while_the_engine_sums_its_own(monkeypatch):
    import threading

    from lightning_vllm.core.landing_check import LandingCheck
    from lightning_vllm.weights import layer_sums

    asked = threading.Event()

    class AskedEngine(ReportingEngine):
        def layer_sums(self):
            asked.set()
            return super().layer_sums()

    summed_after_asked: list[bool] = []
    tensor_sums = layer_sums.tensor_sums

    def watched_sums(tensor, dtype=None):
        summed_after_asked.append(asked.wait(timeout=5))
        return tensor_sums(tensor, dtype)

    monkeypatch.setattr(layer_sums, "tensor_sums", watched_sums)
    norm = "model.layers.0.input_layernorm.weight"
    engine = AskedEngine([{"replicated": {"model.layers.0.input_layernorm": tensor_sums(torch.ones(3)).tolist()[:2]}}])
    check = LandingCheck.for_engine(engine, enabled=True, timeout_seconds=5)
    sums = check.tally_for(carries_base=True, every_rank=None)
    sums.tally(norm, torch.ones(3), torch.float32, True)
    assert summed_after_asked == [] and not asked.is_set()  # held: not summed on the wire
    check.push_ended(committed=True)
    assert summed_after_asked == [True]  # summed once the engine had been asked for its sums
    assert check.check_result().differing == [] and engine.asked == 1


def test_an_engine_asked_as_the_push_committed_is_asked_once_and_its_answer_dropped_if_the_copies_fail():
    from lightning_vllm.core.landing_check import LandingCheck
    from lightning_vllm.weights.layer_sums import tensor_sums

    norm = "model.layers.0.input_layernorm.weight"
    ones = tensor_sums(torch.ones(3)).tolist()
    engine = ReportingEngine([{"replicated": {"model.layers.0.input_layernorm": ones[:2]}}])
    check = LandingCheck.for_engine(engine, enabled=True, timeout_seconds=5)
    assert check is not None
    sums = check.tally_for(carries_base=True, every_rank=None)
    sums.tally(norm, torch.ones(3), torch.float32)
    check.ask_engine()  # committed; the engine's copies still run (lightning_ipc)
    check.push_ended(committed=True)  # they landed
    assert check.check_result().differing == [] and engine.asked == 1  # asked once, as it committed
    sums = check.tally_for(carries_base=True, every_rank=None)
    sums.tally(norm, torch.full((3,), 2.0), torch.float32)
    check.ask_engine()
    check.push_ended(committed=False)  # the copies did not end in time: the push failed
    assert check.check_result().differing == []  # nothing is held against an answer about a push that failed
    assert check.sent.by_layer()["model.layers.0.input_layernorm"].total == ones[0]  # the last push that landed
    check.ask_engine()  # nothing tallied since: not asked
    deadline = time.monotonic() + 5
    while engine.asked < 2 and time.monotonic() < deadline:  # (the second question runs on a thread of its own)
        time.sleep(0.01)
    time.sleep(0.05)
    assert engine.asked == 2


def test_sums_that_came_with_the_push_are_held_against_it_and_the_engine_is_not_asked():
    from lightning_vllm.core.landing_check import LandingCheck
    from lightning_vllm.weights.layer_sums import tensor_sums

    norm = "model.layers.0.input_layernorm.weight"
    ones, twos = tensor_sums(torch.ones(3)).tolist(), tensor_sums(torch.full((3,), 2.0)).tolist()
    engine = ReportingEngine([{"replicated": {"model.layers.0.input_layernorm": ones[:2]}}])
    check = LandingCheck.for_engine(engine, enabled=True, timeout_seconds=5)
    assert check is not None
    sums = check.tally_for(carries_base=True, every_rank=None)
    sums.tally(norm, torch.ones(3), torch.float32)
    check.answered([{"replicated": {"model.layers.0.input_layernorm": twos[:2]}}])  # (lightning_ipc's landed sums)
    check.push_ended(committed=True)
    assert check.check_result().differing == ["model.layers.0.input_layernorm"] and engine.asked == 0
    # A push that fails drops what came with it; the next is asked for as before.
    sums = check.tally_for(carries_base=True, every_rank=None)
    sums.tally(norm, torch.ones(3), torch.float32)
    check.answered([{"replicated": {}}])
    check.push_ended(committed=False)
    assert check.check_result().differing == [] and engine.asked == 0
    sums = check.tally_for(carries_base=True, every_rank=None)
    sums.tally(norm, torch.ones(3), torch.float32)
    check.push_ended(committed=True)
    assert check.check_result().differing == [] and engine.asked == 1
