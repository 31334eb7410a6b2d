"""Minimal lightning-vllm run: a Lightning Trainer keeps a vLLM engine on its weights.

Builds a tiny random Qwen2 locally (no model hub), starts a vLLM engine on it with
the ``gloo`` weight-transfer backend (CPU), trains a few steps with
``VLLMWeightSync`` pushing every 2 optimizer steps, then shows that vLLM serves the
trained weights. Run it with ``python examples/minimal.py`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader
from transformers import Qwen2Config, Qwen2ForCausalLM

from lightning_vllm import VLLMWeightSync

PROMPT = [1, 5, 9, 33, 7, 2, 100, 42]


class CausalLM(LightningModule):
    """Trains a Hugging Face causal LM (held as ``self.model``) on next-token prediction."""

    def __init__(self, model: Qwen2ForCausalLM, lr: float = 1e-2) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def tiny_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head size 64: one vLLM's CPU attention supports
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).float()


def served_logprobs(llm) -> torch.Tensor:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)
    return torch.tensor([entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], PROMPT[1:])])


@torch.no_grad()
def trained_logprobs(model: Qwen2ForCausalLM) -> torch.Tensor:
    model.eval()
    logprobs = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0], dim=-1)
    return logprobs[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every-n-train-steps", type=int, default=2)
    parser.add_argument("--verbose-vllm", action="store_true", help="show vLLM's own log lines")
    args = parser.parse_args()
    if not args.verbose_vllm:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    model_dir = Path(tempfile.mkdtemp(prefix="lightning-vllm-demo-"))
    model = tiny_model()
    model.save_pretrained(model_dir)
    llm = LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=128,
        weight_transfer_config={"backend": "gloo"},
    )
    before = served_logprobs(llm)

    data = DataLoader(torch.randint(0, 512, (4 * args.steps, 16)), batch_size=4)
    module = CausalLM(model)
    sync = VLLMWeightSync(engine=llm, every_n_train_steps=args.every_n_train_steps)
    trainer = Trainer(
        max_steps=args.steps, accelerator="cpu", log_every_n_steps=1, enable_checkpointing=False, callbacks=[sync]
    )
    trainer.fit(module, data)

    trained = trained_logprobs(module.model)
    after = served_logprobs(llm)
    print(f"vLLM weight version: {llm.get_weight_version()} (pushes: {sync.weight_version})")
    print(f"max |served - trained| prompt logprob before training: {(before - trained).abs().max():.2e}")
    print(f"max |served - trained| prompt logprob after training:  {(after - trained).abs().max():.2e}")
    print(f"last sync: {sync.updater.last_sync}")
    print(f"TensorBoard: tensorboard --logdir {trainer.logger.log_dir}")


if __name__ == "__main__":
    main()
