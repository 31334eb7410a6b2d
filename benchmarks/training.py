"""The training side the benchmarks time: a short ``Trainer.fit`` of a policy that samples from the engine in
every step (``callback_cost.py``, ``stall.py``), and a logger that keeps what ``VLLMWeightSync`` logs."""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override


class PolicyModule(LightningModule):
    """A short rollout, then a next-token loss on random tokens: the cost shape of an RL step."""

    def __init__(self, model: torch.nn.Module, llm: Any) -> None:
        super().__init__()
        self.model = model
        self.llm = llm

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        from vllm import SamplingParams, TokensPrompt

        (tokens,) = batch
        prompt = TokensPrompt(prompt_token_ids=tokens[0, :8].tolist())
        self.llm.generate([prompt], SamplingParams(max_tokens=4, temperature=1.0), use_tqdm=False)
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=1e-4)


class MetricsInMemory(Logger):
    """A Lightning logger that keeps ``(step, value)`` of every metric in a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, list[tuple[int, float]]] = {}

    @property
    @override
    def name(self) -> str:
        return "in-memory"

    @property
    @override
    def version(self) -> int:
        return 0

    @override
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            self.metrics.setdefault(key, []).append((step or 0, float(value)))

    @override
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def values(self, key: str) -> list[float]:
        """Every value logged under ``key``, in the order logged."""
        return [value for _, value in self.metrics.get(key, [])]


def quiet_trainer(**settings: Any) -> Trainer:
    """A ``Trainer`` of ``settings`` that writes and shows nothing of its own (no checkpoints, progress bar or model
    summary): what the benchmarks time is the training and the pushes."""
    return Trainer(enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **settings)


def fit_seconds(
    model: torch.nn.Module, llm: Any, tokens: torch.Tensor, num_steps: int, callbacks: list[Any], logger: Any = False
) -> float:
    """Seconds of one ``Trainer.fit`` of :class:`PolicyModule` over ``num_steps`` steps."""
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        max_steps=num_steps,
        callbacks=callbacks,
        logger=logger,
        log_every_n_steps=1,
    )
    loader = DataLoader(TensorDataset(tokens), batch_size=2)
    module = PolicyModule(model.train(), llm)
    start = time.perf_counter()
    trainer.fit(module, loader)
    return time.perf_counter() - start
