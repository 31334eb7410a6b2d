"""Tiny models and measurements shared by the tests.

Everything is built locally (no model hub): a random Qwen2 small enough for a
2-core CPU, whose head size (64) is one vLLM's CPU attention supports.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader
from transformers import Qwen2ForCausalLM

VOCAB_SIZE = 512
MAX_MODEL_LEN = 128
TOLERANCE = 1e-4
SERVER_API_KEY = "lightning-vllm-test-key"  # the key of the test servers' RequireAPIKey
"""How close vLLM's float32 prompt logprobs must come to the Hugging Face model's after a sync."""
PROMPTS = [[1, 5, 9, 33, 7, 2], [100, 200, 300, 400], [7, 7, 7, 8, 9, 10, 11, 12], [42, 13, 250, 500, 3]]


def tiny_qwen2(seed: int = 0, tie_word_embeddings: bool = False) -> Qwen2ForCausalLM:
    """A 2-layer float32 Qwen2 with hidden size 128 and 2 heads of 64."""
    return tiny_model(
        "qwen2", seed, intermediate_size=256, num_key_value_heads=1, tie_word_embeddings=tie_word_embeddings
    )


def tiny_model(model_type: str, seed: int = 0, **config: Any) -> Any:
    """A random 2-layer float32 model of ``model_type`` with hidden size 128 and 2 heads, seeded: the tests' engines
    take its head size, 64, on vLLM's CPU build; ``config`` gives the family's sizes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=128, num_hidden_layers=2, num_attention_heads=2)
    config = AutoConfig.for_model(model_type, **common, max_position_embeddings=256, torch_dtype="float32", **config)
    return AutoModelForCausalLM.from_config(config).float().eval()


NUM_EXPERTS = 4
MOE_FAMILIES = {
    # per family: what its config calls the MoE sizes; each has 4 routed experts, 2 of them per token
    "qwen2_moe": dict(
        moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=NUM_EXPERTS, num_experts_per_tok=2
    ),
    "qwen3_moe": dict(moe_intermediate_size=64, num_experts=NUM_EXPERTS, num_experts_per_tok=2),
    "mixtral": dict(num_local_experts=NUM_EXPERTS, num_experts_per_tok=2),
    "deepseek_v3": dict(
        moe_intermediate_size=64, n_routed_experts=NUM_EXPERTS, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="noaux_tc", kv_lora_rank=512, q_lora_rank=32,
        qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,  # (576: the one MLA size vLLM on CPU runs)
    ),
    "glm4_moe": dict(
        moe_intermediate_size=64, n_routed_experts=NUM_EXPERTS, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1,
    ),
}  # fmt: skip
"""Tiny Mixture-of-Experts families, each a model transformers 5 holds with its experts fused in memory."""


def tiny_moe(family: str = "qwen3_moe", seed: int = 0):
    """A 2-layer float32 MoE model of ``family`` (a ``model_type`` of :data:`MOE_FAMILIES`): hidden size 128, 2
    heads of 64, 4 experts of 64, 2 of them per token."""
    sizes = dict(intermediate_size=64, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
    return tiny_model(family, seed, **sizes, **MOE_FAMILIES[family])


def lora_policy(seed: int = 0):
    """A PEFT LoRA policy (rank 8 on the attention and MLP projections) whose adapter starts non-zero."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
    return get_peft_model(tiny_qwen2(seed=0), config)


def save_model(model: Qwen2ForCausalLM, directory: Path) -> Path:
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def fake_hub_cache(cache: Path, repo_id: str, model=None, config=None) -> Path:
    """A Hugging Face cache holding ``repo_id`` as vLLM's download leaves it (``refs/main`` naming a snapshot
    folder), with ``model``'s checkpoint or only ``config``'s config.json; returns the cache folder."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    if model is not None:
        save_model(model, snapshot)
    else:
        config.save_pretrained(snapshot)
    return cache


