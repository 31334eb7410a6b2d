"""One steady-state push traced: the package's modules it enters, from the callback's hook to the bytes leaving.

Each module a push enters is a place a maintainer reads to follow it, so the count is held down (issue 45: at most
17). ``Trainer.fit`` pushes after every step; the first push connects and the second is the first with a kept choice,
so the one at step :data:`TRACED_STEP` is the push of every step after.

Two tracers, by Python version:
- 3.12 and later: ``sys.monitoring``, which sees every thread, those started before it included, so it runs inside
  the test's own process (the GPU tier's ``tests/gpu/test_gpu_push_path.py``);
- 3.11: ``sys.setprofile`` with ``threading.setprofile``, which reach only threads started after them, so the trace
  runs in a fresh process (``push_trace_run.py``, for ``tests/test_push_path.py``).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

from test_architecture import import_graph

import lightning_vllm
from lightning_vllm import VLLMWeightSync

TRACED_STEP = 3
PACKAGE = Path(lightning_vllm.__file__).parent


def module_of(filename: str) -> str | None:
    """The package's module a code object's file is (``None``: not the package's)."""
    path = Path(filename)
    if not path.is_relative_to(PACKAGE):
        return None
    parts = ["lightning_vllm", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


RUNNERS = ("lightning_vllm._waits",)
"""Modules that run what they are handed within a bounded wait (``call_with_timeout``, ``BackgroundCall``,
``wait_polling``), as ``threading.Thread`` runs its target: a call they make counts as made by whoever handed them the
callable."""


def package_caller(frame: FrameType | None) -> str | None:
    """The package's module of the nearest frame from ``frame`` outwards, runners passed over (``None``: none of the
    package's: the call came from Lightning, torch or a thread's start)."""
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("lightning_vllm") and module not in RUNNERS:
            return module
        frame = frame.f_back
    return None


def through_an_interface_of(caller: str, frame: FrameType) -> bool:
    """Whether ``frame``'s function overrides a method that a class of the module ``caller`` declares, on the instance
    it runs on: a call through an interface the caller defines and a module above implements (``Weights.metadata``
    calling ``self.declare()``), which goes down the interface, not up to its implementation."""
    instance = frame.f_locals.get("self")
    name = frame.f_code.co_name
    return instance is not None and any(
        cls.__module__ == caller and name in vars(cls) for cls in type(instance).__mro__[1:]
    )


def calls_up(calls: Iterable[Sequence[str]]) -> list[str]:
    """The calls of a traced push (``ModulesEntered.calls``) into a function of a module that imports the caller's,
    directly or through others: a call up the floors. A callable handed down and called there is one, as is a hook a
    lower module calls on a higher one; the post hooks a user registers are not the package's, so not traced."""
    graph = import_graph()

    def imports(module: str) -> set[str]:
        seen: set[str] = set()
        todo = [module]
        while todo:
            for other in graph.get(todo.pop(), ()):
                if other not in seen:
                    seen.add(other)
                    todo.append(other)
        return seen

    short = lambda module: module.removeprefix("lightning_vllm").lstrip(".")  # noqa: E731
    return [f"{caller} -> {callee}.{name}" for caller, callee, name in calls if short(caller) in imports(short(callee))]


class ModulesEntered:
    """The package's modules entered by any thread while :attr:`recording` is set, and the calls between them:
    ``(caller's module, callee's module, callee's name)``, the caller the nearest of the package's frames below the
    callee's (:func:`package_caller`; a thread's first call of the package's has none)."""

    def __init__(self) -> None:
        self.entered: set[str] = set()
        self.calls: set[tuple[str, str, str]] = set()
        self.recording = threading.Event()
        self._monitoring = sys.version_info >= (3, 12)

    def install(self) -> None:
        """Start watching (on 3.11: before any thread the push uses is started)."""
        if self._monitoring:
            monitoring = sys.monitoring  # type: ignore[attr-defined]
            self._tool = next(
                tool for tool in range(6) if monitoring.get_tool(tool) is None
            )  # (a free one: coverage may hold its own)
            monitoring.use_tool_id(self._tool, "lightning-vllm push trace")
            monitoring.register_callback(self._tool, monitoring.events.PY_START, self._started)
            return
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)

    def uninstall(self) -> None:
        if self._monitoring:
            monitoring = sys.monitoring  # type: ignore[attr-defined]
            monitoring.set_events(self._tool, 0)
            monitoring.register_callback(self._tool, monitoring.events.PY_START, None)
            monitoring.free_tool_id(self._tool)
            return
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]

    def start(self) -> None:
        self.recording.set()
        if self._monitoring:
            sys.monitoring.restart_events()  # type: ignore[attr-defined]
            sys.monitoring.set_events(self._tool, sys.monitoring.events.PY_START)  # type: ignore[attr-defined]

    def stop(self) -> None:
        self.recording.clear()
        if self._monitoring:
            sys.monitoring.set_events(self._tool, 0)  # type: ignore[attr-defined]

    def _started(self, code: CodeType, offset: int) -> Any:
        # The started function's own frame names its module, as setprofile's does: a dataclass's generated
        # __init__ has no file of the package, but runs in the globals of the module that defined the class.
        frame = sys._getframe(1)
        module = frame.f_globals.get("__name__", "") if frame.f_code is code else module_of(code.co_filename) or ""
        if module.startswith("lightning_vllm"):
            self.entered.add(module)
            self._called(frame if frame.f_code is code else None, module, code.co_qualname)
        return None

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and self.recording.is_set():
            module = frame.f_globals.get("__name__", "")
            if module.startswith("lightning_vllm"):
                self.entered.add(module)
                self._called(frame, module, frame.f_code.co_qualname)

    def _called(self, frame: FrameType | None, module: str, name: str) -> None:
        if frame is None:
            return
        caller = package_caller(frame.f_back)
        if caller is not None and caller != module and not through_an_interface_of(caller, frame):
            self.calls.add((caller, module, name))


class TracedSync(VLLMWeightSync):
    """The callback, its push at :data:`TRACED_STEP` traced by ``tracer`` (this module is not the package's, so it is
    not counted)."""

    def __init__(self, tracer: ModulesEntered, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tracer = tracer

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        traced = trainer.global_step == TRACED_STEP
        if traced:
            self.tracer.start()
        try:
            super().on_train_batch_end(trainer, *args, **kwargs)
        finally:
            if traced:
                self.tracer.stop()


def assert_few_modules_and_no_call_up(found: dict[str, Any], backend_trainer: str, most: int) -> None:
    """``found`` (a traced push's ``modules`` and ``calls``): the modules hold the callback's, the core's and
    ``backend_trainer``'s (a push the trace missed would enter none of them), and are at most ``most``; no call goes up
    (:func:`calls_up`)."""
    modules = found["modules"]
    assert {"lightning_vllm.fronts.lightning.callback", "lightning_vllm.core.push", backend_trainer} <= set(modules)
    assert len(modules) <= most, (len(modules), modules)
    assert calls_up(found["calls"]) == []
