"""The addition demo's task, reward and loss (engine-free; the demo itself runs in `make demo`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_qwen2

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from grpo_addition import (  # noqa: E402
    HELDOUT_SIZE,
    HELDOUT_WORDINGS,
    TRAIN_WORDINGS,
    Problem,
    TrainingProblems,
    heldout_problems,
    last_integer,
    policy_gradient_loss,
    reward,
    split_pairs,
)

from lightning_vllm.engines import Generation  # noqa: E402


def test_held_out_pairs_are_never_trained_on_and_enough_to_score():
    train, heldout = split_pairs(seed=0)
    assert len(set(train) | set(heldout)) == 90 * 90 and not set(train) & set(heldout)
    assert HELDOUT_SIZE >= 200 and len(heldout) > HELDOUT_SIZE
    stream = iter(TrainingProblems(train, seed=0))
    sampled = [next(stream) for _ in range(2000)]
    assert not {(p.a, p.b) for p in sampled} & set(heldout)
    assert {p.wording for p in sampled} == set(TRAIN_WORDINGS)
    assert split_pairs(seed=0) == (train, heldout)  # the split is fixed by its seed


def test_held_out_wordings_share_no_template_with_training():
    assert not set(HELDOUT_WORDINGS) & set(TRAIN_WORDINGS)
    for phrase in ("sum", "plus"):  # the held-out phrasings never appear in training prompts
        assert all(phrase not in wording for wording in TRAIN_WORDINGS)
    problems = heldout_problems(split_pairs()[1][:HELDOUT_SIZE])
    assert {p.wording for p in problems} == set(HELDOUT_WORDINGS)
    assert problems[0].text == HELDOUT_WORDINGS[0].format(a=problems[0].a, b=problems[0].b)


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("27 + 82 = 109", 109),
        ("The answer is 109.", 109),
        ("1,109", 1109),
        ("27 + 82 = 109, not 110", 110),  # the last integer is the answer, as the protocol says
        ("I cannot say.", None),
        ("-3", -3),
    ],
)
def test_the_answer_is_the_last_integer(reply, expected):
    assert last_integer(reply) == expected


def test_reward_is_one_for_the_right_answer_and_credits_right_digits_of_wrong_ones():
    assert reward("27 + 82 = 109", 109, digit_credit=0.25) == 1.0
    assert reward("109 is wrong, it is 119", 109, digit_credit=0.25) == pytest.approx(0.25 * 2 / 3)
    assert reward("99", 109, digit_credit=0.25) == pytest.approx(0.25 * 1 / 3)  # units right
    assert reward("no idea", 109, digit_credit=0.25) == 0.0
    assert reward("-109", 109, digit_credit=0.25) == 0.0
    assert reward("119", 109, digit_credit=0.0) == 0.0


def test_policy_gradient_loss_weighs_each_answer_token_by_its_advantage_and_nothing_else():
    model = tiny_qwen2(seed=0)
    rollouts = [  # prompts of different lengths, answers of different lengths: padding everywhere
        Generation(prompt_token_ids=[1, 5, 9], token_ids=[33, 7, 2]),
        Generation(prompt_token_ids=[1, 5, 9, 11, 12], token_ids=[40]),
        Generation(prompt_token_ids=[4, 4], token_ids=[8, 9, 10, 11]),
    ]
    advantages = torch.tensor([1.0, -0.5, 2.0])
    loss = policy_gradient_loss(model, rollouts, advantages, pad_id=0)

    expected, count = torch.tensor(0.0), 0
    for rollout, advantage in zip(rollouts, advantages):
        sequence = torch.tensor([rollout.prompt_token_ids + rollout.token_ids])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=sequence).logits[0].float()
        logprobs = torch.log_softmax(logits, -1)
        for position in range(len(rollout.prompt_token_ids), sequence.shape[1]):
            expected -= advantage * logprobs[position - 1, sequence[0, position]]
            count += 1
    # bfloat16 forward passes of padded and unpadded batches round differently.
    assert loss.item() == pytest.approx((expected / count).item(), abs=2e-2)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_problem_is_a_tuple_lightning_can_move():
    from lightning.fabric.utilities.apply_func import move_data_to_device

    batch = [Problem(12, 34, TRAIN_WORDINGS[0])]
    assert move_data_to_device(batch, torch.device("cpu")) == batch
    assert batch[0].answer == 46
