"""A replay that sums what it writes: the sums of each parameter it writes whole equal a read of it afterwards, and a
parameter its copies do not tile (a copy one row off, a part left out) is read again instead.

The kernel is Triton's; here it runs under Triton's interpreter on the CPU, which must be on before Triton is first
imported: the scenarios run in a process of their own (``TRITON_INTERPRET=1``), started once by the test below.
The GPU tier runs the kernel compiled, in vLLM's worker (tests/gpu/test_gpu_check.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lightning_vllm.backends.lightning_ipc import summed_replay
from lightning_vllm.backends.lightning_ipc.recorded_loads import RecordedLoads, Replay
from lightning_vllm.weights.held_sums import LayerRows, held_layer_sums, parameter_rows
from lightning_vllm.weights.layer_sums import SQUARES_MODULUS, layer_key, tensor_sums

EXPERTS = 2
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="run under Triton's interpreter, by the test below")


SCENARIOS = (
    "test_the_sums_of_what_a_replay_writes_are_those_a_read_of_each_parameter_takes_after_it",
    "test_a_copy_one_row_off_is_refused_and_a_parameter_left_in_part_is_read_again",
    "test_a_push_of_part_of_a_parameter_leaves_it_to_be_read",
    "test_the_layer_rows_after_a_replay_are_the_report_of_the_model_it_wrote",
)


@pytest.mark.skipif(INTERPRETED, reason="(the process it starts)")
@pytest.mark.skipif(
    "LIGHTNING_VLLM_EXPECT_VLLM" not in os.environ,
    reason="lightning_ipc's worker runs on vLLM 0.33: its kernel is run once, in make test-vllm-next (4 s of imports)",
)
def test_the_scenarios_pass_with_the_kernel_under_tritons_interpreter():
    pytest.importorskip("triton")
    here, name = os.path.split(__file__)
    script = (
        f"import sys; sys.path.insert(0, {here!r}); import {name[:-3]} as scenarios\n"
        f"for scenario in {SCENARIOS!r}: getattr(scenarios, scenario)(); print('passed', scenario)"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert run.stdout.count("passed") == len(SCENARIOS), run.stdout


class Experts(torch.nn.Module):
    """vLLM's fused experts, as ``held_sums`` tells them: ``global_num_experts`` rows of one tensor."""

    global_num_experts = EXPERTS

    def __init__(self) -> None:
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(EXPERTS, 6, 4), requires_grad=False)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 4), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.zeros(8, 4), requires_grad=False)  # 5 rows sent, 3 of padding
        self.norm = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.experts = Experts()

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        offsets = {"q": (0, 6), "k": (6, 3), "v": (9, 3)}
        for name, tensor in weights:
            if name in offsets:
                self.qkv.data.narrow(0, *offsets[name]).copy_(tensor)
            elif name == "embed":
                self.embed.data[: tensor.shape[0]].copy_(tensor)
                self.embed.data[tensor.shape[0] :].fill_(0)
            elif name == "norm":
                self.norm.data.copy_(tensor)
            else:  # "w13": every expert's rows, as one tensor
                self.experts.w13_weight.data.view(-1).copy_(tensor.view(-1))


def incoming(seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"q": (6, 4), "k": (3, 4), "v": (3, 4), "embed": (5, 4), "norm": (4,), "w13": (EXPERTS, 6, 4)}
    return [(name, torch.randn(shape, generator=generator)) for name, shape in shapes.items()]


def as_read(tensor: torch.Tensor) -> list[int]:
    bits, squares, not_finite = tensor_sums(tensor).tolist()
    return [bits, squares % SQUARES_MODULUS, not_finite]


def as_written(sums: torch.Tensor) -> list[int]:
    bits, squares, not_finite = sums.tolist()
    return [bits, squares % SQUARES_MODULUS, not_finite]


