"""Request bodies of the OpenAI-compatible API, and OpenAI-style errors.

Unknown-field policy (vLLM accepts and ignores unknown fields with a warning; we are stricter, so a
typo never silently changes what a client gets):

- a top-level field this server does not know is a 400 that names it (`param`);
- known OpenAI fields that do not change the output (`user`, `metadata`, `store`, `service_tier`,
  `parallel_tool_calls`) are accepted and ignored;
- known fields whose feature is not implemented (`frequency_penalty`, `presence_penalty`,
  `repetition_penalty`, `logit_bias`, `best_of`, `echo`, `suffix`, `tools`, `tool_choice`,
  `response_format`, `n`) are accepted only at their neutral value (0, 0, 1, empty, 1, false,
  empty, empty, "none", text, 1); anything else is a 400 saying it is not supported.

Types are strict (no "5" for 5, no true for 1, no NaN or infinity); ranges are checked by
`SamplingParams` (one place for both the offline and the HTTP API).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from loopserve.sampling_params import SamplingParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class ApiError(Exception):
    """An error the client gets as an OpenAI-style body: {"error": {message, type, param, code}}."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
             408: "RequestTimeoutError", 413: "RequestTooLargeError", 500: "InternalServerError",
             503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ApiError.TYPES.get(status, "Error"), "param": param,
                      "code": status}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = False  # vLLM extension: choices[].token_ids, prompt_token_ids
    # looped-model extensions
    min_loops: int | None = None
    max_loops: int | None = None
    exit_threshold: float | None = None
    exit_policy: str | None = None
    exit_trace: list[int] | None = None  # per-token exit depths to replay (benchmarks)
    # known, output-neutral: ignored
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # known, not implemented: neutral values only
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    logit_bias: dict[str, float] | None = None

    def check_unsupported(self) -> None:
        neutral = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
        for name, value in neutral.items():
            v = getattr(self, name)
            if v is not None and v != value:
                raise ApiError(400, f"{name}: not supported by this server (only {value} is accepted)", name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias: not supported by this server", "logit_bias")
        if self.n is not None and self.n != 1:
            raise ApiError(400, "n: only n=1 is supported", "n")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options: only allowed with stream=true", "stream_options")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise ApiError(400, "seed: must fit in a signed 64-bit integer", "seed")

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise ApiError(400, "echo: not supported by this server", "echo")
        if self.suffix:
            raise ApiError(400, "suffix: not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != 1:
            raise ApiError(400, "best_of: only best_of=1 is supported", "best_of")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.tools:
            raise ApiError(400, "tools: tool calling is not supported by this server", "tools")
        if self.tool_choice not in (None, "none"):
            raise ApiError(400, "tool_choice: tool calling is not supported by this server", "tool_choice")
        if self.response_format and self.response_format.get("type") != "text":
            raise ApiError(400, "response_format: only {'type': 'text'} is supported", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
        if not self.messages:
            raise ApiError(400, "messages: must not be empty", "messages")


def parse_body(cls: type[_SamplingFields], body: bytes) -> Any:
    """Validate a JSON body; every failure is a 400 naming the field."""
    if not body.strip():
        raise ApiError(400, "request body: expected a JSON object, got an empty body")
    try:
        req = cls.model_validate_json(body)
    except ValidationError as e:
        raise ApiError(400, *_describe(e)) from None
    req.check_unsupported()
    return req


def _describe(e: ValidationError) -> tuple[str, str | None]:
    err = e.errors(include_url=False)[0]
    kind = err["type"]
    loc = [str(x) for x in err["loc"]]
    if kind == "json_invalid":
        return f"request body: malformed JSON ({err['msg']})", None
    if kind in ("model_type", "model_attributes_type") and not loc:
        return "request body: expected a JSON object", None
    # union errors repeat the field per member type: keep the field path, drop the member tags
    path = [p for p in loc if not (p.startswith(("str", "list[", "int", "float", "bool", "dict", "TextPart"))
                                   or p.endswith("]"))]
    param = ".".join(path) or None
    if kind == "extra_forbidden":
        return f"{param}: unknown field (not supported by this server)", param
    if kind == "missing":
        return f"{param}: field required", param
    return f"{param}: {err['msg']}", param


def sampling_params(req: _SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                    defaults: dict[str, Any]) -> SamplingParams:
    """SamplingParams of a request; its range checks become 400s naming the field."""
    ext = {k: getattr(req, k) if getattr(req, k) is not None else defaults.get(k)
           for k in ("min_loops", "max_loops", "exit_threshold", "exit_policy")}
    kwargs: dict[str, Any] = dict(
        max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p, seed=req.seed, stop=req.stop,
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=bool(req.ignore_eos),
        skip_special_tokens=req.skip_special_tokens is not False, logprobs=logprobs, exit_trace=req.exit_trace,
        **ext)
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise ApiError(400, str(e), _param_of(str(e))) from None


def _param_of(message: str) -> str | None:
    head = message.split(":", 1)[0]
    return head if head.isidentifier() else None