FAST_TIER_VARIABLE = "LIGHTNING_VLLM_FAST_TIER"


def require_engine_tier() -> None:
    """Refuse to start a vLLM engine in the engine-free tier (``make test-fast`` sets the variable).

    Catches a test that starts an engine without the ``engine`` mark, which would
    otherwise slow the fast tier down by ~20 s an engine.
    """
    if os.environ.get(FAST_TIER_VARIABLE):
        raise RuntimeError(
            f"This test starts a vLLM engine but runs in the engine-free tier ({FAST_TIER_VARIABLE} is set): "
            "mark it with @pytest.mark.engine."
        )


# The shared test engines serve LoRA adapters too (a policy's adapter takes one slot), so that
# adapter pushes are tested on the same engines as full pushes.
LORA_ENGINE = dict(enable_lora=True, max_lora_rank=8, max_loras=1)


def engine_kwargs(model_dir: Path, backend: str | None = "gloo", **overrides) -> dict:
    """Arguments of a small CPU vLLM engine on ``model_dir`` (``vllm.LLM``, ``AsyncEngineArgs``, ``VLLMActor``)."""
    require_engine_tier()
    kwargs = dict(
        model=str(model_dir),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        seed=0,
    )
    if backend is not None:
        kwargs["weight_transfer_config"] = {"backend": backend}
    return {**kwargs, **overrides}


