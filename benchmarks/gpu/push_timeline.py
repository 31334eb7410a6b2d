"""Where a push's seconds go, for the benchmarks that push over ipc into vLLM's own engine (``ipc_push.py``,
``moe_ipc_push.py``): the floor of one device-to-device copy, timed pushes with each engine call and each stage
of the trainer's side marked, and the worker's own ``update_weights`` timed inside vLLM's worker."""

from __future__ import annotations

import statistics
import time

import torch
from figures import timed, wall_seconds
from vllm_engine import landed_exactly


def copy_floor(tensors: list[torch.Tensor], rounds: int, batched: bool = False, summed: bool = False) -> list[float]:
    """Seconds of a ``copy_`` of every tensor into a buffer of its own, allocated once (warmed first); ``batched``:
    one ``torch._foreach_copy_`` of them all instead (what a replay would be with no tensor copied alone); ``summed``:
    the copies that sum what they write, as a ``lightning_ipc`` replay makes them (``weights/gpu_sums.SummedCopies``,
    one owner per tensor)."""
    buffers = [torch.empty_like(tensor) for tensor in tensors]
    if summed:
        from lightning_vllm.weights.gpu_sums import SummedCopies

        summing = SummedCopies([(b, t, i) for i, (b, t) in enumerate(zip(buffers, tensors))], len(tensors))

    def copy() -> None:
        if summed:
            summing.run()
            return
        if batched:
            torch._foreach_copy_(buffers, tensors)
            return
        for buffer, tensor in zip(buffers, tensors):
            buffer.copy_(tensor)

    copy()
    seconds = timed(copy, rounds)
    buffers.clear()
    torch.cuda.empty_cache()
    return seconds


