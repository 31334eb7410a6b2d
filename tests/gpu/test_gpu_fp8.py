"""FP8 on vLLM's own engine on one GPU (``make test-gpu-fp8``, a call of its own; docs/fp8.md), both ways: an engine
started from a block-wise FP8 checkpoint takes pushes from a bf16 trainer over ``lightning_ipc`` and ``ipc``, and then
holds, and serves, what an engine started from the same weights' FP8 checkpoint holds and serves; an engine that
quantizes online (``quantization="fp8_per_block"``) takes the bf16 form and holds what it would have made of the same
weights at start, every layer checked by what it quantized from.

Written on CPU (issue 67) and not yet run on a GPU: vLLM's FP8 forward here goes through its own Triton GEMM
(``w8a8_triton_block_scaled_mm``) and our stand-in for its activation quantization (``per_token_group_fp8_quant`` in
``tests/gpu/host/vllm_native_C.py``), which the first test holds against vLLM's Triton fallback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_helpers import digests_equal, engine_digest, gpu_llm, stop_llm, with_fp8_config
from helpers import max_abs_diff, tiny_model, vllm_greedy, vllm_prompt_logprobs
from safetensors.torch import save_file

from lightning_vllm import VLLMUpdater, WeightsMismatchError
from lightning_vllm.errors import LandedWeightsMismatchError
from lightning_vllm.weights.fp8 import SCALE_SUFFIX, block_fp8

pytestmark = pytest.mark.gpu


def block_friendly(seed: int, intermediate_size: int = 256) -> torch.nn.Module:
    """A tiny bf16 Qwen2 whose merged projections fill whole 128-row blocks (q and k 128 rows, gate 256)."""
    model = tiny_model("qwen2", seed, intermediate_size=intermediate_size, num_key_value_heads=2)
    return model.to(torch.bfloat16)


def fp8_checkpoint(model: torch.nn.Module, directory: Path) -> Path:
    """``model`` saved as a block-wise FP8 checkpoint: every projection in e4m3 beside its block scales, the rest in
    bf16, and the config's ``quantization_config`` saying so."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu()
        if name.endswith("proj.weight"):
            tensors[name], tensors[name + SCALE_SUFFIX] = block_fp8(tensor)
        else:
            tensors[name] = tensor.contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    model.config.save_pretrained(directory)
    return with_fp8_config(directory)


def fp8_llm(directory: Path, backend: str) -> Any:
    return gpu_llm(directory, backend=backend, dtype="bfloat16")


def assert_holds_and_serves_as(llm: Any, reference: Any) -> None:
    """``llm`` holds every value and scale ``reference`` (an engine started from the pushed weights) holds, and serves
    what it serves: prompt logprobs within the reference's own floor (measured by running it twice), greedy tokens
    equal. Stops ``reference``."""
    try:
        assert digests_equal(engine_digest(llm), engine_digest(reference))
        floor = max_abs_diff(vllm_prompt_logprobs(reference), vllm_prompt_logprobs(reference))
        gap = max_abs_diff(vllm_prompt_logprobs(llm), vllm_prompt_logprobs(reference))
        assert gap <= max(2 * floor, 1e-6), (gap, floor)
        assert vllm_greedy(llm) == vllm_greedy(reference)
    finally:
        stop_llm(reference)


@pytest.fixture(scope="module", params=["lightning_ipc", "ipc"])
def fp8_engine(request, tmp_path_factory, insecure_serialization):
    directory = fp8_checkpoint(block_friendly(seed=0), tmp_path_factory.mktemp("fp8"))
    llm = fp8_llm(directory, request.param)
    yield request.param, llm
    stop_llm(llm)


def test_the_activation_quantization_stand_in_is_vllms_triton_fallback_bit_for_bit():
    from vllm.model_executor.layers.quantization.utils.fp8_utils import _per_token_group_quant_fp8

    x = torch.randn(37, 512, device="cuda", dtype=torch.bfloat16) * 3
    fp8 = torch.float8_e4m3fn
    finfo = torch.finfo(fp8)
    ours_q, ours_s = torch.empty_like(x, dtype=fp8), torch.empty(37, 4, device="cuda")
    torch.ops._C.per_token_group_fp8_quant(x, ours_q, ours_s, 128, 1e-10, finfo.min, finfo.max, False, False, False)
    theirs_q, theirs_s = torch.empty_like(ours_q), torch.empty_like(ours_s)
    _per_token_group_quant_fp8[(37 * 4,)](
        x, theirs_q, theirs_s, 128, 512, x.stride(0), 1e-10, fp8_min=finfo.min, fp8_max=finfo.max, use_ue8m0=False,
        BLOCK=128, num_warps=1, num_stages=1,
    )  # fmt: skip
    assert torch.equal(ours_q.view(torch.uint8), theirs_q.view(torch.uint8))
    assert torch.equal(ours_s, theirs_s)


