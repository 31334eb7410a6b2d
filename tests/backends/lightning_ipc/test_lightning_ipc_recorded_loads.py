"""A load recorded as copies and replayed: the same parameters as the loaders leave, or no record at all."""

from __future__ import annotations

import torch

from lightning_vllm.backends.lightning_ipc.recorded_loads import RecordedLoads


class FusedModel(torch.nn.Module):
    """Loads as vLLM's models do: q/k/v into one fused parameter (narrowed views, copied into), a
    vocabulary padded with zero rows, and optionally a loader that computes."""

    def __init__(self, scale_norm: bool = False) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 4), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.zeros(8, 4), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.scale_norm = scale_norm
        self.loader_calls = 0

    def load_weights(self, weights):
        offsets = {"q": (0, 6), "k": (6, 3), "v": (9, 3)}
        for name, tensor in weights:
            self.loader_calls += 1
            if name in offsets:
                start, length = offsets[name]
                self.qkv.data.narrow(0, start, length).copy_(tensor)
            elif name == "embed":
                self.embed.data[: tensor.shape[0]].copy_(tensor)
                self.embed.data[tensor.shape[0] :].fill_(0)
            elif name == "norm":
                self.norm.data.copy_(tensor * 2 if self.scale_norm else tensor)


def incoming(seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"q": (6, 4), "k": (3, 4), "v": (3, 4), "embed": (5, 4), "norm": (4,)}
    return [(name, torch.randn(shape, generator=generator)) for name, shape in shapes.items()]


def loaded(weights, **kwargs) -> dict[str, torch.Tensor]:
    model = FusedModel(**kwargs)
    model.load_weights(weights)
    return {name: tensor.clone() for name, tensor in model.named_parameters()}


def test_a_replayed_load_leaves_what_the_loaders_leave_without_running_them():
    model, loads = FusedModel(), RecordedLoads()
    loads.load(model.load_weights, incoming(0), model.parameters)
    calls = model.loader_calls
    for seed in (1, 2):
        with torch.no_grad():
            model.embed.data[6] = 7.0  # padding written behind the records' back: the replayed fill clears it
        loads.load(model.load_weights, incoming(seed), model.parameters)
        assert model.loader_calls == calls and loads.replayed == seed
        for name, tensor in loaded(incoming(seed)).items():
            assert torch.equal(dict(model.named_parameters())[name], tensor), name


def test_a_subset_replays_its_own_copies_and_a_new_shape_goes_through_the_loaders_again():
    model, loads = FusedModel(), RecordedLoads()
    loads.load(model.load_weights, incoming(0), model.parameters)
    calls = model.loader_calls
    subset = [pair for pair in incoming(3) if pair[0] in ("k", "norm")]
    loads.load(model.load_weights, subset, model.parameters)
    assert model.loader_calls == calls
    assert torch.equal(model.qkv[6:9], subset[0][1]) and torch.equal(model.norm, subset[1][1])
    assert torch.equal(model.qkv[:6], dict(incoming(0))["q"])  # the others are left as they were
    smaller = [("embed", torch.ones(3, 4))]  # a vocabulary of another size: loaded, and recorded again
    loads.load(model.load_weights, smaller, model.parameters)
    assert model.loader_calls == calls + 1 and torch.equal(model.embed[3:], torch.zeros(5, 4))


def test_a_loader_that_computes_leaves_no_record():
    model, loads = FusedModel(scale_norm=True), RecordedLoads()
    loads.load(model.load_weights, incoming(0), model.parameters)
    loads.load(model.load_weights, incoming(1), model.parameters)
    assert loads.replayed == 0 and model.loader_calls == 10
    assert loads.recorded == 1  # watched once: the second load went through the loaders unwatched
    for name, tensor in loaded(incoming(1), scale_norm=True).items():
        assert torch.equal(dict(model.named_parameters())[name], tensor), name


def test_a_bound_load_replays_the_same_as_the_loaders_in_batched_copies_with_its_fills_in_place():
    from lightning_vllm.backends.lightning_ipc.recorded_loads import Replay

    model, loads = FusedModel(), RecordedLoads()
    loads.load(model.load_weights, incoming(0), model.parameters)
    calls = model.loader_calls
    tensors = incoming(4)
    bound = [loads.bind(name, tensor) for name, tensor in tensors]  # resolved once, against these tensors
    assert all(load is not None for load in bound)
    with torch.no_grad():
        model.embed.data[7] = 9.0  # padding written behind the records' back
        for _, tensor in tensors:
            tensor.add_(1.0)  # written in place after binding: the bound views read the new values
        Replay(load for load in bound if load is not None).run()
    assert model.loader_calls == calls
    for name, tensor in loaded(tensors).items():
        assert torch.equal(dict(model.named_parameters())[name], tensor), name


