"""One engine's connection: the checks before any byte moves, the transfer group, a push, and where its seconds went.

``WeightSync`` holds one :class:`EngineConnection` per engine. Opening it finds the engine's backend (``backends/``)
and lets it check the trainer and the engine, checks the tensor-parallel size and the metadata against the engine's
model, fixes what the engine is sent (``engine_metadata``: its names and serving dtypes), then has the backend join a
group with the engine's workers. A push sends the weights through the backend's sender, commits the version in the
same call that finishes the update and resets the prefix cache; generation pauses only as the backend's traits need.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import astuple, dataclass
from typing import Any

from typing_extensions import Self

from lightning_vllm._waits import BackgroundCall, call_with_timeout
from lightning_vllm.backends.base import Backend, GroupSettings, Sender
from lightning_vllm.backends.registry import backend_for_engine, carrying
from lightning_vllm.core import after_failure
from lightning_vllm.core.after_failure import end_failed_update
from lightning_vllm.core.facts import EngineFacts, lora_facts
from lightning_vllm.core.landing_check import Checked, LandingCheck
from lightning_vllm.engines import EngineTarget
from lightning_vllm.engines.base import (
    FollowsUpdaterTimeout,
    GeneratesOnlyInCalls,
    PolicyAdapter,
    UpdatesInOneCall,
    mixed_weight_version,
    version_number,
)
from lightning_vllm.engines.client import CommitWindow, TimedClient
from lightning_vllm.engines.sleep import FoundAsleep, after_push, sleeping_engine, wake_for_push
from lightning_vllm.errors import EngineConfigError
from lightning_vllm.in_vllm.lora_adapters import ADAPTER_PREFIX
from lightning_vllm.lora.adapter import adapter_metadata
from lightning_vllm.lora.serving import LoraLimits
from lightning_vllm.options import UpdaterOptions
from lightning_vllm.weights import EngineWeights, ModelMetadata, check_weights
from lightning_vllm.weights.base import SentStamps
from lightning_vllm.weights.checks import (
    ExpectedWeights,
    check_tied_output_embedding,
    loaded_by_engine,
    metadata_for_engine,
)
from lightning_vllm.weights.model import metadata_bytes, smallest_group
from lightning_vllm.weights.payload import Outgoing, Payload

log = logging.getLogger(__name__)

# How many timeout_seconds forming a group may take at most: the workers' side is bounded by one,
# after which vLLM raises the trainer side's error; more than that is NCCL's init stuck.
_RENDEZVOUS_GRACE = 1.5


@dataclass(frozen=True)
class PushTiming:
    """Where the seconds of a push to an engine went, so that a slow link tells itself from a slow engine.

    Attributes:
        transfer_seconds: moving the bytes (the sender's work, the commit left out): what ``GB/s`` is of.
        commit_seconds: the call that finishes the update, and around it the commit window (on ``gloo`` the engine
            loads everything there; vLLM's backends loaded while receiving).
        pause_seconds: how long the engine's generation was paused (around the whole transfer when the backend loads
            while receiving, around the commit otherwise).
        check_seconds: the check after the push (``verify_pushes``): the engine's per-layer sums against the trainer's.
    """

    transfer_seconds: float = 0.0
    commit_seconds: float = 0.0
    pause_seconds: float = 0.0
    check_seconds: float = 0.0

    def __add__(self, other: PushTiming) -> PushTiming:
        return PushTiming(*(mine + theirs for mine, theirs in zip(astuple(self), astuple(other))))


@dataclass(frozen=True)
class Pushed:
    """What one push to one engine did: its bytes sent, where the seconds went, and the version it committed.

    Attributes:
        num_bytes: the bytes sent (0: nothing changed since the last push; only the version moved).
        timing: where the seconds went (:class:`PushTiming`; ``check_seconds`` is the caller's).
        version: the weight version the engine committed.
    """

    num_bytes: int
    timing: PushTiming
    version: int


class EngineConnection:
    """A formed transfer group with one engine, and what the engine loads (``engine_metadata``).

    ``committed_version`` is the last version the engine committed: the one it served when the group formed (0 if
    none was pushed), so that an updater that connects to an engine another trainer pushed to continues after it,
    then each push's that landed (a failed streaming push's mix names it). ``has_policy_base`` says whether this
    connection gave the engine the policy's base weights (with an adapter), after which an adapter push sends the
    adapter alone. Build it with :meth:`open`; push with :meth:`push`; release it with :meth:`close`. Every call to
    the engine is bounded by the options' ``timeout_seconds``.
    """

    def __init__(
        self,
        engine: EngineTarget,
        options: UpdaterOptions,
        client: TimedClient,
        backend: Backend,
        sender: Sender,
        engine_metadata: ModelMetadata,
        ties_word_embeddings: bool,
        reported_version: int = 0,
    ) -> None:
        self.engine = engine
        self.committed_version = reported_version
        self.options = options
        self.client = client
        self.backend = backend
        self.sender = sender
        self.engine_metadata = engine_metadata
        self.ties_word_embeddings = ties_word_embeddings
        self.device = sender.device  # where a push's tensors go first (None: they stay where they are)
        self.has_policy_base = False
        # (Asked once: an engine that generates only inside its calls has nothing to pause.)
        self._pauses = not (isinstance(engine, GeneratesOnlyInCalls) and engine.generates_only_in_calls())
        self._all_bytes = metadata_bytes(engine_metadata)  # (summed once: a push of every tensor sends these)
        self.sent = SentStamps()  # what this engine holds from this connection's pushes
        self.landing = LandingCheck.for_engine(engine, options.verify_pushes, options.timeout_seconds)
        # Where this connection's adapter pushes are staged on the engine's host: a key of its own,
        # so engines sharing a host, and later connections, never read each other's adapter.
        self.adapter = PolicyAdapter(key=uuid.uuid4().hex)
        self._lora_facts: tuple[LoraLimits | None, ExpectedWeights | None, list[str]] | None = None
        self._sleeps = sleeping_engine(engine)  # (None: built without sleep mode, never asked about it)
        self._found_asleep: FoundAsleep | None = None

    @classmethod
    def open(cls, engine: EngineTarget, metadata: ModelMetadata, options: UpdaterOptions, index: int = 0) -> Self:
        """Check ``engine`` (the engine at ``index``) and ``metadata``, then join a group with its workers.

        Blocks until every worker has joined, at most ``timeout_seconds``.

        Raises:
            EngineConfigError: the engine is not set up for this backend or tensor-parallel size.
            WeightsMismatchError: the metadata does not fit the engine's model.
            WeightSyncTimeoutError: the engine or its workers did not answer in time.
        """

        def bounded(fn: Callable[..., Any], what: str) -> Any:
            return call_with_timeout(fn, timeout=options.timeout_seconds, what=what)

        if isinstance(engine, FollowsUpdaterTimeout):  # a server's requests wait as long as the updater does
            engine.follow_timeout(options.timeout_seconds)
        after_failure.wait_for(engine, options.timeout_seconds)

        configured = bounded(engine.transfer_backend, f"{engine.description} to describe itself")
        backend = backend_for_engine(options.backend, configured, engine.description)
        backend.check_trainer()
        backend.check_engine(engine, options.timeout_seconds)
        tp_size = engine.tensor_parallel_size()
        if options.vllm_tp_size is not None and options.vllm_tp_size != tp_size:
            raise EngineConfigError(
                f"vllm_tp_size={options.vllm_tp_size} but the engine runs with tensor_parallel_size={tp_size}; "
                f"pass vllm_tp_size={tp_size} or leave it None."
            )
        expected = bounded(engine.expected_weights, "the engine's model facts")
        engine_metadata, ties = metadata_for_engine(expected, metadata, engine.description)
        reported_version = version_number(bounded(engine.get_weight_version, f"{engine.description}'s weight version"))
        if reported_version:
            log.info(
                "%s serves weight version %d: the next push counts on from it.", engine.description, reported_version
            )
        client = TimedClient(engine, options.timeout_seconds)
        world_size = 1 + bounded(engine.num_workers, "the engine's world size")
        settings = GroupSettings(
            master_address=options.address,
            master_port=options.engine_port(index),
            world_size=world_size,
            bucket_size_bytes=options.bucket_size_bytes,
            timeout_seconds=options.timeout_seconds,
            largest_tensor_bytes=max((metadata_bytes({name: m}) for name, m in engine_metadata.items()), default=0),
            sends_as_held=all(metadata[name][0] == dtype for name, (dtype, _) in engine_metadata.items()),
            updates_in_one_call=isinstance(engine, UpdatesInOneCall),
        )
        # A trainer killed inside an earlier push's commit window (between pause and resume) left the engine paused; a
        # new connection is where that ends. Not for a sleeping engine: its KV cache may be gone (vLLM 44395).
        sleeps = sleeping_engine(engine)
        if sleeps is None or not bounded(sleeps.sleep_state, f"{engine.description}'s sleep state").asleep:
            bounded(engine.resume_generation, f"{engine.description} to resume generation")
        log.info("Joining %s's %d worker(s) over %s", engine.description, world_size - 1, backend.name)
        # The worker's side of the rendezvous is bounded by the client; the outer bound catches a
        # trainer endpoint stuck in NCCL's own init, which has no timeout.
        sender = call_with_timeout(
            backend.join,
            settings,
            client,
            engine_metadata,
            timeout=options.timeout_seconds * _RENDEZVOUS_GRACE,
            what=f"the {backend.name} group with {engine.description}'s workers to form",
        )
        return cls(engine, options, client, backend, sender, engine_metadata, ties, reported_version)

    def facts(self) -> EngineFacts:
        """What a push's choice needs of this engine (``core/payload_choice.py``); its LoRA side is asked once."""
        limits, expected, problems = self._engine_lora_facts()
        return EngineFacts(
            self.engine.description, self.backend.traits, limits, expected, tuple(problems), self.has_policy_base
        )

    def _engine_lora_facts(self) -> tuple[LoraLimits | None, ExpectedWeights | None, list[str]]:
        if self._lora_facts is None:
            self._lora_facts = lora_facts(self.engine, self.backend, self._call)
        return self._lora_facts

    def check(self, payload: Payload, offered: ModelMetadata) -> None:
        """Check that ``payload`` (whose weights' metadata is ``offered``) fits this engine; nothing is sent.

        An adapter push is checked on its base weights, if it carries them; the adapter
        itself was judged when it was chosen.

        Raises:
            WeightsMismatchError: names, shapes, dtypes or tied embeddings do not fit.
            EngineConfigError: every trainer rank is to send a share, which this backend cannot carry.
        """
        if payload.every_rank is not None and not self.backend.traits.carries_shares:
            raise EngineConfigError(
                f"push_from='every_rank' sends each trainer rank's share over the "
                f"{' or '.join(carrying('carries_shares'))} backend, but the {self.engine.description} engine uses "
                f"{self.backend.name!r}. Pass push_from='rank0' for it."
            )
        base = {name: meta for name, meta in offered.items() if not name.startswith(ADAPTER_PREFIX)}
        if payload.carries_adapter and not base:
            return
        offered_here = loaded_by_engine(base, self.ties_word_embeddings)
        check_weights(self.engine_metadata, offered_here, what="The weights pushed")
        if self.ties_word_embeddings:
            check_tied_output_embedding(payload.weights, offered)

    def push(self, payload: Payload, version: int) -> Pushed:
        """Send ``payload`` and commit it as ``version``; returns what it did. With ``payload.every_rank``, the
        other trainer ranks send their shares of each tensor at the same time (``weights/shares.py``).

        With the gloo backend the workers receive the whole update while the engine keeps generating with its
        current weights, and generation is paused only around the call that loads and commits it (then the prefix
        cache is reset). With vLLM's own backends, which load while receiving, generation is paused around the whole
        transfer. A push that fails closes the connection (the next push opens a new one); the engine resumes anyway.

        A payload that carries a LoRA adapter: the workers stage it for vLLM's LoRA loader, and from the commit on
        the engine generates through it.
        """
        # Workers that receive the whole update while vLLM serves and load it inside finish_weight_update need
        # generation paused around that call only.
        pause_for_transfer = self.backend.traits.loads_while_receiving
        adapter = self.adapter if payload.adapter_config is not None else None
        options = self.options
        # vLLM's push into a sleeping engine crashes its core (57853): the weights wake first, and dropped ones are
        # all sent. A sleeping engine schedules nothing, and resuming it with its KV cache asleep would (44395).
        found = self._found_asleep = wake_for_push(self._sleeps, options.timeout_seconds) if self._sleeps else None
        if found is not None and found.weights_dropped:
            self.sent = SentStamps()
        window = CommitWindow(
            self.engine, options.timeout_seconds, options.pause_mode, options.reset_prefix_cache, adapter,
            pause_at_finish=not pause_for_transfer, pauses=self._pauses and not (found and found.state.asleep),
        )  # fmt: skip
        if pause_for_transfer:
            window.pause()
        names = self._names_to_send(payload)
        outgoing = self._outgoing(payload, names, version, window)
        started = time.perf_counter()
        try:
            copying = self.sender.send(outgoing)
            if copying is not None:  # committed, its copies still running on the engine's device
                if self.landing:
                    if not copying.brings_sums:
                        self.landing.ask_engine()  # (answered once they end: the question's round trip overlaps them)
                    self.landing.copies_running()
                reports = copying.wait()
                if self.landing and reports is not None:
                    self.landing.answered(reports)
        except BaseException:
            if self.landing:
                self.landing.push_ended(committed=False)
            # The engine may be frozen or gone: release its side without waiting, so the error reaches the caller
            # within timeout_seconds. vLLM's engines may be left inside the update, with some of it loaded if any
            # was sent: then they report the mix (after_failure.py).
            sent_some = pause_for_transfer and outgoing.client.updates_sent > 0
            mixed = mixed_weight_version(self.committed_version, version) if sent_some else None
            self.close(wait=False, open_update=window if pause_for_transfer else None, mixed_version=mixed)
            raise
        sent_seconds = time.perf_counter() - started
        self.committed_version = version
        if pause_for_transfer:
            window.resume()
        timing = PushTiming(sent_seconds - window.commit_seconds, window.commit_seconds, window.pause_seconds)
        return Pushed(self._record_committed(payload, names), timing, version)

    def _names_to_send(self, payload: Payload) -> ModelMetadata:
        """The engine's names and dtypes of what ``payload`` sends this engine: an adapter's under the engine's LoRA
        dtype; with ``changed_only``, without the layer groups the engine holds already as this connection last sent
        them (``weights/base.py``)."""
        if payload.carries_adapter:
            limits = self._engine_lora_facts()[0]
            names = adapter_metadata(self.engine_metadata, payload.weights, limits.lora_dtype if limits else None)
        else:
            names = self.engine_metadata
        stamps = payload.stamps if self.options.changed_only else None
        if stamps is None:
            return names
        groups = EngineWeights(payload.weights, names).groups()
        unchanged = self.sent.unchanged(groups, stamps)
        if self.backend.traits.sends_every_push and len(unchanged) == len(names):  # (vLLM's nccl: see Traits)
            unchanged -= set(smallest_group(groups, names))
        if not unchanged:
            return names
        return {name: meta for name, meta in names.items() if name not in unchanged}

    def _outgoing(self, payload: Payload, names: ModelMetadata, version: int, window: CommitWindow) -> Outgoing:
        """What the backend's sender is handed for one push: the tensors under ``names``, counted for the landing
        check; the client that commits ``version`` inside ``window``; the adapter's message."""
        adapter = window.adapter
        landing = self.landing
        sums = landing.tally_for(payload.view != "adapter", payload.every_rank) if landing else None
        # vLLM's engines send the tensors they are given, from the trainer's GPU; ours converts on the way.
        sent = EngineWeights(payload.weights, names, device=self.device, sums=sums)
        if sums is not None and sent.tally_held():  # (the model's own tensors, summed apart: SentSums says how)
            sums.sum_held_meanwhile()
        client = self.client.committing(str(version), window)
        adapter_message = adapter.message(payload.adapter_config) if adapter and payload.adapter_config else None
        return Outgoing(
            sent,
            client,
            adapter_message,
            payload.every_rank,
            what=f"the {self.backend.name} transfer to {self.engine.description}",
            checked=sums is not None,
        )

    def _record_committed(self, payload: Payload, names: ModelMetadata) -> int:
        """After a push committed: what the engine now holds (its base, the stamps of what was sent, the landing
        check's tally); returns the bytes sent."""
        if payload.adapter_config is None:
            self.has_policy_base = False  # merged weights replaced the base
        elif any(not name.startswith(ADAPTER_PREFIX) for name in names):
            self.has_policy_base = True  # the base weights went with the adapter
        self.sent.record(names, payload.stamps if self.options.changed_only else None)
        if self.landing:
            self.landing.push_ended(committed=True)
        return self._all_bytes if names is self.engine_metadata else metadata_bytes(names)

    def check_result(self) -> Checked:
        """After a push that committed: what the check found (``landing_check.Checked``); if a layer differs, the
        next push sends every tensor again. An engine the push found asleep is then settled (``sleep.after_push``)."""
        result = self.landing.check_result() if self.landing else Checked()
        if result.differing:
            self.sent = SentStamps()
        if self._sleeps is not None and self._found_asleep is not None:  # (checked first: a sleeping layer is unmapped)
            keep_awake = self.options.sleep_level is not None
            after_push(self._sleeps, self._found_asleep, self.options.timeout_seconds, keep_awake=keep_awake,
                       mode=self.options.pause_mode)  # fmt: skip
        return result

    def close(
        self, wait: bool = True, open_update: CommitWindow | None = None, mixed_version: str | None = None
    ) -> None:
        """Leave the group and release the engine's side of it; the engine keeps serving.

        Args:
            wait: wait (at most ``timeout_seconds`` a call) for the engine; ``False`` asks on a background thread
                and returns at once (the next connection waits for it).
            open_update: the window of a failed ``nccl``/``ipc`` push, which may have left the engine inside the
                update, paused: it is closed (under ``mixed_version``, if given), generation resumes through the
                window, then the engine's side is released.
        """
        self.sender.shutdown()

        def release() -> None:
            if open_update is not None:
                end_failed_update(self.client, open_update.resume, self.engine, mixed_version)
            try:
                self.client.shutdown_weight_transfer_engine()
            except Exception as error:  # the engine may be gone; nothing left to release then
                log.warning("Could not release the weight-transfer engine of %s: %s", self.engine.description, error)

        if not wait:
            after_failure.started(self.engine, BackgroundCall(release, what=f"{self.engine.description} to release"))
            return
        release()

    def _call(self, fn: Callable[..., Any], *args: Any, what: str) -> Any:
        return call_with_timeout(fn, *args, timeout=self.options.timeout_seconds, what=what)
