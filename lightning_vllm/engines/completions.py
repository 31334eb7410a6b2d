"""What a vLLM server's ``/v1/completions`` route is sent so that it samples as an in-process engine would.

Every ``SamplingParams`` field the route takes under the same name is sent; a field set
to something the route cannot take is refused before the request, since the server
would silently sample differently.
"""

from __future__ import annotations

from typing import Any

# SamplingParams fields the completions route takes under the same name. Sampling
# knobs a model's generation_config.json could change on the server are always sent,
# so a server samples as an in-process engine does; the rest when not the default.
_ALWAYS_SENT = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_SENT_WHEN_SET = (
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "logprob_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "bad_words",
    "logit_bias",
    "allowed_token_ids",
    "structured_outputs",
    "thinking_token_budget",
    "repetition_detection",
    "watermarking",
)
# Fields about how an in-process engine formats its outputs, or that vLLM derives from
# the others (the server derives them again): nothing to send.
_NOT_SENT = (
    "output_kind",
    "skip_clone",
    "output_text_buffer_length",
    "detokenize",
    "flat_logprobs",
    "skip_reading_prefix_cache",
)


def completion_fields(sampling_params: Any) -> dict[str, Any]:
    """The ``/v1/completions`` body fields that make the server sample as ``sampling_params`` says.

    Raises:
        ValueError: a field is set that the completions route cannot take (e.g. ``extra_args``);
            sampling through the server would silently differ from sampling in process.
    """
    import msgspec
    from vllm import SamplingParams

    default = SamplingParams()
    changed = [
        name
        for name in SamplingParams.__struct_fields__
        if not name.startswith("_") and getattr(sampling_params, name) != getattr(default, name)
    ]
    refused = [name for name in changed if name not in _ALWAYS_SENT + _SENT_WHEN_SET + _NOT_SENT]
    if refused:
        raise ValueError(
            f"SamplingParams field(s) {refused} cannot be sent to a vLLM server's /v1/completions route, so the "
            "server would sample differently than an in-process engine. Leave them at their defaults when "
            "generating through HTTPEngine."
        )
    sent = [*_ALWAYS_SENT, *(name for name in _SENT_WHEN_SET if name in changed)]
    return {name: msgspec.to_builtins(getattr(sampling_params, name)) for name in sent}