def test_nothing_binds_without_a_record_or_to_a_tensor_of_another_shape():
    model, loads = FusedModel(), RecordedLoads()
    assert loads.bind("q", torch.zeros(6, 4)) is None
    loads.load(model.load_weights, incoming(0), model.parameters)
    assert loads.bind("q", torch.zeros(6, 4)) is not None and loads.recorded == 1
    assert loads.bind("q", torch.zeros(7, 4)) is None
    assert loads.bind("q", torch.zeros(4, 6).t()) is None  # the same shape, other strides


class LargeAndSmall(torch.nn.Module):
    """Two parameters of a mebibyte each (copied alone) around small ones (batched), and a padding fill."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Parameter(torch.zeros(2, 1024, 256), requires_grad=False)
        self.small = torch.nn.Parameter(torch.zeros(3, 4), requires_grad=False)
        self.padded = torch.nn.Parameter(torch.zeros(6), requires_grad=False)

    def load_weights(self, weights):
        for name, tensor in weights:
            if name.startswith("big"):
                self.big.data[int(name[-1])].copy_(tensor)
            elif name.startswith("small"):
                self.small.data[int(name[-1])].copy_(tensor)
            else:
                self.padded.data[:4].copy_(tensor)
                self.padded.data[4:].fill_(0)


def test_a_replay_copies_large_tensors_alone_batches_the_small_and_runs_again_on_new_values():
    model, loads = LargeAndSmall(), RecordedLoads()
    names = ["small0", "big0", "small1", "small2", "padded", "big1"]

    def tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
        generator = torch.Generator().manual_seed(seed)
        shape = {"b": (1024, 256), "s": (4,), "p": (4,)}
        return [(name, torch.randn(shape[name[0]], generator=generator)) for name in names]

    assert loads.load(model.load_weights, tensors(0), model.parameters) is None  # recorded
    incoming = tensors(1)
    replay = loads.load(model.load_weights, incoming, model.parameters)
    assert replay is not None
    assert [kind for kind, _, _ in replay.calls] == ["batch", "copy", "batch", "fill", "copy"]
    assert len(replay.calls[2][1]) == 3  # small1, small2 and padded's copy: one launch
    for _, tensor in incoming:
        tensor.mul_(-1.0)  # the same tensors, new values (an optimizer step)
    with torch.no_grad():
        model.padded.data[5] = 3.0  # padding written behind the records' back
    loads.rerun(replay)
    assert loads.replayed == 2
    expected = LargeAndSmall()
    expected.load_weights(incoming)
    for (name, held), (_, wanted) in zip(model.named_parameters(), expected.named_parameters()):
        assert torch.equal(held, wanted), name


def test_a_moe_layers_experts_sent_as_views_of_one_tensor_replay_as_one_copy_per_fused_tensor():
    experts, intermediate, hidden = 8, 4, 16
    w13 = torch.zeros(experts, 2 * intermediate, hidden)  # vLLM's fused experts: gate then up, expert after expert

    def load(weights):  # as vLLM's FusedMoE loader: each expert's projection into its rows, through views
        for name, tensor in weights:
            expert, projection = int(name.split(".")[0]), name.split(".")[1]
            rows = slice(0, intermediate) if projection == "gate" else slice(intermediate, 2 * intermediate)
            (expert_rows,) = w13[expert : expert + 1].unbind(0)[:1]  # (vLLM's loader unbinds: views, recorded)
            expert_rows[rows].copy_(tensor)

    def views(fused):  # as the trainer sends transformers' fused gate_up_proj: views, gates first
        gates, ups = fused[:, :intermediate], fused[:, intermediate:]
        return [(f"{e}.gate", gates[e]) for e in range(experts)] + [(f"{e}.up", ups[e]) for e in range(experts)]

    loads = RecordedLoads()
    assert loads.load(load, views(torch.randn(experts, 2 * intermediate, hidden)), lambda: [w13]) is None
    fused = torch.randn(experts, 2 * intermediate, hidden)
    replay = loads.load(load, views(fused), lambda: [w13])
    assert replay is not None and loads.replayed == 1  # recorded, although the views share one storage
    assert [kind for kind, _, _ in replay.calls] == ["batch"] and len(replay.calls[0][1]) == 1  # 16 copies, one
    assert torch.equal(w13, fused)
