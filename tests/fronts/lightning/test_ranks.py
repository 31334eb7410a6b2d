"""DDP then FSDP2 through Lightning on 2 CPU processes (one engine): under DDP rank 0 alone sends;
under FSDP2 every rank takes part in each push, rank 0 sends,
and a failure on any rank ends the push on every rank with that rank's error. FSDP1 and ZeRO-3,
driven by hand, in the same processes on the same engine (``sharded_run.py``: one run for every test
here, since two processes and an engine cost a minute to start).

Then a Mixture-of-Experts policy (a tiny Qwen3-MoE, whose experts transformers holds fused and vLLM loads one by
one) the same ways, and with every rank sending the experts it holds (``moe_sharded_run.py``: one more run,
its engine serving the MoE)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import TOLERANCE, StartedExample, expected_rollouts, save_model, tiny_moe

pytestmark = pytest.mark.engine

EXPERT_ELEMENTS = 64 * 128  # one expert's projection of the tiny MoE: [64, 128] or [128, 64]


@pytest.fixture(scope="module")
def two_rank_runs(request, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """The two-rank runs the selected tests need, started side by side when the first is needed: each is two
    processes and an engine, mostly starting (importing torch and vLLM on one core), which two cores do side by side
    in little more than the time of one. By fixture name: the run and its folder."""
    here = Path(__file__).parent
    scripts = {"ranks_seen": here.parents[1] / "sharded_run.py", "moe_ranks_seen": here / "moe_sharded_run.py"}
    # Each run's torch rendezvous on a port of its own, below the kernel's ephemeral range: a port Lightning finds
    # free is bound only later, and meanwhile the other run's connections may take it as their local port
    # (EADDRINUSE, seen once the runs went side by side).
    master_ports = {"ranks_seen": 29641, "moe_ranks_seen": 29642}
    wanted = {name for item in request.session.items for name in getattr(item, "fixturenames", ()) if name in scripts}
    runs = {}
    for name in sorted(wanted):
        model = model_dir
        if name == "moe_ranks_seen":
            model = save_model(tiny_moe("qwen3_moe", seed=0), tmp_path_factory.mktemp("tiny-qwen3-moe"))
        out_dir = tmp_path_factory.mktemp(name)
        env = {key: value for key, value in os.environ.items() if key not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
        env["MASTER_PORT"] = str(master_ports[name])
        runs[name] = StartedExample([str(scripts[name]), str(model), str(out_dir)], out_dir, env=env), out_dir
    yield runs
    for run, _ in runs.values():
        run.kill()


@pytest.fixture(scope="module")
def ranks_seen(two_rank_runs: dict[str, tuple]) -> tuple[dict, dict]:
    """What each rank of one ``sharded_run.py`` (tests/: it imports the helpers) saw (``rank0.json``,
    ``rank1.json``)."""
    return ranks_of(*two_rank_runs["ranks_seen"])


@pytest.fixture(scope="module")
def moe_ranks_seen(two_rank_runs: dict[str, tuple]) -> tuple[dict, dict]:
    """What each rank of one ``moe_sharded_run.py`` saw, its engine started from a tiny Qwen3-MoE."""
    return ranks_of(*two_rank_runs["moe_ranks_seen"])


def ranks_of(run: StartedExample, out_dir: Path) -> tuple[dict, dict]:
    """Wait for ``run`` (``script MODEL_DIR OUT_DIR``, whose Lightning launcher starts rank 1); what each rank wrote."""
    run.finish()
    return tuple(json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1))


def test_ddp_then_fsdp2_push_from_the_right_ranks_failures_stop_every_rank_lora_sends_its_adapter(ranks_seen):
    rank0, rank1 = ranks_seen
    # DDP first: rank 0 pushed at fit start and at steps 2 and 4; rank 1 never talked to vLLM, yet
    # knows every version rank 0 committed, so its staleness is right.
    ddp0, ddp1 = rank0["ddp"], rank1["ddp"]
    assert ddp0["weight_version"] == ddp1["weight_version"] == 3 and ddp0["engine_version"] == "3"
    assert ddp0["max_logprob_diff"] < TOLERANCE
    # Rank 1 holds no engine: its rollouts came from rank 0's, its own prompts back; on both ranks the
    # trainer's version is the rollouts' (staleness 0, logged on rank 0).
    for rank, seen in enumerate((ddp0, ddp1)):
        assert seen["rollouts"] == expected_rollouts(rank, [1, 1, 2, 2])
    assert ddp0["staleness"] == [0.0] * 4
    # FSDP2 on the same engine, counting on from 3: fit start, steps 2 and 4; vLLM serves the
    # gathered full model, both ranks count the same versions.
    assert rank0["engine_version"] == "6" and rank0["weight_version"] == rank1["weight_version"] == 6
    assert rank0["max_logprob_diff"] < TOLERANCE
    # Both ranks sampled in every step through rank 0's engine, each getting its own prompts back.
    for rank, seen in enumerate((rank0, rank1)):
        assert seen["rollouts"] == expected_rollouts(rank, [4, 4, 5, 5])
    assert rank0["staleness"] == [0.0] * 4
    # Rank 1 could not read its weights: both ranks stop, rank 0 names rank 1's error, vLLM was not touched.
    assert rank1["failure"] == "RuntimeError: rank 1 cannot read its weights"
    assert (
        rank0["failure"]
        == "PushAborted: The push failed on trainer rank 1: RuntimeError: rank 1 cannot read its weights"
    )
    assert rank0["failure_seconds"] < 20 and rank1["failure_seconds"] < 20
    assert rank0["engine_version_after_failure"] == "6" and rank0["max_logprob_diff_after_failure"] < TOLERANCE
    # Then a LoRA policy, with mixed precision (bfloat16 compute) and CPU offload: vLLM gets the
    # merged float32 master weights, and the live module is untouched by a push.
    lora0, lora1 = rank0["lora"], rank1["lora"]
    assert lora0["max_logprob_diff"] < TOLERANCE
    # During fit (steps 2 and 4) the adapter alone, gathered from both ranks' shards; the push by hand
    # after fit connects again (fit's end closed the connection), so it sends the base weights once more.
    *in_fit, by_hand = lora0["bytes"]
    assert in_fit[-2:] == [lora0["adapter_bytes"]] * 2 and 10 * lora0["adapter_bytes"] < by_hand
    # Fit start, steps 2 and 4 and one more, counting on from the FSDP2 run's 6 on the same engine.
    assert lora0["weight_version"] == lora1["weight_version"] == 6 + 4
    assert lora0["live_module_untouched"] and lora1["live_module_untouched"]
    # Last, the engine is killed mid-run. vLLM says the engine died, or its calls time out
    # (which comes first is a race): either way rank 0 fails the push and rank 1 raises rank 0's error.
    gone0, gone1 = rank0["engine_gone"], rank1["engine_gone"]
    assert "EngineDeadError" in gone0["failure"] or "Timed out after 20 s" in gone0["failure"]
    assert gone1["failure"] == f"PushAborted: The push failed on trainer rank 0: {gone0['failure']}"
    # timeout_seconds=20: rank 1 hears of it as soon as rank 0 gives up on vLLM.
    assert gone1["failure_seconds"] < 20 + 15
    assert gone0["failure_seconds"] < 4 * 20 + 15


def test_fsdp1_and_deepspeed_zero3_driven_by_hand_push_in_lockstep(ranks_seen):
    """Lightning's FSDPStrategy and DeepSpeedStrategy need a GPU; FSDP1 and ZeRO-3 themselves run on CPU."""
    # Counting on from the LoRA run's 10 on the same engine.
    assert_by_hand_pushes_landed(*(seen["by_hand"] for seen in ranks_seen), first_version=10)


