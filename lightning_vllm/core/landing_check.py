"""The check after every push to one engine: what its workers hold, per layer, against what was sent.

While a push is on the wire, each tensor is summed on the trainer's device as the engine gets it
(``weights/layer_sums.SentSums``: exact integer fingerprints); once the push has committed, the engine's workers sum
what they hold (``weights/held_sums.py``, asked by the name our plugin gives every worker:
``engines/worker_check.py``; over ``lightning_ipc`` they leave their sums in the trainer's memory as the push lands,
and nothing is asked: ``backends/lightning_ipc/sums_mailbox.py``) and the two are compared layer by layer. A layer
whose fingerprint differs, or whose pack was built from other values than it holds, is named in
``LandedWeightsMismatchError``. What cannot be checked (workers without our plugin, quantized layers) is said once,
in a warning, never as a false alarm.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_vllm._waits import BackgroundCall, call_with_timeout
from lightning_vllm.engines import EngineTarget
from lightning_vllm.engines.base import ReportsLayerSums
from lightning_vllm.errors import WeightSyncError
from lightning_vllm.weights.layer_sums import LayerSums, SentSums, add_sums
from lightning_vllm.weights.shares import EveryRankSend

log = logging.getLogger(__name__)

_LISTED = 8  # layers named in a message, at most


@dataclass(frozen=True)
class Checked:
    """What the check after one push found.

    Attributes:
        differing: the layers the engine holds otherwise than sent.
        covered: the layers compared, of the layers the engine should hold (``(0, 0)``: the push was not checked).
    """

    differing: list[str] = field(default_factory=list)
    covered: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class HeldSums:
    """What an engine reported, its workers' reports combined.

    Attributes:
        layers: ``{layer: (bits, squares)}`` (``weights/layer_sums.tensor_sums``): tensor-parallel shards added
            up, tensors every rank holds whole counted once.
        unverifiable: ``{layer: why}`` for layers held in a form the trainer's sums cannot be held against.
        stale: ``{layer: why}`` for layers that compute with other values than they hold (a pack built from
            earlier values: ``packed_sums.py``), whatever was sent.
    """

    layers: dict[str, tuple[int, int]]
    unverifiable: dict[str, str]
    stale: dict[str, str] = field(default_factory=dict)

    @classmethod
    def combine(cls, reports: Iterable[Mapping[str, Any]]) -> HeldSums:
        """Combine the reports of ``held_sums.held_layer_sums``, one per worker (tensor- and pipeline-parallel ranks).

        Example::

            >>> rank = {"sharded": {"lm_head": [1, 2]}, "replicated": {"model.norm": [3, 3]}}
            >>> HeldSums.combine([rank, rank]).layers
            {'lm_head': (2, 4), 'model.norm': (3, 3)}
        """
        sharded: dict[str, list[int]] = {}
        replicated: dict[str, tuple[int, int]] = {}
        unverifiable: dict[str, str] = {}
        stale: dict[str, str] = {}
        for report in reports:
            for layer, values in report.get("sharded", {}).items():
                add_sums(sharded, layer, values)
            for layer, (total, squares) in report.get("replicated", {}).items():
                replicated.setdefault(layer, (total, squares))  # every rank of a stage holds the same
            unverifiable.update(report.get("unverifiable", {}))
            stale.update(report.get("stale", {}))
        kept = {layer: (total, squares) for layer, (total, squares) in sharded.items() if layer not in unverifiable}
        for layer, sums in replicated.items():
            if layer not in unverifiable:
                held = kept.get(layer)
                kept[layer] = sums if held is None else (held[0] + sums[0], held[1] + sums[1])
        return cls(kept, unverifiable, stale)

    def differing(self, expected: Mapping[str, LayerSums]) -> list[str]:
        """The layers of ``expected`` this engine holds otherwise (layers it did not report are left out), and its
        stale layers."""
        differ = {
            layer
            for layer, sums in expected.items()
            if layer in self.layers and sums.finite and not sums.matches(*self.layers[layer])
        }
        return sorted(differ | self.stale.keys())


class LandingCheck:
    """Checks what one engine holds after each push (see the module docstring).

    Build it with :meth:`for_engine`.

    Args:
        engine: the engine, which reports its layer sums (``engines/base.ReportsLayerSums``).
        timeout_seconds: the longest the engine may take to report.
    """

    def __init__(self, engine: EngineTarget, timeout_seconds: float) -> None:
        self.engine = engine
        self.timeout_seconds = timeout_seconds
        self.sent = SentSums()
        self._said: set[str] = set()
        self._pending = False
        self._report: BackgroundCall[list[dict[str, Any]]] | None = None  # the engine's sums, asked at the commit
        self._answer: list[dict[str, Any]] | None = None  # the engine's sums, come with the push (answered)
        self._every_rank: EveryRankSend | None = None  # the push's other ranks' fingerprints, if every rank sends

    @classmethod
    def for_engine(cls, engine: EngineTarget, enabled: bool, timeout_seconds: float) -> LandingCheck | None:
        """The check of ``engine``'s pushes, or ``None``: turned off (``verify_pushes=False``), or the engine
        cannot report its sums (said once, in a warning). A push that is not checked never enters this module.

        Asks the engine's workers once, at most ``timeout_seconds``."""
        if not enabled:
            return None
        if not isinstance(engine, ReportsLayerSums):
            problem: str | None = f"the {engine.description} engine target does not declare ReportsLayerSums"
        else:
            problem = call_with_timeout(
                engine.layer_sums_problem,
                timeout=timeout_seconds,
                what=f"{engine.description} to say whether its workers report their sums",
            )
        if problem is not None:
            log.warning("Pushes to %s are not checked: %s.", engine.description, problem)
            return None
        return cls(engine, timeout_seconds)

    def tally_for(self, carries_base: bool, every_rank: EveryRankSend | None) -> SentSums | None:
        """What the push's tensors are to be tallied in as they go on the wire (``None``: the push is not checked: a
        LoRA adapter alone). In a push every rank sends a share of (``every_rank``), they are rank 0's shares, and
        the other ranks' fingerprints are added at the commit (``EveryRankSend.share_sums``): a tensor's fingerprint
        is the sum of its shares'."""
        self._pending, self._report, self._answer, self._every_rank = False, None, None, every_rank
        if not carries_base:
            return None
        self._pending = True
        return self.sent

    def ask_engine(self) -> None:
        """Ask the engine's workers for their sums now, on a thread of its own, unless asked already: after the
        commit, while the engine's copies of the push may still run on its device. Its workers read what they hold
        in their device's order, after those copies, so the answer is the landed weights' and comes once the copies
        end; the question's round trip and the workers' Python overlap them (an 8B push over ``lightning_ipc``: the
        workers took 6.9 ms to answer, asked after the copies, docs/runs.md run 51)."""
        if self._pending and self._report is None and self._answer is None:
            self._report = BackgroundCall(
                self.engine.layer_sums,  # type: ignore[attr-defined]  # built only for ReportsLayerSums
                what=f"{self.engine.description} to sum the weights it holds",
                waited_until=time.monotonic() + self.timeout_seconds,
            )

    def answered(self, reports: list[dict[str, Any]]) -> None:
        """The engine's workers' reports of what they hold, come with the push as it landed (``lightning_ipc``: the
        backend's ``Copying``): the engine is not asked, and an answer asked for already is not waited for."""
        if self._pending:
            self._answer = reports

    def copies_running(self) -> None:
        """The push committed and the engine's copies of it still run on its device (``lightning_ipc``): the
        trainer's sums are read meanwhile (``SentSums.read_meanwhile``), off the path that follows the copies."""
        if self._pending:
            self.sent.read_meanwhile()

    def push_ended(self, committed: bool) -> None:
        """The push committed and landed (what was tallied is held now) or did not.

        After a commit that is to be checked, the engine's workers are asked for their sums at once unless they were
        asked as it committed (:meth:`ask_engine`), while this thread finishes the trainer's (``SentSums.commit``):
        the two overlap, on a CPU host as on a GPU.
        """
        if committed:
            self.ask_engine()
            self.sent.commit(others=self._every_rank.share_sums if self._every_rank is not None else None)
        else:
            self.sent.dropped()
            self._pending, self._report, self._answer = False, None, None  # (an answer asked for is not waited for)

    def check_result(self) -> Checked:
        """What the engine holds against what was sent, after a push that committed (nothing differing and
        nothing compared when the push was not checked, or the engine could not say within ``timeout_seconds``: a
        warning then tells why, and the push stands as committed).
        """
        report, answer, self._report, self._answer = self._report, self._answer, None, None
        if not self._pending or (report is None and answer is None):
            return Checked()
        self._pending = False
        if answer is not None:
            reports = answer
        else:
            assert report is not None
            try:
                left = max(0.0, (report.waited_until or 0.0) - time.monotonic())
                reports = report.result(left, waited=self.timeout_seconds)
            except WeightSyncError as error:
                log.warning("The push to %s could not be checked: %s", self.engine.description, error)
                return Checked()
        held = HeldSums.combine(reports)
        expected = self.sent.by_layer()
        # (Only what was sent is compared: a layer never pushed, such as one vLLM packed at start, is not a gap.)
        unverifiable = {layer: why for layer, why in held.unverifiable.items() if layer in expected}
        self.sent.unverifiable = set(unverifiable)  # (not summed from the next push on)
        if unverifiable:
            self._say_once(
                "unverifiable",
                f"{len(unverifiable)} layer(s) of {self.engine.description} cannot be verified, "
                + "; ".join(f"{layer}: {why}" for layer, why in sorted(unverifiable.items())[:_LISTED])
                + (" ..." if len(unverifiable) > _LISTED else "")
                + f". The other {len(held.layers)} layer(s) are checked after every push.",
            )
        not_finite = sorted(layer for layer, sums in expected.items() if not sums.finite)
        if not_finite:
            self._say_once(
                "not_finite",
                f"The trainer's weights hold NaN or inf in {', '.join(not_finite[:_LISTED])}: those layers are not "
                "checked.",
            )
        return Checked(held.differing(expected), (sum(layer in held.layers for layer in expected), len(expected)))

    def _say_once(self, what: str, message: str) -> None:
        if what not in self._said:
            self._said.add(what)
            log.warning(message)
