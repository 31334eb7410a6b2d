"""Self-check on CPU of the GPU harness, for everything that needs no CUDA.

Digests, building and loading by name (tied and untied embeddings), the receiver process and its
pipe protocol (versions, errors raised again in the trainer, answers while an update is blocked,
a kill mid-update), the adapter's facts against lightning_vllm's checks, vLLM's worker engines
built without a VllmConfig, and a real push through ``VLLMUpdater`` into the receiver over
lightning_vllm's gloo backend (vLLM's NCCL and IPC engines need CUDA; ``runs.py`` uses them).

Run from the project root: ``.venv/bin/python benchmarks/gpu/check_cpu.py`` (prints ``ok`` lines, raises on failure).
To check against vLLM 0.33's sources instead of the installed vLLM, put them first on ``PYTHONPATH``.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

import hf_models  # noqa: E402
import torch  # noqa: E402
from engine import ReceiverDied, ReceiverEngine, ReceiverError  # noqa: E402
from hf_models import build_model, digest, load_weights, mismatches, model_digests  # noqa: E402
from receiver import make_engine  # noqa: E402

from lightning_vllm import EngineTarget, VLLMUpdater  # noqa: E402
from lightning_vllm.weights.checks import check_weights, loaded_by_engine  # noqa: E402


def ok(what: str) -> None:
    print(f"ok  {what}", flush=True)


def raises(error_type: type[BaseException], call: Callable[..., object], *args: object) -> BaseException:
    try:
        call(*args)
    except error_type as error:
        return error
    raise AssertionError(f"{call} did not raise {error_type.__name__}")


def check_digests() -> None:
    tensor = torch.randn(5000, dtype=torch.bfloat16)
    assert digest(tensor) == digest(tensor.clone())
    flipped = tensor.clone()
    flipped.view(torch.int16)[1234] ^= 1  # the lowest mantissa bit of one element
    assert digest(flipped)[2] != digest(tensor)[2] and digest(flipped)[3] != digest(tensor)[3]
    swapped = tensor.clone()
    swapped[[10, 11]] = tensor[[11, 10]]
    assert tensor[10] != tensor[11] and digest(swapped)[3] != digest(tensor)[3]
    wide = torch.randn(3, 7)  # float32: read as pairs of 16-bit integers
    whole = digest(tensor), digest(wide)
    chunk, hf_models.DIGEST_CHUNK = hf_models.DIGEST_CHUNK, 7  # sums over other chunks, in another order
    try:
        assert (digest(tensor), digest(wide)) == whole
    finally:
        hf_models.DIGEST_CHUNK = chunk
    ok("digests: equal for equal bits, differ for one flipped bit and for a swap, independent of chunking")


def check_loading(name: str) -> None:
    config = hf_models.MODELS[name]()
    source, target = build_model(config, "cpu", seed=0), build_model(config, "cpu", seed=1)
    assert all(p.dtype == torch.bfloat16 for p in source.parameters())
    assert mismatches(model_digests(source), model_digests(target)), "two seeds, same weights"
    everything = dict(source.named_parameters(remove_duplicate=False))  # lm_head.weight too, tied or not
    load_weights(target, everything.items())
    assert not mismatches(model_digests(source), model_digests(target))
    tied = config.tie_word_embeddings
    assert (target.lm_head.weight is target.model.embed_tokens.weight) == tied
    raises(KeyError, load_weights, target, [("model.nope.weight", torch.zeros(1))])
    wrong = everything["model.norm.weight"].float()
    raises(ValueError, load_weights, target, [("model.norm.weight", wrong)])
    ok(f"{name}: bfloat16 build, load_weights by name (tied={tied}), unknown names and dtypes refused")


def check_vllm_engines() -> None:
    from vllm.distributed.weight_transfer import nccl_common
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo

    model = build_model(hf_models.qwen2_tiny(), "cpu", seed=0)
    model.load_weights = lambda weights: load_weights(model, weights)
    nccl = make_engine("nccl", model, torch.device("cpu"))
    worker_info = NCCLWeightTransferInitInfo(
        master_address="127.0.0.1", master_port=29555, rank_offset=1, world_size=2, packed=True
    )
    try:  # what vLLM 0.33's trainer engine sends at trainer_init
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        payload = NCCLTrainerWeightTransferEngine._build_worker_init_payload(
            NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=29555, world_size=2, packed=True, rank=0)
        )
    except AttributeError:  # vLLM 0.32
        payload = {key: value for key, value in asdict(worker_info).items() if value is not None}
    parsed = nccl.parse_init_info(payload)
    assert parsed.packed and parsed.world_size == 2
    group_rank = getattr(nccl_common, "_worker_group_rank", None)  # vLLM 0.33: the rank this worker joins as
    assert group_rank is None or group_rank(parsed.rank_offset, nccl.parallel_config) == 1
    update = nccl.parse_update_info(asdict(NCCLWeightTransferUpdateInfo(["a"], ["bfloat16"], [[2, 3]])))
    assert update.names == ["a"]
    nccl.start_weight_update(), nccl.finish_weight_update(), nccl.shutdown()  # no layerwise reload, nothing held
    ipc = make_engine("ipc", model, torch.device("cpu"))
    ipc.init_transfer_engine(ipc.parse_init_info({"packed": True}))
    assert ipc.packed and ipc.model is model
    ipc.start_weight_update(), ipc.finish_weight_update(), ipc.shutdown()
    import vllm

    ok(f"vLLM {vllm.__version__}'s NCCL and IPC worker engines built without a VllmConfig; init and update infos parse")


def check_receiver(name: str) -> None:
    config = hf_models.MODELS[name]()
    trainer_model = build_model(config, "cpu", seed=0)
    with ReceiverEngine(config, device="cpu", backend="pipe", stall_update_seconds=1.0, call_timeout=60) as engine:
        assert isinstance(engine, EngineTarget)
        facts = (engine.transfer_backend(), engine.device_type(), engine.tensor_parallel_size(), engine.num_workers())
        assert facts == ("pipe", "cpu", 1, 1), facts
        expected = engine.expected_weights()
        assert expected is not None and expected.ties_word_embeddings == config.tie_word_embeddings
        metadata = VLLMUpdater.get_model_metadata(trainer_model)
        check_weights(expected.weights, loaded_by_engine(metadata, expected.ties_word_embeddings), what="metadata")
        assert engine.prompt_limits().vocab_size == config.vocab_size and not engine.is_dead()
        raises(ValueError, engine.generate, [[1, 2]], None)
        engine.pause_generation("keep"), engine.resume_generation(), engine.reset_prefix_cache()
        assert engine.get_weight_version() == "default"
        ours = model_digests(trainer_model)
        random_init = [n for n in ours if "norm" not in n and "bias" not in n]  # norms start at 1, biases at 0
        assert set(random_init) <= set(mismatches(ours, engine.checksum())), "the receiver has the trainer's weights"

        error = raises(RuntimeError, engine.update_weights, {"tensors": []})
        assert "start_weight_update" in str(error) and isinstance(error.__cause__, ReceiverError)
        assert "Traceback" in str(error.__cause__)
        params = dict(trainer_model.named_parameters(remove_duplicate=False))
        update = {"tensors": [(n, hf_models.tensor_to_bytes(params[n])) for n in metadata]}
        engine.init_weight_transfer_engine({})
        engine.start_weight_update()
        receiving = threading.Thread(target=engine.update_weights, args=(update,))
        receiving.start()
        time.sleep(0.3)
        start = time.perf_counter()
        assert engine.get_weight_version() == "default" and receiving.is_alive()
        answered = time.perf_counter() - start
        receiving.join(30)
        engine.finish_weight_update("1")
        assert engine.get_weight_version() == "1" and not mismatches(ours, engine.checksum())
        state = {n: hf_models.tensor_from_bytes(packed) for n, packed in engine.state().items()}
        assert all(
            torch.equal(state[n].view(torch.int16), p.view(torch.int16)) for n, p in params.items() if n in state
        )
        nbytes = sum(p.numel() * p.element_size() for p in trainer_model.parameters())
        assert engine.stats()["loaded_bytes_last_update"] == nbytes
        ok(
            f"{name}: facts fit lightning_vllm's checks; versions default -> 1; bit-exact after an update; "
            f"a version query answered in {answered * 1000:.0f} ms during a blocked update_weights"
        )

        engine.start_weight_update()
        error = raises(KeyError, engine.update_weights, {"tensors": [("model.nope.weight", update["tensors"][0][1])]})
        assert isinstance(error.__cause__, ReceiverError) and engine.stats()["updating"] is False
        assert engine.get_weight_version() == "1"
        ok(f"{name}: the receiver's KeyError raised again in the trainer; the update closed, version kept")

        engine.start_weight_update()
        failure: list[BaseException] = []
        receiving = threading.Thread(target=lambda: failure.append(raises(ReceiverDied, engine.update_weights, update)))
        receiving.start()
        time.sleep(0.3)
        start = time.perf_counter()
        engine.kill()
        receiving.join(10)
        assert failure and engine.is_dead() and time.perf_counter() - start < 10
        raises(ReceiverDied, engine.get_weight_version)
        ok(f"{name}: kill() mid-update: the call in flight raised ReceiverDied, is_dead() is True")


def check_gloo_push() -> None:
    config = hf_models.qwen2_tiny()
    model = build_model(config, "cpu", seed=0)
    with ReceiverEngine(config, device="cpu", backend="gloo", call_timeout=60) as engine:
        updater = VLLMUpdater(engine=engine, backend="gloo", master_address="127.0.0.1", timeout_seconds=30)
        updater.init(VLLMUpdater.get_model_metadata(model))
        for version in (1, 2):
            with torch.no_grad():
                model.model.norm.weight.add_(1.0)
            stats = updater.push_weights(model)
            assert stats.weight_version == version and engine.get_weight_version() == str(version)
            assert not mismatches(model_digests(model), engine.checksum())
        updater.close()
    ok("VLLMUpdater.init + push_weights into the receiver (gloo): versions 1, 2, bit-exact after each")


def main() -> None:
    check_digests()
    for name in ("qwen2-tiny", "llama-tiny"):
        check_loading(name)
    check_vllm_engines()
    for name in ("qwen2-tiny", "llama-tiny"):
        check_receiver(name)
    check_gloo_push()
    print("all CPU checks passed")


if __name__ == "__main__":
    main()
