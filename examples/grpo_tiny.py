"""Tiny GRPO: a character-level policy learns to echo a letter, with rollouts from vLLM.

The task: the prompt is ``"<letter>:"``; the reward is the fraction of the next
characters the policy writes that equal that letter. A random policy scores about
1/30; a policy that learned the task scores close to 1.

Everything is built locally (no model hub): a tiny Qwen2 and a readable
character-level tokenizer saved with it. Each training step samples a group of
completions per prompt from vLLM (inside ``training_step``), scores them,
normalises rewards within each group (GRPO's group-relative advantage) and takes
one policy-gradient step; ``VLLMWeightSync`` pushes the new weights to vLLM every
few steps. Logs go to TensorBoard; a plot of reward and sync time is saved beside them.

Run it with ``make demo-tiny``, or::

    python examples/grpo_tiny.py --steps 60
    python examples/grpo_tiny.py --devices 2   # two trainer processes, the policy sharded with FSDP2
    python examples/grpo_tiny.py --lora-rank 8   # train a LoRA adapter; pushes send the adapter alone

The same run from a LightningCLI YAML file: ``python examples/grpo_tiny.py fit --config examples/grpo_tiny.yaml``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_vllm import VLLMWeightSync, generate

LETTERS = "abcdefghijklmnopqrstuvwxyz"
ALPHABET = LETTERS + " .,:!?"
SPECIALS = ["<pad>", "<bos>", "<eos>"]
TASK_LETTERS = "abcde"


def build_tiny_policy(directory: Path, seed: int = 0) -> Path:
    """Save a random tiny Qwen2 and its character-level tokenizer into ``directory``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {token: index for index, token in enumerate(SPECIALS + list(ALPHABET))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<pad>"
    ).save_pretrained(directory)
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,  # head size 64: one vLLM's CPU attention supports
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    Qwen2ForCausalLM(config).float().save_pretrained(directory)
    return directory


