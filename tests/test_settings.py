import pytest

from lightning_vllm.settings import DEFAULT_BUCKET_SIZE_BYTES, validate_bucket_size, validate_timeout


@pytest.mark.parametrize("size", [0, -8, 12, 1001])
def test_bucket_sizes_must_be_positive_multiples_of_eight(size):
    with pytest.raises(ValueError, match=f"bucket_size_bytes={size}. Must be a positive multiple of 8"):
        validate_bucket_size(size)
    validate_bucket_size(DEFAULT_BUCKET_SIZE_BYTES)


@pytest.mark.parametrize("seconds", [0, -1.5])
def test_timeouts_must_be_positive(seconds):
    with pytest.raises(ValueError, match=f"timeout_seconds={seconds}. Must be > 0"):
        validate_timeout(seconds)
