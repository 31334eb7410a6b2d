"""TorchRL's LLM stack over an engine, for the tests that drive it (``tests/engines/test_torchrl.py``,
``tests/engines/test_torchrl_scheme_llm.py``, ``tests/gpu/test_gpu_torchrl_scheme.py``): an ``LLMCollector`` over a
``ChatEnv`` of one prompt whose ``vLLMWrapper`` policy samples from the engine, what a rollout holds, the Hugging Face
model's log-probs of it (on the model's device) and a training step that moves the weights."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from helpers import word_tokenizer

PROMPT = "t5 t9 t33 t7 t100"


class Prompts:
    """An endless dataloader of one query per batch, as ``ChatEnv.from_dataloader`` reads it."""

    def __iter__(self):
        while True:
            yield {"query": [PROMPT]}


def chat_tokenizer():
    tokenizer = word_tokenizer()
    tokenizer.pad_token = "t511"
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    return tokenizer


def rollout_of(batch) -> tuple[list[int], list[int], torch.Tensor, int]:
    """Prompt tokens, response tokens, vLLM's log-probs of the response, policy version."""
    batch = batch.reshape(-1)  # (envs, dialog turns) -> one rollout here
    assert batch.numel() == 1
    prompt = batch.get(("tokens", "prompt"), as_list=True)[0].tolist()
    response = batch.get(("tokens", "response"), as_list=True)[0].tolist()
    log_probs = batch.get(("log_probs", "response"), as_list=True)[0]
    versions = {int(batch.get("policy_version")[0]), int(batch.get(("next", "policy_version"))[0])}
    assert len(versions) == 1, f"a single-turn rollout saw two policy versions: {versions}"
    return prompt, response, log_probs, versions.pop()


def hf_response_log_probs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    tokens = torch.tensor([prompt + response], device=next(model.parameters()).device)
    log_probs = torch.log_softmax(model(tokens).logits[0, :-1].float(), dim=-1)
    return log_probs.gather(1, tokens[0, 1:, None])[-len(response) :, 0].cpu()


def train_on(model, prompt: list[int], response: list[int], lr: float = 0.5):
    """One REINFORCE-like step that makes the collected response more likely: new weights."""
    trained = copy.deepcopy(model).train()
    optimizer = torch.optim.SGD(trained.parameters(), lr=lr)
    with torch.enable_grad():
        (-hf_response_log_probs(trained, prompt, response).sum()).backward()
    optimizer.step()
    return trained.eval()


def llm_collector(llm, updater=None):
    """TorchRL's LLM stack on ``llm``: a ChatEnv of one prompt, a vLLMWrapper policy, ``updater`` (none: versions are
    counted by whoever registers the collector, a weight-sync scheme's sender)."""
    from torchrl.collectors.llm import LLMCollector
    from torchrl.envs.llm import ChatEnv
    from torchrl.modules.llm import vLLMWrapper

    tokenizer = chat_tokenizer()
    env = ChatEnv.from_dataloader(dataloader=Prompts(), tokenizer=tokenizer, batch_size=(1,), input_mode="history")
    policy = vLLMWrapper(
        llm,
        tokenizer=tokenizer,
        input_mode="history",
        generate_kwargs={"max_tokens": 6, "temperature": 0.0},
        return_log_probs=True,
    )
    return LLMCollector(
        env=env,
        policy=policy,
        dialog_turns_per_batch=1,
        reset_at_each_iter=True,  # one turn per prompt, as in GRPO: a batch is tagged with one version
        weight_updater=updater,
        track_policy_version=True,
    )


def documented_scheme_usage(
    llm,
    model: torch.nn.Module,
    scheme,
    pushes: int = 2,
    lr: float = 0.5,
    after_push: Callable[[int], None] | None = None,
) -> list[dict]:
    """TorchRL's documented weight-sync-scheme usage on ``llm``: ``create_sender``, ``register_model``,
    ``register_collector`` (an ``LLMCollector`` of :func:`llm_collector` with ``track_policy_version=True``),
    ``init_all_workers_group(metadata, vllm_engine=llm)``, then ``pushes`` times ``update_weights()``,
    ``after_push(step)`` if given (the CPU tier checks what the engine serves there), a rollout and a training step of
    the registered model (in place, at ``lr``). What each push gave: the collector's policy version and the sender's
    weight version before and after, the engine's version, the rollout's version and the largest gap between vLLM's
    response log-probs and the model's, and how far the training step after it moved them (asserted on by the
    caller)."""
    from lightning_vllm.torchrl import get_model_metadata

    collector = llm_collector(llm)
    sender = scheme.create_sender()
    sender.register_model(model)
    sender.register_collector(collector)
    sender.init_all_workers_group(get_model_metadata(model), vllm_engine=llm)
    records = []
    try:
        batches = iter(collector)
        for step in range(pushes):
            before, sender_before = collector.policy_version, sender.weight_version
            sender.update_weights()
            if after_push is not None:
                after_push(step)
            prompt, response, vllm_log_probs, version = rollout_of(next(batches))
            served = hf_response_log_probs(model, prompt, response).detach()
            records.append(
                {
                    "policy_version_before": before,
                    "policy_version": collector.policy_version,
                    "sender_version_before": sender_before,
                    "sender_version": sender.weight_version,
                    "engine_version": llm.get_weight_version(),
                    "rollout_version": version,
                    "gap": float((vllm_log_probs.float() - served).abs().max()),
                }
            )
            if step + 1 < pushes:
                trained = train_on(model, prompt, response, lr=lr)
                moved = hf_response_log_probs(trained, prompt, response).detach() - served
                records[-1]["moved"] = float(moved.abs().max())
                model.load_state_dict(trained.state_dict())  # the registered model trains in place
    finally:
        sender.shutdown()
        collector.shutdown()
    return records


def assert_in_step(records: list[dict], bound: float) -> None:
    """What :func:`documented_scheme_usage` gave holds: each push moved the collector's policy version and the
    sender's weight version by one, the engine reports the sender's, the next rollout is tagged with the policy
    version, vLLM's response log-probs are the model's within ``bound``, and each training step moved them enough
    (over 100 ``bound``) that serving the weights before it would have failed."""
    for record in records:
        assert record["policy_version"] == record["policy_version_before"] + 1, records
        assert record["sender_version"] == record["sender_version_before"] + 1, records
        assert record["engine_version"] == str(record["sender_version"]), records
        assert record["rollout_version"] == record["policy_version"], records
        assert record["gap"] <= bound, records
    assert all(record["moved"] > 100 * bound for record in records[:-1]), records
