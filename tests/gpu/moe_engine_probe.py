"""Probe: tiny random MoE models served by a real ``vllm.LLM`` on the GPU host, against Hugging Face.

vLLM 0.33's fused-MoE layer takes its Triton path there: vLLM's own Triton ``fused_moe_kernel`` around
the torch-native stand-ins of ``tests/gpu/host/vllm_native_C.py`` for the routing and bookkeeping
kernels (``topk_softmax``, ``topk_sigmoid``, ``grouped_topk``, ``moe_align_block_size``, ``moe_sum``).
For each model (2 layers, hidden 128, heads of 64, 8 experts, top-2, expert width 64, vocabulary 512,
float32, saved to a temp dir without a tokenizer):

- ``qwen3_moe``: softmax top-2, renormalized (``topk_softmax``);
- ``qwen2_moe``: softmax top-2, not renormalized, plus a sigmoid-gated shared expert;
- ``mixtral``: softmax top-2, renormalized;
- ``glm4_moe``: DeepSeek-V3-style routing: sigmoid scores, random ``e_score_correction_bias``, 2 groups
  of which 1 is kept, routed scaling 2.5, a shared expert (``grouped_topk``, inside vLLM's torch.compile).

it starts a ``vllm.LLM`` (eager, Triton attention, vLLM's native custom ops), generates 8 greedy tokens
for 4 token-id prompts together (prefill and decode take the aligned-block path, ``moe_align_block_size``)
and for the first prompt alone (its decode steps take the per-token path), and holds the tokens, the
prompt logprobs and the sampled tokens' logprobs against the HF model's on the same GPU in float32. It
prints one JSON line per model (``"model"`` first) and exits 1 if an engine failed to start or a run
failed; differing tokens are reported, not fatal. The engine's float32 floor there is about 2e-4.

vLLM's Triton MoE kernel computes float32 dots in TF32 by default (Triton's default); ``--ieee`` sets
``TRITON_F32_DEFAULT=ieee`` for the engines, to take that out of the gap.

Run on the GPU host, from the project root:
    source .gpu-carry/setup.sh && python3 tests/gpu/moe_engine_probe.py [--ieee] [MODEL ...]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [400, 401, 402, 403], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42, 13, 250, 500, 3]]
MAX_TOKENS = 8
GAPS = ("prompt_logprob_gap", "sampled_logprob_gap")  # |vLLM - HF| on the prompt tokens, on the generated ones
COMMON = dict(
    vocab_size=512,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
MODELS = {
    "qwen3_moe": "softmax top-2, renormalized",
    "qwen2_moe": "softmax top-2, not renormalized, sigmoid-gated shared expert",
    "mixtral": "softmax top-2, renormalized",
    "glm4_moe": "sigmoid + e_score_correction_bias, 2 groups keep 1, top-2, renormalized, x2.5, shared expert",
}


def tiny_model_dir(name: str, seed: int = 0) -> tuple[str, str]:
    """Save a random float32 HF model of ``name`` to a temp dir; return the dir and its architecture."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    if name == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(
            tf.Qwen3MoeConfig(num_experts=8, moe_intermediate_size=64, norm_topk_prob=True, **COMMON)
        )
    elif name == "qwen2_moe":
        config = tf.Qwen2MoeConfig(
            num_experts=8, moe_intermediate_size=64, shared_expert_intermediate_size=128, norm_topk_prob=False, **COMMON
        )
        model = tf.Qwen2MoeForCausalLM(config)
    elif name == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(num_local_experts=8, intermediate_size=64, **COMMON))
    elif name == "glm4_moe":
        config = tf.Glm4MoeConfig(
            n_routed_experts=8,
            moe_intermediate_size=64,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            n_shared_experts=1,
            first_k_dense_replace=0,
            **COMMON,
        )
        model = tf.Glm4MoeForCausalLM(config)
        with torch.no_grad():  # a bias that changes which experts win (HF initializes it to zeros)
            for layer in model.model.layers:
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.05)
    else:
        raise ValueError(f"unknown model {name!r}; one of {sorted(MODELS)}")
    path = tempfile.mkdtemp(prefix=f"tiny-{name}-")
    model.to(torch.float32).save_pretrained(path)
    return path, type(model).__name__


def start_engine(path: str):
    from vllm import LLM

    return LLM(
        model=path,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        attention_backend="TRITON_ATTN",
        compilation_config={"custom_ops": ["none"]},
        gpu_memory_utilization=0.3,
        max_model_len=256,
        max_num_seqs=16,
        seed=0,
    )


def stop_engine(llm) -> None:
    """End the engine core (else it keeps a log pipe open), then drop the engine."""
    try:
        llm.llm_engine.engine_core.shutdown(timeout=5.0)
    except Exception:  # noqa: BLE001  # an engine core that died has nothing left to stop
        traceback.print_exc()


def moe_backends(llm) -> list[str] | str:
    """The unquantized MoE backends vLLM chose for the model's layers (expected: TRITON)."""

    def backends(worker):  # runs in vLLM's worker (cloudpickled: defined here)
        found = set()
        for module in worker.get_model().modules():
            backend = getattr(getattr(module, "quant_method", None), "unquantized_backend", None)
            if backend is not None:
                found.add(getattr(backend, "value", str(backend)))
        return sorted(found)

    try:
        (result,) = llm.collective_rpc(backends)
        return result
    except Exception as error:  # noqa: BLE001  # informative only
        return f"unknown ({type(error).__name__}: {error})"


