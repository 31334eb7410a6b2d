"""A trainer SIGKILLed at three points of a push into ``vllm serve`` over ``lightning_nccl`` (pushes staged, then
committed whole): before the transfer, half way, and in the commit (``killed_trainer_run.py``). Each time the server
must serve again within the trainer's timeout and a margin, report the version of the push that landed before, and
hold that push's weights exactly (its per-layer integer fingerprints, asked of its workers, equal the landed model's);
then the next trainer's push lands as the next version (issue 46: a push the trainer never finished never lands).
Each subprocess's log goes to ``$OUT`` (or the test's ``tmp_path``). ``make test-gpu-lightning-nccl-server``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import killed_trainer_run
import pytest
import torch
from gpu_helpers import FIGURES, what_it_serves
from helpers import tiny_qwen2
from killed_trainers import ANSWER_MARGIN_SECONDS, kill_when_stopped, logs_dir, next_trainer_pushes, serves_again
from scenarios import FLOOR_BOUND

from lightning_vllm import HTTPEngine
from lightning_vllm.core.landing_check import HeldSums
from lightning_vllm.weights.layer_sums import SentSums

pytestmark = pytest.mark.gpu


def layers_differing(engine: HTTPEngine, model: torch.nn.Module) -> tuple[list[str], int]:
    """The layers whose exact fingerprints the server's workers hold otherwise than ``model``'s (float32, as the
    server serves), and how many layers were compared (none would prove nothing)."""
    sent = SentSums()
    for name, parameter in model.named_parameters():
        sent.tally(name, parameter.detach(), torch.float32)
    sent.commit()
    expected = sent.by_layer()
    held = HeldSums.combine(engine.layer_sums())
    return held.differing(expected), len(set(expected) & set(held.layers))


@pytest.mark.parametrize("point", killed_trainer_run.POINTS)
def test_a_trainer_killed_in_a_push_leaves_the_server_holding_the_landed_version_exactly(
    lightning_nccl_server: Any, point: str, tmp_path: Path
) -> None:
    url = lightning_nccl_server.url
    assert HTTPEngine(url).transfer_backend() == "lightning_nccl"  # its /server_info says so
    record = tmp_path / "killed-trainer.json"
    kill_when_stopped(url, record, logs_dir(tmp_path) / f"killed-trainer-lightning-nccl-{point}.log", point)
    killed_at = time.monotonic()
    landed = json.loads(record.read_text())["landed_version"]

    within = killed_trainer_run.TIMEOUT_SECONDS + ANSWER_MARGIN_SECONDS
    figures: dict[str, Any] = {"landed_version": landed, "answered": serves_again(url, killed_at, within)}
    FIGURES[f"failure_lightning_nccl_server_trainer_killed_{point}"] = figures  # (kept whatever fails below)
    before, killed = tiny_qwen2(seed=killed_trainer_run.LANDED_SEED), tiny_qwen2(seed=killed_trainer_run.KILLED_SEED)
    engine = HTTPEngine(url, timeout_seconds=5.0, generate_timeout_seconds=30.0)
    figures["in_between"] = what_it_serves(engine, before, killed)
    differing, compared = layers_differing(engine, before)
    figures["layers_differing_from_landed"], figures["layers_compared"] = differing, compared
    figures["layers_differing_from_killed"] = len(layers_differing(engine, killed)[0])
    next_model = tiny_qwen2(seed=64).cuda()
    figures["next_trainer"] = next_trainer_pushes(url, next_model)
    if any("landed" in attempt for attempt in figures["next_trainer"].values()):
        figures["next_served"] = what_it_serves(engine, before, next_model)
        figures["next_layers_differing"] = layers_differing(engine, next_model)[0]
    print(f"lightning_nccl server, trainer killed at {point}: {figures}")

    assert "seconds" in figures["answered"], figures["answered"]  # within timeout_seconds + a few
    assert figures["in_between"].get("version") == landed, figures["in_between"]  # the killed push not committed
    assert figures["in_between"]["serves"] == "the weights before", figures["in_between"]
    assert compared > 0 and differing == [], figures  # the landed push's weights, exactly
    assert figures["layers_differing_from_killed"] > 0, figures  # (the fingerprints tell the two pushes apart)
    assert figures["next_trainer"]["first"].get("landed") == landed + 1, figures["next_trainer"]
    assert figures["next_served"]["version"] == landed + 1, figures["next_served"]
    assert figures["next_served"]["gap_to_pushed"] <= FLOOR_BOUND, figures["next_served"]
    assert figures["next_layers_differing"] == [], figures