def build_llm(model_dir: Path, backend: str | None = "gloo", **overrides):
    """A real vLLM engine on CPU for ``model_dir`` (about 20 s to start)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    return LLM(**engine_kwargs(model_dir, backend, **overrides))


def build_llm_in_process(model_dir: Path, backend: str | None = "gloo", **overrides):
    """:func:`build_llm` with vLLM's engine core and worker in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
    about 4 s to start instead of 20 to 28 (no process to spawn that imports torch and vLLM again; the engine tier's
    durations, 2026-12-06). For tests of what lands and what is refused; a test of processes (an engine core killed
    or frozen, the README's engine) builds vLLM's default.

    What the engine's start leaves in this process is undone once it stands: the environment variables vLLM sets for
    its own processes (``LOCAL_WORLD_SIZE``, ``LD_PRELOAD`` ...), and vLLM's cache of its settings, which it turns
    on after an engine core starts (a later engine's ``VLLM_CPU_OMP_THREADS_BIND`` was read from it, and a
    tensor-parallel engine refused to start)."""
    import vllm.envs

    before = dict(os.environ)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        return build_llm(model_dir, backend, **overrides)
    finally:
        vllm.envs.disable_envs_cache()
        os.environ.clear()
        os.environ.update(before)


def shutdown(llm) -> None:
    """Stop an engine while pytest still captures output (vLLM logs as it stops).

    vLLM's CPU engine core does not exit on SIGTERM within vLLM's default 5 s grace and is
    then killed anyway; a test engine holds nothing to save, so 1 s is enough (4 s less for
    each of the suite's engines).
    """
    llm.llm_engine.engine_core.shutdown(timeout=1.0)


def vllm_prompt_logprobs(llm, prompts=PROMPTS, lora_request=None) -> list[list[float]]:
    """vLLM's log-probability of every prompt token after the first, per prompt."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    prompts_in = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    outputs = llm.generate(prompts_in, params, use_tqdm=False, lora_request=lora_request)
    result = []
    for prompt, output in zip(prompts, outputs):
        per_token = output.prompt_logprobs[1:]
        result.append([entry[token].logprob for entry, token in zip(per_token, prompt[1:])])
    return result


def engine_prompt_logprobs(engine, prompts=PROMPTS) -> list[list[float]]:
    """Prompt logprobs through an engine target's ``generate`` (any target: HTTP, AsyncLLM, Ray)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    return [generation.prompt_logprobs for generation in engine.generate(prompts, params)]


def vllm_greedy(llm, prompts=PROMPTS, max_tokens: int = 8) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


@torch.no_grad()
def hf_prompt_logprobs(model, prompts=PROMPTS) -> list[list[float]]:
    """The model's logprob of every prompt token after the first, computed on the model's device."""
    device = next(model.parameters()).device
    result = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        logprobs = torch.log_softmax(model(ids).logits.float(), dim=-1)[0]
        result.append([logprobs[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)])
    return result


@torch.no_grad()
def hf_greedy(model, prompts=PROMPTS, max_tokens: int = 8) -> list[list[int]]:
    device = next(model.parameters()).device
    result = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        result.append(out[0, len(prompt) :].tolist())
    return result


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


def served_logprobs(engine) -> list[list[float]]:
    """Prompt logprobs from a ``vllm.LLM`` or from any engine target (HTTP, AsyncLLM, Ray)."""
    from vllm import LLM

    return vllm_prompt_logprobs(engine) if isinstance(engine, LLM) else engine_prompt_logprobs(engine)


def served_version(engine) -> int:
    """The weight version ``engine`` (a ``vllm.LLM`` or an adapter) serves, as a number (0: none
    pushed). Engines are shared between tests, and versions go on from what an engine serves."""
    from lightning_vllm.engines.base import version_number

    return version_number(engine.get_weight_version())


def assert_serves(engine, model) -> None:
    """``engine`` serves ``model``'s weights: prompt logprobs within ``TOLERANCE`` and, for a
    ``vllm.LLM``, the same greedy tokens."""
    from vllm import LLM

    model.eval()
    gap = max_abs_diff(served_logprobs(engine), hf_prompt_logprobs(model))
    assert gap < TOLERANCE, f"served logprobs differ from the model's by {gap:.2e}"
    if isinstance(engine, LLM):
        assert vllm_greedy(engine) == hf_greedy(model)


def half_way(model: torch.nn.Module, at_half):
    """``model``'s weights as a source whose reading calls ``at_half()`` once half of its tensors were read,
    then reads the rest: a source that raises, stalls or kills the engine in the middle of a push."""
    from lightning_vllm.weights import ModuleWeights

    class HalfWay(ModuleWeights):
        def iter_full(self):
            items = list(super().iter_full())
            yield from items[: len(items) // 2]
            at_half()
            yield from items[len(items) // 2 :]

    return HalfWay(model)


def raises(error: BaseException):
    """A callable that raises ``error`` (an ``at_half`` for :func:`half_way`)."""

    def raising() -> None:
        raise error

    return raising


class TinyCausalLM(LightningModule):
    """A LightningModule training a Hugging Face causal LM on next-token prediction."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-2, attribute: str = "model") -> None:
        super().__init__()
        self.attribute = attribute
        setattr(self, attribute, model)
        self.lr = lr

    @property
    def hf(self) -> torch.nn.Module:
        return getattr(self, self.attribute)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.hf.train()
        loss = self.hf(input_ids=batch, labels=batch).loss
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def token_batches(num_batches: int, batch_size: int = 4, length: int = 16, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB_SIZE, (num_batches * batch_size, length), generator=generator)
    return DataLoader(data, batch_size=batch_size)


def cpu_trainer(tmp_path: Path, callbacks: list, **kwargs) -> Trainer:
    settings = dict(
        default_root_dir=tmp_path,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(tmp_path, name="logs"),
    )
    settings.update(kwargs)
    return Trainer(callbacks=callbacks, **settings)


def tensorboard_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` of every ``tag`` scalar in the TensorBoard event files under ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = []
    for event_file in sorted(Path(log_dir).rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(event_file))
        accumulator.Reload()
        if tag in accumulator.Tags()["scalars"]:
            values += [(event.step, event.value) for event in accumulator.Scalars(tag)]
    return values


def word_tokenizer():
    """A word-level tokenizer over the tiny vocabulary (token ``i`` is the word ``t<i>``).

    Use the object itself: saved beside the Qwen2 test model, transformers loads it back
    as a Qwen2 byte-level tokenizer, which turns the words into no token at all.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB_SIZE)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", eos_token="t1")


def save_tokenizer(directory: Path) -> Path:
    """Save :func:`word_tokenizer` beside a model: vLLM's OpenAI-compatible server needs a
    tokenizer to answer ``/v1/completions``, even for token-id prompts."""
    word_tokenizer().save_pretrained(directory)
    return directory


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_health(url: str, timeout: float, alive=lambda: True, log: str = "its log") -> None:
    """Poll ``url``/health once a second until it answers, for at most ``timeout`` seconds
    (``alive()`` false ends the wait: the server exited)."""
    import time

    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"vLLM server {url} exited; see {log}")
        try:
            if requests.get(f"{url}/health", timeout=2).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise TimeoutError(f"vLLM server at {url} not healthy after {timeout} s; see {log}")


class VLLMServer:
    """``vllm serve`` (its module spelling: the CPU build's console script cannot start) as a subprocess."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *,
        dev_mode: bool = True,
        backend: str | None = "gloo",
        api_key: str | None = None,
        host: str = "127.0.0.1",
        netns: str | None = None,
        port: int | None = None,
        lora: bool = False,
        extra_args: list[str] | tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        import subprocess
        import sys

        require_engine_tier()
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.api_key = api_key
        given = env or {}
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1" if dev_mode else "0"}
        env.pop("VLLM_API_KEY", None)
        env.update(given)
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", host, "--port", str(self.port), "--dtype", "float32", "--max-model-len", "128",
            "--enforce-eager", "--seed", "0",
        ]  # fmt: skip
        if backend is not None:
            command += ["--weight-transfer-config", f'{{"backend": "{backend}"}}']
        if api_key is not None:  # the RL routes and vLLM's own /v1 routes need the key
            env["VLLM_API_KEY"] = api_key
            command += ["--middleware", "lightning_vllm.server.RequireAPIKey"]
            command += ["--middleware", "lightning_vllm.server.PauseLease"]
        if lora:  # serves the adapters trainers push (see docs/lora.md)
            command += ["--enable-lora", "--max-lora-rank", str(LORA_ENGINE["max_lora_rank"]), "--max-loras", "1"]
            command += ["--middleware", "lightning_vllm.server.PushedAdapters"]
        command += list(extra_args)  # (later flags win: e.g. a longer --max-model-len)
        if netns is not None:  # run inside a network namespace the test made
            command = ["ip", "netns", "exec", netns, *command]
        self.log = open(log_path, "w")
        self._command, self._env = command, env
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def start_again(self) -> None:
        """Start the server again, same command and URL, after :meth:`kill` (returns at once)."""
        import subprocess

        assert self.process.poll() is not None, "kill() the server first"
        self.process = subprocess.Popen(self._command, env=self._env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_until_healthy(self, timeout: float = 240.0) -> None:
        wait_for_health(self.url, timeout, alive=lambda: self.process.poll() is None, log=self.log.name)

    def processes(self) -> list[int]:
        """The server's pid and those of every vLLM process below it."""
        import psutil

        try:
            children = [child.pid for child in psutil.Process(self.process.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            children = []
        return [self.process.pid, *children]

    def kill(self, processes: list[int] | None = None) -> None:
        """SIGKILL the server and every vLLM process below it, as a crash would."""
        for pid in processes or self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(timeout=30)

    def stop(self) -> None:
        """Stop the server: SIGTERM, then (as vLLM's own shutdown would after its grace) SIGKILL
        of what is left after 2 s."""
        import subprocess

        if self.process.poll() is None:
            processes = self.processes()
            self.process.terminate()
            try:
                self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
            self.kill(processes)  # whatever is left of it
        self.log.close()


class FakeEngine:
    """A stand-in for a vLLM engine in the engine-free tier: a real gloo receiver, no model.

    It answers what the updater asks before a push from a Hugging Face model's
    metadata, joins the trainer's transfer group for real (on a thread of this process)
    and keeps the tensors of the last finished update, so scheduling, checks and
    versions run in a second instead of the ~20 s a vLLM engine takes to start. It
    serves no tokens: what vLLM does with the weights is tested against real engines.
    """

    description = "fake test engine"

    def __init__(self, model: torch.nn.Module) -> None:
        from lightning_vllm.weights import ExpectedWeights, source_metadata, weights_from

        # (In its checkpoint's layout, as a vLLM engine loads it: a MoE model's experts one by one.)
        self.expected = ExpectedWeights(source_metadata(weights_from(model)), ties_word_embeddings=False)
        self.receiver = None
        self.weights: dict[str, torch.Tensor] = {}
        self.version = "default"
        self.num_updates = 0
        self._pending: dict[str, torch.Tensor] = {}

    def transfer_backend(self) -> str:
        return "gloo"

    def device_type(self) -> str:
        return "cpu"

    def tensor_parallel_size(self) -> int:
        return 1

    def num_workers(self) -> int:
        return 1

    def expected_weights(self):
        return self.expected

    def is_dead(self) -> bool:
        return False

    def prompt_limits(self):
        from lightning_vllm.prompts import PromptLimits

        return PromptLimits(vocab_size=VOCAB_SIZE, max_model_len=MAX_MODEL_LEN, accepts_text=False)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        from lightning_vllm.backends.gloo.messages import GlooWeightTransferInitInfo
        from lightning_vllm.backends.gloo.receiver import GlooReceiver

        self.receiver = GlooReceiver(GlooWeightTransferInitInfo(**init_info), rank=1)

    def start_weight_update(self) -> None:
        self._pending = {}

    def update_weights(self, update_info: dict) -> None:
        from lightning_vllm.backends.gloo.messages import GlooWeightTransferUpdateInfo

        assert self.receiver is not None, "init_weight_transfer_engine first"
        for segment in self.receiver.post_update(GlooWeightTransferUpdateInfo(**update_info)).arrived():
            self._pending.update((name, tensor.clone()) for name, tensor in segment)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.weights, self._pending = self._pending, {}
        self.num_updates += 1
        if weight_version is not None:
            self.version = weight_version

    def shutdown_weight_transfer_engine(self) -> None:
        self.receiver = None

    def get_weight_version(self) -> str:
        return self.version

    def reset_prefix_cache(self) -> None:
        pass

    def pause_generation(self, mode: str) -> None:
        pass

    def resume_generation(self) -> None:
        pass

    def generate(self, prompts, sampling_params, *, timeout_seconds=None):
        """One empty sample per prompt, labelled with the version the fake holds."""
        from lightning_vllm import Generation
        from lightning_vllm.engines.base import version_number

        version = version_number(self.version)
        return [Generation(prompt_token_ids=list(prompt), token_ids=[], weight_version=version) for prompt in prompts]

    def holds(self, model: torch.nn.Module) -> bool:
        """Whether the last update carried exactly ``model``'s parameters (in its checkpoint's layout)."""
        from lightning_vllm.weights import weights_from

        params = dict(weights_from(model).iter_full())
        return self.weights.keys() == params.keys() and all(
            torch.equal(self.weights[name], param.detach()) for name, param in params.items()
        )


def start_server(model_dir: Path, tmp_path_factory, **kwargs) -> VLLMServer:
    """A healthy ``VLLMServer`` on ``model_dir`` (stopped again if it never becomes healthy)."""
    server = VLLMServer(model_dir, tmp_path_factory.mktemp("server") / "server.log", **kwargs)
    try:
        server.wait_until_healthy()
    except BaseException:
        server.stop()
        raise
    return server


class CallsAtBatch(TinyCausalLM):
    """Calls ``calls[batch_idx]()`` at the start of that training step (a test's way of acting
    in the middle of a run: take an engine down, restart a server)."""

    def __init__(self, calls: dict, lr: float = 1e-2) -> None:
        super().__init__(tiny_qwen2(seed=0), lr=lr)
        self.calls = calls

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if batch_idx in self.calls:
            self.calls[batch_idx]()
        return super().training_step(batch, batch_idx)


class RolloutCausalLM(TinyCausalLM):
    """Samples from vLLM in every training step, prompts that differ by rank, and records
    ``(global step, prompt ids of each sample, tokens per sample, logprobs per sample, versions,
    the trainer's version on this rank)``."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-2) -> None:
        super().__init__(model, lr)
        self.seen: list = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        from vllm import SamplingParams

        from lightning_vllm import generate
        from lightning_vllm.fronts.lightning.rollouts import sampler_of

        prompts = [[1 + self.global_rank, 2, 3], [4, 5 + self.global_rank]]
        rollouts = generate(self, prompts, SamplingParams(n=2, max_tokens=3, logprobs=0, seed=0))
        trainer_version = sampler_of(self).updater.versions.trainer
        self.seen.append(
            (
                self.global_step,
                [r.prompt_token_ids for r in rollouts],
                [len(r.token_ids) for r in rollouts],
                [len(r.logprobs) for r in rollouts],
                [r.weight_version for r in rollouts],
                trainer_version,
            )
        )
        return super().training_step(batch, batch_idx)


def expected_rollouts(rank: int, versions: list[int], staleness: int = 0) -> list:
    """What ``RolloutCausalLM`` records on ``rank`` for steps 0, 1, ... sampled from ``versions``,
    the trainer being ``staleness`` versions ahead."""
    prompts = [[1 + rank, 2, 3], [1 + rank, 2, 3], [4, 5 + rank], [4, 5 + rank]]
    return [
        [step, prompts, [3] * 4, [3] * 4, [version] * 4, version + staleness] for step, version in enumerate(versions)
    ]


def push_in_lockstep_and_record(result: dict, key: str, updater, ranks, sharded, reference, llm) -> None:
    """Push ``sharded`` with every rank taking part; record the version and, on rank 0 (which holds
    ``llm``), how close vLLM comes to the unsharded ``reference`` and the bytes sent."""
    from lightning_vllm.fronts.lightning.ranks import is_sharded
    from lightning_vllm.fronts.lightning.roles import LockstepGathers

    assert is_sharded(sharded)
    stats = LockstepGathers(ranks).push(updater, sharded)
    result[f"{key} version"] = updater.weight_version
    if llm is not None:
        result[f"{key} max_logprob_diff"] = max_abs_diff(vllm_prompt_logprobs(llm), hf_prompt_logprobs(reference))
        result[f"{key} num_bytes"] = stats.num_bytes
        result["full_bytes"] = sum(p.numel() * 4 for p in reference.parameters())


EXAMPLES = Path(__file__).parents[1] / "examples"


class StartedExample:
    """An example running in a subprocess (vLLM needs a ``__main__`` guard); :meth:`finish` waits for it.
    Its output goes to temporary files, not pipes, so that it never stops for a reader while the test
    waits for another example."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        self.outputs = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(
            [sys.executable, *args], cwd=cwd, env=dict(os.environ) if env is None else env, stdout=self.outputs[0],
            stderr=self.outputs[1],
        )  # fmt: skip

    def finish(self) -> subprocess.CompletedProcess:
        """Wait for the example (10 minutes at most); fails the test if it fails."""
        try:
            self.process.wait(timeout=600)
        finally:
            self.kill()
        stdout, stderr = (read_from_start(output) for output in self.outputs)
        assert self.process.returncode == 0, stderr[-4000:]
        return subprocess.CompletedProcess(self.process.args, self.process.returncode, stdout, stderr)

    def kill(self) -> None:
        """Stop it if it is still running (a test that failed before waiting for it, or a timeout)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def read_from_start(file) -> str:
    file.seek(0)
    return file.read()
