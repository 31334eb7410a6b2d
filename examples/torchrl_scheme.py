"""TorchRL's weight-sync scheme, written as TorchRL documents it, with one import changed: SmolLM2-135M-Instruct
trains on its own greedy replies (expert iteration on the short ones) while an ``LLMCollector`` samples from a real
``vllm.LLM``, which the scheme's sender keeps in sync after every optimizer step.

TorchRL 0.14.1's own ``VLLMWeightSyncScheme`` cannot run on the installed vLLM (docs/torchrl.md); the one line marked
below is the whole migration. Each step prints the collector's policy version of the rollout, the engine's weight
version, and the largest gap between vLLM's log-probs of the reply and the trained model's: the engine serves the
weights the trainer has. Run it with ``python examples/torchrl_scheme.py [--steps 4]`` (about a minute on 2 CPU cores,
SmolLM2 prepared once by ``examples/smollm2.py``). Exits 1 if a gap exceeds ``--tolerance``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torchrl.collectors.llm import LLMCollector
from torchrl.envs.llm import ChatEnv
from torchrl.modules.llm import vLLMWrapper
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm import LLM

# from torchrl.weight_update.llm import VLLMWeightSyncScheme, get_model_metadata
from lightning_vllm.torchrl import VLLMWeightSyncScheme, get_model_metadata

sys.path.insert(0, str(Path(__file__).parent))
from smollm2 import prepare_smollm2  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is two plus two?"]


class Questions:
    """An endless dataloader of one question per batch, as ``ChatEnv.from_dataloader`` reads it."""

    def __iter__(self):
        step = 0
        while True:
            yield {"query": [QUESTIONS[step % len(QUESTIONS)]]}
            step += 1


def reply_log_probs(model: torch.nn.Module, prompt: list[int], reply: list[int]) -> torch.Tensor:
    """The model's log-probability of each reply token after the prompt."""
    tokens = torch.tensor([prompt + reply])
    log_probs = torch.log_softmax(model(tokens).logits[0, :-1].float(), dim=-1)
    return log_probs.gather(1, tokens[0, 1:, None])[-len(reply) :, 0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest vLLM/HF log-prob gap accepted")
    args = parser.parse_args(argv)

    model_dir = prepare_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(
        model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
        weight_transfer_config={"backend": "gloo"},
    )  # fmt: skip
    env = ChatEnv.from_dataloader(dataloader=Questions(), tokenizer=tokenizer, batch_size=(1,), input_mode="history")
    policy = vLLMWrapper(
        llm, tokenizer=tokenizer, input_mode="history", return_log_probs=True,
        generate_kwargs={"max_tokens": 12, "temperature": 0.0},
    )  # fmt: skip
    collector = LLMCollector(
        env=env, policy=policy, dialog_turns_per_batch=1, reset_at_each_iter=True, track_policy_version=True
    )

    # TorchRL's documented usage of the scheme.
    scheme = VLLMWeightSyncScheme(gpus_per_replica=1, num_replicas=1)
    sender = scheme.create_sender()
    sender.register_model(model)
    sender.register_collector(collector)
    sender.init_all_workers_group(get_model_metadata(model), vllm_engine=llm)
    sender.update_weights()

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    worst = 0.0
    try:
        for step, batch in enumerate(collector):
            batch = batch.reshape(-1)
            prompt = batch.get(("tokens", "prompt"), as_list=True)[0].tolist()
            reply = batch.get(("tokens", "response"), as_list=True)[0].tolist()
            served = batch.get(("log_probs", "response"), as_list=True)[0].float()
            version = int(batch.get("policy_version")[0])
            with torch.enable_grad():
                model.train()
                log_probs = reply_log_probs(model, prompt, reply)
                gap = float((log_probs.detach() - served).abs().max())
                # Expert iteration: make short replies likelier, long ones less (a reward of its own length).
                advantage = 1.0 if len(reply) < 12 else -0.1
                (-advantage * log_probs.mean()).backward()
            optimizer.step()
            optimizer.zero_grad()
            model.eval()
            worst = max(worst, gap)
            print(
                f"step {step}: rollout of policy version {version}, engine weight version {llm.get_weight_version()}, "
                f"{len(reply)} reply tokens, vLLM/HF log-prob gap {gap:.2e}: {tokenizer.decode(reply)!r}",
                flush=True,
            )
            if step + 1 >= args.steps:
                break
            sender.update_weights()  # vLLM serves the trained weights; the collector's next data is tagged +1
    finally:
        sender.shutdown()
        collector.shutdown()
    print(f"largest vLLM/HF log-prob gap: {worst:.2e} (tolerance {args.tolerance:g})")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
