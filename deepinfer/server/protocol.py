"""Request bodies of the OpenAI routes (pydantic) and their translation into `SamplingParams`.

Parsing is lax in types where OpenAI's own server is (ints as floats, ...) but every rejection becomes an
`APIError` 400 naming the parameter; nothing a client sends can surface as a 500.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from deepinfer.sampling import SamplingParams
from deepinfer.server.errors import APIError, bad_request, param_of

MAX_N = 64  # choices per request: bounds the engine requests one HTTP request can create
_SEED_LIMIT = 2**63 - MAX_N  # child seeds are seed + k; torch takes 64-bit seeds
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "stop_token_ids", "stop", "seed",
                    "logprobs", "n", "ignore_eos", "include_stop_str_in_output")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    max_tokens: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    # vLLM extras (openai client: extra_body)
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    user: Optional[str] = None


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None


class ChatRequest(_Common):
    messages: list[dict[str, Any]]
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None


def parse(model_cls: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ())) or None
        raise bad_request(f"invalid parameter {loc}: {err.get('msg')}", param=loc) from None
    except (ValueError, TypeError, RecursionError) as e:
        raise bad_request(f"invalid request: {e}") from None


def sampling_params(req: _Common, max_tokens: int, logprobs: int | None) -> list[SamplingParams]:
    """One SamplingParams per choice (n of them): seeded requests get seed, seed+1, ... as LLM.generate."""
    if req.presence_penalty or req.frequency_penalty:
        raise bad_request("presence_penalty / frequency_penalty are not supported", param="presence_penalty")
    if req.seed is not None and not -_SEED_LIMIT < req.seed < _SEED_LIMIT:
        raise bad_request(f"seed must be within +-{_SEED_LIMIT}", param="seed")
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got {req.n}", param="n")
    kwargs: dict[str, Any] = dict(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p, max_tokens=max_tokens, stop=req.stop,
        stop_token_ids=req.stop_token_ids, seed=req.seed, logprobs=logprobs, ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output)
    if kwargs["temperature"] > 2:  # OpenAI's range is [0, 2]; SamplingParams checks the rest
        raise bad_request(f"temperature must be in [0, 2], got {kwargs['temperature']}", param="temperature")
    try:
        base = SamplingParams(**kwargs)
    except ValueError as e:
        raise bad_request(str(e), param=param_of(str(e), _SAMPLING_FIELDS)) from None
    return [replace(base, seed=None if base.seed is None else base.seed + k) for k in range(req.n)]


def check_length(prompt_len: int, max_tokens: int | None, max_model_len: int, default: int | None) -> int:
    """max_tokens to use; rejects prompts that leave no room and explicit max_tokens beyond the context
    (vLLM's behaviour: 400 rather than a silently shortened answer)."""
    if prompt_len >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                       f"{prompt_len} tokens and leaves no room for a completion", param="messages",
                       code="context_length_exceeded")
    room = max_model_len - prompt_len
    if max_tokens is None:
        return min(default, room) if default is not None else room
    if max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if max_tokens > room:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                       f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
                       f"for the completion)", param="max_tokens", code="context_length_exceeded")
    return max_tokens