def timed_pushes(updater, model: torch.nn.Module, rounds: int, calls: dict[str, list[float]]):
    """Seconds of ``rounds`` pushes (the group joined by a first, untimed one), and the median push's stats;
    ``calls`` holds the timed pushes' control calls only."""
    updater.push_weights(model)
    for values in calls.values():
        values.clear()
    stats = []

    def push() -> None:
        PUSH_STARTS.append(time.perf_counter())
        stats.append(updater.push_weights(model))

    seconds = timed(push, rounds)
    return seconds, sorted(stats, key=lambda each: each.seconds)[len(stats) // 2]


PUSH_STARTS: list[float] = []  # when each timed push began (time.perf_counter: CLOCK_MONOTONIC, one clock per host)
CALL_STARTS: dict[str, list[float]] = {}  # when each control call began, by name
STAGES: dict[str, list[float]] = {}  # when each stage of the trainer's side of a push was reached, by name


def mark_stages() -> None:
    """Note when a push's trainer side reaches each of its stages (``STAGES``): checked (``WeightSync.prepare``
    returned), handed to the sender, on the transfer thread, the update info begun and built, the commit's calls made
    (``6_landed``: ``send_weights`` returned), the sender returned, the worker's copies waited for and landed, the
    check's trainer sums read, the engine's awaited and held against them, the push returned."""
    from vllm import LLM

    from lightning_vllm import VLLMUpdater
    from lightning_vllm.backends.lightning_ipc.trainer import KeptHandlesIPCTrainerEngine
    from lightning_vllm.backends.vllm_engines import VLLMEngineSender
    from lightning_vllm.core.landing_check import LandingCheck
    from lightning_vllm.core.weight_sync import WeightSync
    from lightning_vllm.weights import EngineWeights
    from lightning_vllm.weights.layer_sums import SentSums

    def marked(owner, name, before=None, after=None):
        original = getattr(owner, name)

        def call(*args, **kwargs):
            if before:
                STAGES.setdefault(before, []).append(time.perf_counter())
            result = original(*args, **kwargs)
            if after:
                STAGES.setdefault(after, []).append(time.perf_counter())
            return result

        setattr(owner, name, call)

    marked(WeightSync, "prepare", after="1_checked")
    # (Between checked and the sender: the check's tally of the held tensors, then their sums queued.)
    marked(EngineWeights, "tally_held", before="1b_tally_held", after="1c_tallied")
    marked(SentSums, "sum_held_meanwhile", after="1d_sums_queued")
    marked(VLLMEngineSender, "send", before="2_sender", after="7_sender_returned")
    marked(KeptHandlesIPCTrainerEngine, "send_weights", before="3_transfer_thread", after="6_landed")
    marked(KeptHandlesIPCTrainerEngine, "_update_info", before="4_update_info", after="5_update_info_built")
    marked(KeptHandlesIPCTrainerEngine, "wait_until_landed", before="6b_copies_waited_for", after="6c_copies_landed")
    marked(LandingCheck, "answered", before="6d_sums_came_with_the_copies")  # (lightning_ipc's landed sums)
    marked(LandingCheck, "push_ended", before="7b_push_ended", after="7c_trainer_sums_read")
    marked(LandingCheck, "check_result", before="7d_engine_sums_awaited", after="7e_checked")
    marked(VLLMUpdater, "push_weights", after="8_push_returned")
    # The commit's calls, made while the worker's copies run (lightning_ipc's worker returns once they are queued).
    marked(LLM, "update_weight_version", before="5b_version_call", after="5c_version_set")
    marked(LLM, "reset_prefix_cache", after="5d_prefix_cache_reset")


CONTROL_CALLS = (
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
    "update_weights_in_one_call",
    "pause_generation",
    "resume_generation",
    "reset_prefix_cache",
    "layer_sums",
)


def time_control_calls() -> dict[str, list[float]]:
    """Time every control call a push makes to an in-process engine (``LocalLLMEngine``), by name."""
    from lightning_vllm.engines.local import LocalLLMEngine

    seconds: dict[str, list[float]] = {name: [] for name in CONTROL_CALLS}
    for name in CONTROL_CALLS:
        call = getattr(LocalLLMEngine, name)

        def timed_call(self, *args, _call=call, _name=name, **kwargs):
            start = time.perf_counter()
            CALL_STARTS.setdefault(_name, []).append(start)
            try:
                return _call(self, *args, **kwargs)
            finally:
                seconds[_name].append(time.perf_counter() - start)

        setattr(LocalLLMEngine, name, timed_call)
    return seconds


def time_workers(llm) -> None:
    """Time, inside vLLM's worker, each ``update_weights`` (:func:`time_worker_updates`) and each check report
    (:func:`time_worker_reports`): what :func:`push_figures` reads back."""
    time_worker_updates(llm)
    time_worker_reports(llm)


def time_worker_updates(llm) -> None:
    """Time, inside vLLM's worker, each ``update_weights`` of its transfer engine (no RPC): what the worker's
    own load costs, read back by :func:`worker_update_seconds`."""

    def instrument(worker) -> None:  # runs in vLLM's worker (cloudpickled: defined here)
        import time

        import torch

        engine = worker.weight_transfer_engine
        original = engine.update_weights
        engine.timed_updates = []
        engine.device_spans = []  # CUDA events around each update's queued work: the copies' device time

        def timed(update_info):
            started = time.perf_counter()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            try:
                return original(update_info)
            finally:
                end.record()
                engine.timed_updates.append((started, time.perf_counter() - started))
                engine.device_spans.append((begin, end))

        engine.update_weights = timed

    llm.collective_rpc(instrument)


def time_worker_reports(llm) -> None:
    """Note, inside vLLM's worker, when each of its check reports (``held_sums.worker_layer_sums``) began, began
    reading its sums (the wait for the device), had read them and ended; read back by :func:`worker_reports`."""

    def instrument(worker) -> None:  # runs in vLLM's worker
        import time

        from lightning_vllm.weights import held_sums

        marks = worker.report_marks = []
        report, read = held_sums.worker_layer_sums, held_sums.sums_as_ints

        def timed_report(*args, **kwargs):
            marks.append({"began": time.perf_counter()})
            result = report(*args, **kwargs)
            marks[-1]["ended"] = time.perf_counter()
            return result

        def timed_read(*args, **kwargs):
            if marks and "reading" not in marks[-1]:
                marks[-1]["reading"] = time.perf_counter()
            result = read(*args, **kwargs)
            if marks and "read" not in marks[-1]:
                marks[-1]["read"] = time.perf_counter()
            return result

        held_sums.worker_layer_sums, held_sums.sums_as_ints = timed_report, timed_read

    llm.collective_rpc(instrument)


def worker_reports(llm) -> list[dict[str, float]]:
    """The marks :func:`time_worker_reports` noted since the last call (and forgets them)."""

    def read(worker) -> list[dict[str, float]]:  # runs in vLLM's worker
        marks = list(getattr(worker, "report_marks", []))
        worker.report_marks.clear()
        return marks

    return llm.collective_rpc(read)[0]


def worker_update_seconds(llm) -> list[tuple[float, float]]:
    """When the worker's ``update_weights`` began and its seconds, since the last call (and forgets them)."""

    def read(worker) -> list[tuple[float, float]]:  # runs in vLLM's worker
        seconds = list(getattr(worker.weight_transfer_engine, "timed_updates", []))
        worker.weight_transfer_engine.timed_updates = []
        return seconds

    return llm.collective_rpc(read)[0]


def worker_device_seconds(llm) -> list[float]:
    """The device time of the work each ``update_weights`` queued (its copies), since the last call (and forgets
    them): against the copy floor, whether the worker's copies run at the floor's speed."""

    def read(worker) -> list[float]:  # runs in vLLM's worker
        import torch

        spans = list(getattr(worker.weight_transfer_engine, "device_spans", []))
        worker.weight_transfer_engine.device_spans = []
        torch.cuda.synchronize()
        return [begin.elapsed_time(end) / 1e3 for begin, end in spans]

    return llm.collective_rpc(read)[0]


def push_figures(llm, model, label: str, rounds: int, calls, **options) -> dict[str, object]:
    """``rounds`` timed pushes of ``model`` into ``llm`` with ``options``, the last checked by digest."""
    from gpu_helpers import trainer_engine

    from lightning_vllm import VLLMUpdater

    updater = VLLMUpdater(engine=llm, timeout_seconds=300, changed_only=False, **options)
    CALL_STARTS.clear()
    PUSH_STARTS.clear()
    STAGES.clear()
    seconds, middle = timed_pushes(updater, model, rounds, calls)
    reports = worker_reports(llm)[-rounds:]
    worker_updates = worker_update_seconds(llm)[-rounds:]  # the timed pushes' (the first joined the group)
    worker_seconds = [spent for _, spent in worker_updates]
    device_seconds = worker_device_seconds(llm)[-rounds:]
    # Where the push's time goes before the copies can start: the trainer until it calls the engine, then the
    # call until the worker's update begins (one clock: the same host).
    name = "update_weights_in_one_call" if CALL_STARTS.get("update_weights_in_one_call") else "update_weights"
    call_starts, push_starts = CALL_STARTS.get(name, [])[-rounds:], PUSH_STARTS[-rounds:]
    timeline = {}
    if len(call_starts) == len(push_starts) == len(worker_updates) == rounds:
        timeline = {
            "trainer_until_the_call_seconds": statistics.median(c - p for c, p in zip(call_starts, push_starts)),
            "call_until_the_worker_seconds": statistics.median(w - c for (w, _), c in zip(worker_updates, call_starts)),
            "worker_update_ends_after_push_start_seconds": statistics.median(
                w + spent - p for (w, spent), p in zip(worker_updates, push_starts)
            ),
        }
        for stage, times in sorted(STAGES.items()):
            if len(times) >= rounds:
                timeline[f"stage_{stage}_after_push_start_seconds"] = statistics.median(
                    t - p for t, p in zip(times[-rounds:], push_starts)
                )
        # The check's question: when the trainer asked, when the worker's report began, waited for the device, had
        # its sums and ended, and when the answer was back (the call's end).
        asked = CALL_STARTS.get("layer_sums", [])[-rounds:]
        if len(asked) == rounds and len(reports) == rounds and all(len(r) == 4 for r in reports):
            answered = [a + s for a, s in zip(asked, calls["layer_sums"][-rounds:])]
            for label, times in [("engine_sums_asked", asked), ("engine_sums_answered", answered)] + [
                (f"worker_report_{mark}", [r[mark] for r in reports]) for mark in ("began", "reading", "read", "ended")
            ]:
                timeline[f"{label}_after_push_start_seconds"] = statistics.median(
                    t - p for t, p in zip(times, push_starts)
                )
    landed = landed_exactly(llm, model)
    # lightning_ipc's trainer engine counts the handles it exported (the rest named a kept slot).
    handles_sent = getattr(trainer_engine(updater), "handles_sent", None)
    updater.close()

    def replayed(worker) -> int:  # runs in vLLM's worker: loads replayed from lightning_ipc's records so far
        loads = getattr(worker.weight_transfer_engine, "loads", None)
        return -1 if loads is None else int(loads.replayed)

    def written(worker) -> tuple[int, int]:  # runs in vLLM's worker: parameters its last load summed as it wrote
        sums = getattr(worker.weight_transfer_engine, "written_sums", lambda: None)()
        return len(sums or {}), sum(1 for _ in worker.get_model().parameters())

    # The check's question to the worker, alone.
    report_seconds = wall_seconds(lambda: llm.collective_rpc("lightning_vllm_layer_sums"), 3)

    return {
        "handles_sent": handles_sent,
        "checks_answered_with_the_copies": len(STAGES.get("6d_sums_came_with_the_copies", [])),
        "worker_update_seconds": statistics.median(worker_seconds) if worker_seconds else None,
        "worker_device_seconds": statistics.median(device_seconds) if device_seconds else None,
        "loads_replayed": llm.collective_rpc(replayed)[0],
        "parameters_summed_as_written": llm.collective_rpc(written)[0],
        "worker_report_seconds": statistics.median(report_seconds),
        "seconds": seconds,
        "landed_exactly": landed,
        "transfer_seconds": middle.timing.transfer_seconds,
        "commit_seconds": middle.timing.commit_seconds,
        "pause_seconds": middle.timing.pause_seconds,
        "check_seconds": middle.timing.check_seconds,
        "gb_per_second": middle.gb_per_second,
        "calls": {name: statistics.median(values) for name, values in calls.items() if values},
        "timeline": timeline,
    }