def recorded(model: Model) -> RecordedLoads:
    loads = RecordedLoads(lambda replay: summed_replay.SummedReplay(replay, parameter_rows(model)))
    assert loads.load(model.load_weights, incoming(0), model.parameters) is None  # through the loaders, recorded
    return loads


@interpreted_only
def test_the_sums_of_what_a_replay_writes_are_those_a_read_of_each_parameter_takes_after_it():
    model = Model()
    loads = recorded(model)
    replay = loads.load(model.load_weights, incoming(1), model.parameters)
    assert isinstance(replay, summed_replay.SummedReplay)
    expected = Model()
    expected.load_weights(incoming(1))
    for name, parameter in expected.named_parameters():
        assert torch.equal(dict(model.named_parameters())[name], parameter), name
    written = replay.written_sums()
    assert set(written) == {"qkv", "embed", "norm", "experts.w13_weight"}  # (embed's padding: a fill, summed)
    for name, parameter in model.named_parameters():
        rows = list(parameter) if name == "experts.w13_weight" else [parameter]
        assert [as_written(sums) for sums in written[name]] == [as_read(row) for row in rows], name
    with torch.no_grad():
        model.norm.add_(1.0)  # (a held_layer_sums of the model reads only what was not written)
    report = held_layer_sums(model, written)
    assert report["replicated"]["norm"] == as_written(written["norm"][0])[:2]
    assert report["replicated"]["experts.1"] == as_written(written["experts.w13_weight"][1])[:2]


@interpreted_only
def test_a_copy_one_row_off_is_refused_and_a_parameter_left_in_part_is_read_again():
    model = Model()
    loads = recorded(model)
    bound = [loads.bind(name, tensor) for name, tensor in incoming(1)]
    q_load = bound[0]
    assert q_load is not None
    destination, source, _ = q_load.steps[0]
    shifted = model.qkv.data[1:7]  # q's rows, one row down: into k's first row, q's first left as it was
    bound[0] = type(q_load)(((shifted, source, True),))
    with pytest.raises(ValueError, match="overlap"):  # q's last row and k's first: written twice
        summed_replay.SummedReplay(Replay(load for load in bound if load), parameter_rows(model))
    replay = summed_replay.SummedReplay(Replay(load for load in bound[:1] + bound[3:] if load), parameter_rows(model))
    replay.run()
    assert set(replay.written_sums()) == {"embed", "norm", "experts.w13_weight"}  # qkv is not whole: read it again


@interpreted_only
def test_a_push_of_part_of_a_parameter_leaves_it_to_be_read():
    model = Model()
    loads = recorded(model)
    replay = loads.load(model.load_weights, incoming(2)[:2], model.parameters)  # q and k, not v
    assert isinstance(replay, summed_replay.SummedReplay)
    assert replay.written_sums() == {}


@interpreted_only
def test_the_layer_rows_after_a_replay_are_the_report_of_the_model_it_wrote():
    model = Model()
    loads = recorded(model)
    sums = summed_replay.LastReplaySums(lambda: model)
    weights = incoming(1)
    replay = loads.load(model.load_weights, weights, model.parameters)
    assert isinstance(replay, summed_replay.SummedReplay)
    layouts = []
    for _ in range(2):  # (then the same tensors hold new values, and the replay runs again: its layout is reused)
        sums.loaded(replay)
        rows = sums.layer_rows()
        assert rows is not None and sums._rows is not None
        layouts.append(sums._rows[1])
        report = held_layer_sums(model, replay.written_sums())["replicated"]
        keys = {layer_key(layer): layer for layer in report}
        assert LayerRows.report(rows.tolist(), keys)["replicated"] == {
            layer: [bits, squares % SQUARES_MODULUS] for layer, (bits, squares) in report.items()
        }
        for _, tensor in weights:
            tensor.add_(1.0)
        loads.rerun(replay)
    assert layouts[0] is layouts[1]
    sums.loaded(None)  # a load through the loaders: no sums taken as written
    assert sums.layer_rows() is None