def assert_by_hand_pushes_landed(rank0: dict, rank1: dict, first_version: int) -> None:
    """``sharded_run.by_hand_run``'s pushes landed: vLLM served each model, every rank counted each version."""
    cases = ("FSDP1 use_orig_params=True", "FSDP1 use_orig_params=False", "FSDP1 LightningModule")
    for case in (*cases, "ZeRO-3 model", "ZeRO-3 LightningModule"):
        assert rank0[f"{case} max_logprob_diff"] < TOLERANCE, case
        # Full shapes, not FSDP1's flat shards or ZeRO-3's empty placeholders (a MoE's experts one by one).
        assert rank0[f"{case} num_bytes"] == rank0["full_bytes"], case
    # Every rank counts the same versions: three FSDP1 pushes, then two ZeRO-3 ones.
    assert rank0["FSDP1 LightningModule version"] == rank1["FSDP1 LightningModule version"] == first_version + 3
    assert rank0["ZeRO-3 LightningModule version"] == rank1["ZeRO-3 LightningModule version"] == first_version + 5


def test_fsdp2_moe_lands_gathered_and_with_every_rank_sending_the_experts_it_holds(moe_ranks_seen):
    # Through Lightning: fit start and after each of 2 steps, rank 0 sending (gathered layer group by layer group),
    # then the same with push_from="every_rank"; rollouts on both ranks in each step.
    for run, versions in (("rank0", 3), ("every_rank", 6)):
        run0, run1 = (seen[run] for seen in moe_ranks_seen)
        assert run0["weight_version"] == run1["weight_version"] == versions and run0["engine_version"] == str(versions)
        assert run0["rollouts"] == run1["rollouts"] == 2
        assert run0["max_logprob_diff"] < TOLERANCE, run
        assert run0["num_bytes"] == run0["full_bytes"], run  # every expert one by one: the checkpoint's bytes
    every0, every1 = (seen["every_rank"] for seen in moe_ranks_seen)
    # Sent in shares, not gathered: no rank warned it gathered, and rank 1 sent half of the bytes at each push
    # (every tensor splits evenly here: 4 experts, an even number of rows). Each push was checked, rank 1's shares'
    # fingerprints added to rank 0's, with nothing said unchecked: a mismatch would have failed the fit.
    assert every0["warnings"] == every1["warnings"] == []
    assert every0["check_seconds"] > 0
    assert every1["sent"] == [every0["full_bytes"] // 2] * 3
    # FSDP2 shards the fused experts by expert: experts 0 and 1 on rank 0, 2 and 3 on rank 1; the rank holding an
    # expert sends it whole, the other nothing of it.
    for projection in ("gate_proj", "up_proj", "down_proj"):
        assert every0["expert_counts"][f"1.{projection}"] == [EXPERT_ELEMENTS, 0]
        assert every0["expert_counts"][f"2.{projection}"] == [0, EXPERT_ELEMENTS]


def test_fsdp1_and_zero3_moe_driven_by_hand_push_in_lockstep(moe_ranks_seen):
    # Counting on from the two fits' 6 on the same engine.
    assert_by_hand_pushes_landed(*(seen["by_hand"] for seen in moe_ranks_seen), first_version=6)
    # ZeRO-3 partitions are no share of a tensor: with push_from="every_rank" the MoE is gathered, rank 0
    # sending, and every rank says why.
    rank0, rank1 = (seen["zero3_every_rank"] for seen in moe_ranks_seen)
    assert rank0["max_logprob_diff"] < TOLERANCE and rank0["weight_version"] == rank1["weight_version"] == 6 + 5 + 1
    for seen in (rank0, rank1):
        assert seen["warnings"] == [
            "push_from='every_rank': this push is gathered and sent by rank 0 instead, as a ZeRO3Weights is not "
            "sent in shares (only a plain or FSDP2 model is)."
        ]