class LetterPrompts(Dataset):
    """``num_prompts`` random prompts ``"<letter>:"`` per epoch."""

    def __init__(self, num_prompts: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.letters = [rng.choice(TASK_LETTERS) for _ in range(num_prompts)]

    def __len__(self) -> int:
        return len(self.letters)

    def __getitem__(self, index: int) -> str:
        return self.letters[index]


def echo_reward(letter: str, completion: str) -> float:
    """Fraction of the completion's characters that are ``letter`` (0 for an empty one)."""
    return sum(char == letter for char in completion) / max(len(completion), 1)


class TinyGRPO(LightningModule):
    """GRPO on the echo task, with rollouts sampled from vLLM inside ``training_step``.

    Args:
        model_dir: folder holding the policy and its tokenizer (see ``build_tiny_policy``).
        group_size: completions sampled per prompt; advantages are relative to the group.
        max_new_tokens: completion length.
        temperature: sampling temperature for rollouts.
        lr: learning rate.
        lora_rank: train a PEFT LoRA adapter of this rank (attention and MLP projections) on the
            frozen policy instead of every weight; each push then sends the adapter alone.
    """

    def __init__(
        self,
        model_dir: str = "grpo_tiny_model",
        group_size: int = 8,
        max_new_tokens: int = 6,
        temperature: float = 1.0,
        lr: float = 3e-3,
        lora_rank: int = 0,
    ) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.save_hyperparameters()
        if not (Path(model_dir) / "config.json").is_file():
            build_tiny_policy(Path(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).train()
        if lora_rank:
            from peft import LoraConfig, get_peft_model

            targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
            self.model = get_peft_model(
                self.model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=targets)
            )
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def prompt_ids(self, letter: str) -> list[int]:
        return [self.tokenizer.bos_token_id, *self.tokenizer.encode(f"{letter}:", add_special_tokens=False)]

    def training_step(self, letters: list[str], batch_idx: int) -> torch.Tensor:
        from vllm import SamplingParams

        hparams = self.hparams
        prompts = [self.prompt_ids(letter) for letter in letters]
        params = SamplingParams(
            n=hparams.group_size, temperature=hparams.temperature, max_tokens=hparams.max_new_tokens, ignore_eos=True
        )
        rollouts = generate(self, prompts, params)  # group_size samples per prompt, prompt by prompt
        rewards = torch.tensor(
            [
                echo_reward(letters[i // hparams.group_size], self.tokenizer.decode(r.token_ids))
                for i, r in enumerate(rollouts)
            ]
        )
        groups = rewards.view(len(letters), hparams.group_size)
        advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)

        sequences = torch.tensor([r.prompt_token_ids + r.token_ids for r in rollouts])
        logits = self.model(input_ids=sequences).logits[:, :-1].float()
        token_logprobs = torch.log_softmax(logits, -1).gather(-1, sequences[:, 1:, None]).squeeze(-1)
        completion_logprobs = token_logprobs[:, len(prompts[0]) - 1 :].mean(1)
        loss = -(advantages * completion_logprobs).mean()
        self.log("reward", rewards.mean(), prog_bar=True)
        self.log("loss", loss)
        return loss

    def configure_model(self) -> None:
        """With ``--devices 2`` (ModelParallelStrategy): shard each decoder layer and the model with FSDP2."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if self.device_mesh is None or isinstance(self.model, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        hf = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model  # PEFT or not
        for layer in hf.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(LetterPrompts(10_000), batch_size=8, collate_fn=list)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.model.parameters(), lr=self.hparams.lr)


def engine_args(model_dir: Path, lora_rank: int = 0) -> dict:
    """``vllm.LLM`` arguments for the tiny policy on CPU (the callback builds the engine), serving
    LoRA adapters up to ``lora_rank`` when it is not 0."""
    args: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 64,
        "seed": 0,
        "weight_transfer_config": {"backend": "gloo"},
    }
    if lora_rank:  # vLLM's max_lora_rank takes 1, 8, 16, 32, ...
        args.update(enable_lora=True, max_lora_rank=next(r for r in (8, 16, 32, 64, 128) if r >= lora_rank))
    return args


class ShowSamples(Callback):
    """Print greedy completions from vLLM when training starts and ends."""

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.show(pl_module, "Samples before training (greedy, from vLLM):")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.show(pl_module, "Samples after training (greedy, from vLLM):")

    @staticmethod
    def show(module: LightningModule, title: str) -> None:
        from vllm import SamplingParams

        assert isinstance(module, TinyGRPO)
        params = SamplingParams(temperature=0.0, max_tokens=module.hparams.max_new_tokens, ignore_eos=True)
        samples = generate(module, [module.prompt_ids(letter) for letter in TASK_LETTERS], params)
        if module.global_rank != 0:  # every rank generates (a collective under several ranks); one prints
            return
        print(title)
        for letter, sample in zip(TASK_LETTERS, samples):
            print(f"  {letter}: -> {module.tokenizer.decode(sample.token_ids)!r}  (weights v{sample.weight_version})")


def save_plot(log_dir: str) -> Path:
    """Reward and sync time per step, from the run's TensorBoard events, as a PNG beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir)
    events.Reload()
    figure, (reward_axis, sync_axis) = plt.subplots(1, 2, figsize=(10, 3.5))
    for axis, tag, label in ((reward_axis, "reward", "mean reward"), (sync_axis, "vllm/sync_seconds", "sync seconds")):
        points = events.Scalars(tag) if tag in events.Tags()["scalars"] else []
        axis.plot([p.step for p in points], [p.value for p in points], marker="." if tag != "reward" else None)
        axis.set_xlabel("optimizer step")
        axis.set_title(label)
        axis.grid(alpha=0.3)
    figure.suptitle("lightning-vllm: tiny GRPO on CPU")
    figure.tight_layout()
    path = Path(log_dir) / "grpo_tiny.png"
    figure.savefig(path, dpi=110)
    return path


def quiet_vllm(verbose: bool) -> None:
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description="Tiny GRPO with rollouts from vLLM (CPU).")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--every-n-train-steps", type=int, default=2, help="push weights to vLLM every N steps")
    parser.add_argument("--log-dir", default="lightning_logs", help="TensorBoard root folder")
    parser.add_argument("--verbose-vllm", action="store_true", help="show vLLM's own log lines")
    parser.add_argument(
        "--devices", type=int, default=1, help="trainer processes; 2 or more shard the policy with FSDP2"
    )
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="train a LoRA adapter of this rank; pushes send the adapter alone"
    )
    args = parser.parse_args(argv)
    quiet_vllm(args.verbose_vllm)

    model_dir = build_tiny_policy(Path(tempfile.mkdtemp(prefix="grpo-tiny-")))
    module = TinyGRPO(str(model_dir), lora_rank=args.lora_rank, lr=3e-2 if args.lora_rank else 3e-3)
    sync = VLLMWeightSync(
        engine=engine_args(model_dir, args.lora_rank),
        every_n_train_steps=args.every_n_train_steps,
        max_staleness=1,
        lora="adapter" if args.lora_rank else "auto",  # "adapter": say so if the adapter cannot be pushed alone
    )
    logger = TensorBoardLogger(args.log_dir, name="grpo_tiny")
    strategy: Any = "auto"
    if args.devices > 1:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    trainer = Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        callbacks=[sync, ShowSamples()],
    )
    trainer.fit(module)
    if not trainer.is_global_zero:
        return Path(logger.log_dir)
    plot = save_plot(logger.log_dir)
    print(f"Logs: {logger.log_dir}\n  tensorboard --logdir {args.log_dir}\nPlot: {plot}")
    return plot


def cli_main() -> None:
    """``python examples/grpo_tiny.py fit --config examples/grpo_tiny.yaml``."""
    from lightning.pytorch.cli import LightningCLI

    quiet_vllm(verbose=False)
    LightningCLI(TinyGRPO, save_config_callback=None)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("fit", "--help", "-h") and "--config" in sys.argv:
        cli_main()
    else:
        main()