def test_a_push_lands_as_an_engine_started_from_the_same_weights_fp8_checkpoint_holds_and_serves(fp8_engine, tmp_path):
    backend, llm = fp8_engine
    trained = block_friendly(seed=1).cuda()
    updater = VLLMUpdater(engine=llm, timeout_seconds=120)
    stats = updater.push_weights(trained)
    bf16_bytes = sum(tensor.numel() * 2 for tensor in trained.state_dict().values())
    assert stats.num_bytes < 0.75 * bf16_bytes  # (the projections went as e4m3 and float32 scales)
    checked, expected = stats.checked_layers
    assert checked == expected > 0  # (every layer held in its served form, e4m3 values and scales)
    assert_holds_and_serves_as(llm, fp8_llm(fp8_checkpoint(trained, tmp_path / "reference"), backend))
    updater.close()


def test_changed_only_pushes_send_little_and_a_corrupted_block_scale_is_named(fp8_engine):
    backend, llm = fp8_engine
    trained = block_friendly(seed=2).cuda()
    updater = VLLMUpdater(engine=llm, timeout_seconds=120, changed_only=True)
    full = updater.push_weights(trained).num_bytes
    assert updater.push_weights(trained).num_bytes < full / 4  # nothing changed: the smallest group alone

    def corrupt(worker: Any) -> str:  # runs in vLLM's worker
        for name, parameter in worker.get_model().named_parameters():
            if name.endswith("down_proj.weight_scale_inv"):
                parameter.data[0, 0] *= 2
                return name
        raise AssertionError("no block scale")

    (corrupted,) = llm.collective_rpc(corrupt)
    with torch.no_grad():
        trained.model.layers[1].mlp.up_proj.weight.add_(0.01)
    with pytest.raises(LandedWeightsMismatchError, match=corrupted.rsplit(".mlp", 1)[0]):
        updater.push_weights(trained)
    updater.push_weights(trained)  # every tensor again: mended
    updater.close()


def test_weights_that_do_not_fit_the_fp8_engine_are_refused_before_a_byte_moves(fp8_engine):
    backend, llm = fp8_engine
    version = llm.get_weight_version()
    other = block_friendly(seed=3, intermediate_size=384).cuda()
    with pytest.raises(WeightsMismatchError, match="nothing was sent"):
        VLLMUpdater(engine=llm, timeout_seconds=120).push_weights(other)
    assert llm.get_weight_version() == version


def test_a_dummy_engine_of_an_fp8_config_is_filled_by_its_first_push(tmp_path, insecure_serialization):
    config_dir = fp8_checkpoint(block_friendly(seed=4), tmp_path / "config")
    (config_dir / "model.safetensors").unlink()  # (the config alone, as verl and SkyRL start their engines)
    llm = gpu_llm(config_dir, backend="lightning_ipc", dtype="bfloat16", load_format="dummy")
    try:
        trained = block_friendly(seed=5).cuda()
        updater = VLLMUpdater(engine=llm, timeout_seconds=120)
        updater.push_weights(trained)
        reference = fp8_llm(fp8_checkpoint(trained, tmp_path / "reference"), "lightning_ipc")
        try:
            assert digests_equal(engine_digest(llm), engine_digest(reference))
            assert vllm_greedy(llm) == vllm_greedy(reference)
        finally:
            stop_llm(reference)
        updater.close()
    finally:
        stop_llm(llm)


@pytest.mark.parametrize("backend", ["lightning_ipc", "ipc"])
def test_an_online_fp8_engine_quantizes_a_push_as_it_would_at_start_and_every_layer_is_checked(
    backend, tmp_path, insecure_serialization
):
    def bf16_checkpoint(model: torch.nn.Module, directory: Path) -> Path:
        model.save_pretrained(directory, safe_serialization=True)
        return directory

    online = {"backend": backend, "dtype": "bfloat16", "quantization": "fp8_per_block"}
    llm = gpu_llm(bf16_checkpoint(block_friendly(seed=6), tmp_path / "start"), **online)
    try:
        trained = block_friendly(seed=7).cuda()
        updater = VLLMUpdater(engine=llm, timeout_seconds=120)
        checked, expected = updater.push_weights(trained).checked_layers
        assert checked == expected > 0  # (no layer unverifiable: the projections by what vLLM quantized from)
        assert_holds_and_serves_as(llm, gpu_llm(bf16_checkpoint(trained, tmp_path / "reference"), **online))
        with torch.no_grad():
            trained.model.layers[0].mlp.up_proj.weight.add_(0.01)
        assert updater.push_weights(trained).checked_layers[0] == expected
        updater.close()
    finally:
        stop_llm(llm)