def served(llm, prompts: list[list[int]]) -> list[tuple[list[int], list[float], list[float]]]:
    """Per prompt: vLLM's greedy tokens, its logprob of every prompt token after the first, and of each token
    it generated."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, prompt_logprobs=0, logprobs=0, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    result = []
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        prompt_lp = [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], prompt[1:])]
        sampled_lp = [entry[token].logprob for entry, token in zip(completion.logprobs, tokens)]
        result.append((tokens, prompt_lp, sampled_lp))
    return result


def load_hf(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    try:  # transformers 5: loop over experts in plain torch (the most direct reference)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager")
    except (TypeError, ValueError):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.cuda().eval()


def hf_greedy(model, prompt: list[int]) -> list[int]:
    """Greedy tokens by full forwards (no cache, no generation config)."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids], device="cuda")).logits[0, -1]
            ids.append(int(logits.float().argmax()))
    return ids[len(prompt) :]


def hf_logprobs(model, tokens: list[int]) -> list[float]:
    """HF's logprob of each token after the first, given the ones before it."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([tokens], device="cuda")).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[i, tokens[i + 1]].item() for i in range(len(tokens) - 1)]


def compare(hf, prompts: list[list[int]], runs) -> dict:
    prompt_gap = sampled_gap = 0.0
    mismatched = []
    for prompt, (tokens, prompt_lp, sampled_lp) in zip(prompts, runs):
        reference = hf_logprobs(hf, prompt + tokens)  # along vLLM's tokens, so a differing token still compares
        prompt_gap = max([prompt_gap] + [abs(a - b) for a, b in zip(prompt_lp, reference)])
        sampled_gap = max([sampled_gap] + [abs(a - b) for a, b in zip(sampled_lp, reference[len(prompt) - 1 :])])
        expected = hf_greedy(hf, prompt)
        if tokens != expected:
            mismatched.append({"prompt": prompt, "vllm": tokens, "hf": expected})
    return {"prompt_logprob_gap": prompt_gap, "sampled_logprob_gap": sampled_gap, "mismatched": mismatched}


def probe(name: str) -> tuple[dict, bool]:
    """One model: its JSON record, and whether it ran (engine started, comparison done)."""
    record: dict = {"model": name, "routing": MODELS[name]}
    try:
        path, record["architecture"] = tiny_model_dir(name)
    except Exception as error:  # noqa: BLE001  # reported per model
        traceback.print_exc()
        record["error"] = f"building the HF model failed: {type(error).__name__}: {error}"
        return record, False
    started = time.perf_counter()
    try:
        llm = start_engine(path)
    except Exception as error:  # noqa: BLE001  # the engine core's own traceback is in the log above
        traceback.print_exc()
        record["error"] = f"engine failed to start: {type(error).__name__}: {error}"
        return record, False
    record["engine_start_s"] = round(time.perf_counter() - started, 1)
    try:
        record["moe_backend"] = moe_backends(llm)
        together = served(llm, PROMPTS)  # prefill and decode: aligned blocks (moe_align_block_size)
        alone = served(llm, PROMPTS[:1])  # decode of one token a step: per-token blocks
    except Exception as error:  # noqa: BLE001
        traceback.print_exc()
        record["error"] = f"generation failed: {type(error).__name__}: {error}"
        return record, False
    finally:
        stop_engine(llm)
        del llm
        gc.collect()
    try:
        hf = load_hf(path)
        batch, solo = compare(hf, PROMPTS, together), compare(hf, PROMPTS[:1], alone)
        del hf
    except Exception as error:  # noqa: BLE001
        traceback.print_exc()
        record["error"] = f"HF comparison failed: {type(error).__name__}: {error}"
        return record, False
    mismatched = batch["mismatched"] + solo["mismatched"]
    record.update(
        tokens_match=not mismatched,
        max_logprob_gap=float(f"{max(run[gap] for run in (batch, solo) for gap in GAPS):.3g}"),
        **{gap: float(f"{batch[gap]:.3g}") for gap in GAPS},
        **{f"solo_{gap}": float(f"{solo[gap]:.3g}") for gap in GAPS},
    )
    if mismatched:
        record["mismatched"] = mismatched
    return record, True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", metavar="MODEL", help=f"of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--ieee", action="store_true", help="TRITON_F32_DEFAULT=ieee for the engines (no TF32)")
    args = parser.parse_args()
    if unknown := sorted(set(args.models) - set(MODELS)):
        parser.error(f"unknown models {unknown}")
    if args.ieee:
        os.environ["TRITON_F32_DEFAULT"] = "ieee"  # the engine core inherits it when it starts
    # The backend check runs a function in vLLM's worker (collective_rpc), which needs pickle: as the GPU tier.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import torch

    torch.zeros(1, device="cuda")  # CUDA in use here: vLLM spawns each engine core (the same way every time)
    precision = os.environ.get("TRITON_F32_DEFAULT", "tf32 (Triton's default)")
    all_ran = True
    for name in args.models or list(MODELS):
        record, ran = probe(name)
        record["triton_f32_default"] = precision
        all_ran &= ran
        print(json.dumps(record), flush=True)
    return 0 if all_ran else 1


if __name__ == "__main__":  # vLLM spawns its engine core, which imports this file again
    sys.exit(main())
