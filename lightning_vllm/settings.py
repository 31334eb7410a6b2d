"""Settings every part of a sync shares, whatever the backend: defaults and their checks.

Nothing here imports a transport, so the updater and the callback read their
defaults without loading the ``gloo`` backend.
"""

from __future__ import annotations

DEFAULT_TIMEOUT_SECONDS = 120.0
"""The longest any single wait of a sync may take (rendezvous, transfer, control call)."""

DEFAULT_GENERATE_TIMEOUT_SECONDS = 600.0
"""The longest one ``generate`` of rollouts may take: long rollouts are legitimate, a hang is not."""

DEFAULT_BUCKET_SIZE_BYTES = 256 * 1024 * 1024
"""The largest packed bucket on the wire, which bounds the trainer's staging memory."""

WIRE_ALIGNMENT_BYTES = 8
"""Slices of a bucket must hold whole elements of every wire dtype."""


def validate_bucket_size(bucket_size_bytes: int) -> None:
    """Raise ``ValueError`` unless the bucket size is positive and a multiple of 8 bytes.

    Example::

        >>> validate_bucket_size(1024)
        >>> validate_bucket_size(10)
        Traceback (most recent call last):
        ...
        ValueError: Invalid value for bucket_size_bytes=10. Must be a positive multiple of 8 (e.g. 268435456).
    """
    if bucket_size_bytes <= 0 or bucket_size_bytes % WIRE_ALIGNMENT_BYTES:
        raise ValueError(
            f"Invalid value for bucket_size_bytes={bucket_size_bytes}. "
            f"Must be a positive multiple of {WIRE_ALIGNMENT_BYTES} (e.g. {DEFAULT_BUCKET_SIZE_BYTES})."
        )


def validate_timeout(timeout_seconds: float) -> None:
    """Raise ``ValueError`` unless the timeout is a positive number of seconds."""
    if timeout_seconds <= 0:
        raise ValueError(f"Invalid value for timeout_seconds={timeout_seconds}. Must be > 0.")
