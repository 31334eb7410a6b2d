"""What a failed push leaves running is keyed by the engine under a target, which the target names."""

from __future__ import annotations

from lightning_vllm.core.after_failure import engine_key
from lightning_vllm.engines.http import HTTPEngine


class _Unnamed:
    """A target of the user's own that does not name its engine."""


def test_two_targets_of_one_engine_are_one_engine_and_an_unnamed_target_is_its_own():
    assert engine_key(HTTPEngine("http://127.0.0.1:8000/")) == engine_key(HTTPEngine("http://127.0.0.1:8000"))
    assert engine_key(HTTPEngine("http://127.0.0.1:8000")) != engine_key(HTTPEngine("http://127.0.0.1:8001"))
    first, second = _Unnamed(), _Unnamed()
    assert engine_key(first) == engine_key(first) != engine_key(second)  # type: ignore[arg-type]
