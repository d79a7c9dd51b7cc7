"""Request bodies of ollama's native API (pydantic), and its `options` as tandem's sampling parameters.

Top-level fields are as strict as the OpenAI bodies (an unknown one is a 400 naming it; null asks for
nothing), but the zero values ollama's own Go client always writes (`"template": ""`, `"system": ""`,
`"format": ""`) are taken as "not given". `keep_alive` is taken everywhere and means nothing here (a router
in front acts on it). `options` is checked here: the sampling options map to SamplingParams, the ones that
tune llama.cpp's loading or samplers tandem does not have are taken and ignored (IGNORED_OPTIONS), any other
name is a 400 naming it. Options not given keep the engine's defaults, as the OpenAI routes do (not ollama's
temperature 0.8 / top_k 40 / top_p 0.9 / repeat_penalty 1.1).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.frontend.http.errors import APIError
from tandem.frontend.http.schemas import Body, TokenId, Tool
from tandem.protocol.sampling_params import MAX_LOGPROBS

Think = bool | Literal["high", "medium", "low"]
Format = Literal["", "json"] | dict[str, Any]  # "" is ollama's Go client's "none"
KeepAlive = str | int | float  # a duration ("5m") or seconds; ignored here


class OllamaFunctionCall(Body):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: int | None = None  # newer ollama numbers a reply's calls


class OllamaToolCall(Body):
    id: str | None = None
    type: Literal["function"] | None = None
    function: OllamaFunctionCall


class OllamaMessage(Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    thinking: str | None = None  # an earlier reply's reasoning, handed to templates that show it
    images: list[str] | None = None  # base64, for a vision-language model
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None  # a tool message: the function whose result it is
    tool_call_id: str | None = None


class GenerationBody(Body):
    """What /api/chat and /api/generate both take."""

    model: str
    format: Format | None = None
    options: dict[str, Any] | None = None
    stream: bool = True  # ollama streams unless told not to
    keep_alive: KeepAlive | None = None
    think: Think | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class OllamaChatRequest(GenerationBody):
    messages: list[OllamaMessage] = Field(default_factory=list)  # none: "load the model" (done at once)
    tools: list[Tool] | None = None


class OllamaGenerateRequest(GenerationBody):
    prompt: str = ""  # empty: "load the model" (done at once)
    suffix: str = ""  # fill-in-the-middle: refused (no model here declares it)
    system: str = ""
    # ollama's Go template of the prompt: refused when given (the model's own chat template is used)
    template: str = ""
    context: list[TokenId] | None = None  # an earlier answer's `context`: the conversation so far
    raw: bool = False
    images: list[str] | None = None


class OllamaEmbedRequest(Body):
    model: str
    input: str | list[str]
    truncate: bool = True  # cut each input to the context length (ollama's default) rather than refuse it
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive | None = None
    dimensions: Annotated[int, Field(ge=1)] | None = None


class OllamaShowRequest(Body):
    model: str | None = None
    name: str | None = None  # ollama's older spelling of `model`
    verbose: bool = False


# ollama documents these but they tune what tandem does not have (llama.cpp's loading, context and threads,
# mirostat, tail-free and typical sampling, the penalty window): taken, and ignored.
IGNORED_OPTIONS = (
    "num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "numa", "low_vram", "f16_kv", "logits_all",
    "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_keep", "typical_p", "repeat_last_n",
    "penalize_newline", "tfs_z", "mirostat", "mirostat_tau", "mirostat_eta",
)


class _Options(BaseModel):
    """The options that map (bounds as SamplingParams'); lax types, as ollama's decoder takes 1.0 for 1."""
    model_config = ConfigDict(extra="forbid")

    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: int | None = None  # 0 or less: off (llama.cpp's)
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(le=2**63 - 1)] | None = None  # below 0: a random one (ollama's -1)
    num_predict: int | None = None  # 0 or less: until the end of the context (ollama's -1 and -2)
    stop: str | list[str] | None = None
    repeat_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None


def options_params(options: dict[str, Any] | None) -> dict[str, Any]:
    """`options` as SamplingParams fields (only what was given); a 400 naming an unknown or bad option."""
    given = {k: v for k, v in (options or {}).items() if k not in IGNORED_OPTIONS}
    unknown = sorted(set(given) - set(_Options.model_fields))
    if unknown:
        raise APIError(400, f"unknown option {unknown[0]!r} (this server takes "
                       f"{', '.join(_Options.model_fields)}; and ignores {', '.join(IGNORED_OPTIONS)})",
                       f"options.{unknown[0]}")
    try:
        o = _Options.model_validate(given)
    except ValidationError as e:
        err = e.errors()[0]
        where = "options." + ".".join(str(x) for x in err["loc"])
        raise APIError(400, f"{where}: {err['msg']}", where) from None
    p: dict[str, Any] = {
        "temperature": o.temperature, "top_p": o.top_p, "min_p": o.min_p,
        "repetition_penalty": o.repeat_penalty, "presence_penalty": o.presence_penalty,
        "frequency_penalty": o.frequency_penalty,
    }
    if o.top_k is not None:
        p["top_k"] = o.top_k if o.top_k > 0 else -1
    if o.seed is not None and o.seed >= 0:
        p["seed"] = o.seed
    if o.num_predict is not None and o.num_predict > 0:
        p["max_tokens"] = o.num_predict
    if o.stop is not None:
        p["stop"] = [s for s in ([o.stop] if isinstance(o.stop, str) else o.stop) if s]
    return {k: v for k, v in p.items() if v is not None}


def format_params(fmt: Format | None) -> dict[str, Any]:
    """`format` as the chat completions route's response_format says it: "json" any JSON object (json_object),
    a JSON schema that schema (json_schema)."""
    if fmt == "json":
        return {"json_object": True}
    if isinstance(fmt, dict):
        return {"json_schema": fmt}
    return {}


def think_kwargs(think: Think | None) -> dict[str, Any]:
    """`think` as the chat template's switch (enable_thinking; a level also as reasoning_effort)."""
    if think is None:
        return {}
    if isinstance(think, str):
        return {"enable_thinking": True, "reasoning_effort": think}
    return {"enable_thinking": think}

