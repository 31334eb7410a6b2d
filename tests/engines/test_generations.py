"""What an engine's outputs say about the weights that produced them: versions, and the mix a failed push leaves."""

from __future__ import annotations

from types import SimpleNamespace

from lightning_vllm.engines.base import generations_from_outputs, mixed_weight_version, parse_weight_version


def _output(spans: list[dict] | None) -> SimpleNamespace:
    sample = SimpleNamespace(token_ids=[5, 6], logprobs=None, text=None, weight_versions=spans)
    return SimpleNamespace(prompt_token_ids=[1, 2], prompt_logprobs=None, outputs=[sample])


def test_a_rollout_sampled_from_a_mix_carries_it_from_vllms_spans_or_from_the_version_read_before():
    mixed = mixed_weight_version(1, 2)
    (spanned,) = generations_from_outputs([_output([{"version": mixed, "start": 0, "end": 2}])], (0, None))
    assert (spanned.weight_version, spanned.partial_version, spanned.weight_versions) == (1, 2, [(1, 0, 2)])
    (read_before,) = generations_from_outputs([_output(None)], parse_weight_version(mixed))
    assert (read_before.weight_version, read_before.partial_version, read_before.weight_version_exact) == (1, 2, True)
    (whole,) = generations_from_outputs([_output([{"version": "3", "start": 0, "end": 2}])], (1, 2))
    assert (whole.weight_version, whole.partial_version) == (3, None)


def test_a_push_that_landed_or_failed_while_a_request_ran_makes_its_version_inexact():
    (sample,) = generations_from_outputs([_output(None)], (1, None), unchanged=False)
    assert (sample.weight_version, sample.weight_version_exact) == (1, False)
