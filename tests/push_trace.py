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
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

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


class ModulesEntered:
    """The package's modules entered by any thread while :attr:`recording` is set."""

    def __init__(self) -> None:
        self.entered: set[str] = set()
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
        return sys.monitoring.DISABLE  # type: ignore[attr-defined]  # (each code once is enough)

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and self.recording.is_set():
            module = frame.f_globals.get("__name__", "")
            if module.startswith("lightning_vllm"):
                self.entered.add(module)


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


def assert_few_modules(modules: list[str], backend_trainer: str, most: int) -> None:
    """``modules`` (a traced push's) hold the callback's, the core's and ``backend_trainer``'s (a push the trace missed
    would enter none of them), and are at most ``most``."""
    assert {"lightning_vllm.fronts.lightning.callback", "lightning_vllm.core.push", backend_trainer} <= set(modules)
    assert len(modules) <= most, (len(modules), modules)
