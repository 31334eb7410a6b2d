"""Under DDP only global rank 0 sends, no rank waits for it, and every rank samples rollouts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TOLERANCE, expected_rollouts

pytestmark = pytest.mark.engine


def test_ddp_rank_zero_pushes_and_no_rank_hangs(model_dir, tmp_path):
    script = Path(__file__).with_name("ddp_run.py")
    env = {key: value for key, value in os.environ.items() if key not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    completed = subprocess.run(
        [sys.executable, str(script), str(model_dir), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    # Rank 0 pushed at fit start and at steps 2 and 4; rank 1 never talked to vLLM.
    assert rank0["weight_version"] == 3 and rank0["engine_version"] == "3"
    assert rank1["weight_version"] == 0
    assert rank0["max_logprob_diff"] < TOLERANCE
    # Rank 1 holds no engine: its rollouts came from rank 0's, its own prompts back.
    for rank, seen in enumerate((rank0, rank1)):
        assert seen["rollouts"] == expected_rollouts(rank, ["1", "1", "2", "2"])
