"""The pieces of a response that completions and chat share: what a stream has sent of a choice
(`ChoiceStream`), logprobs in OpenAI's two shapes (`LogprobFormatter`), `usage` (with the loop counts),
SSE framing (`sse`), and the streaming response that aborts its engine requests however it ends and
reports a request that fails mid-stream (`StreamFailed`), with the log filter that keeps uvicorn from logging
such a deliberate cut as an error of its own (`CutStreamFilter`).
"""

from __future__ import annotations

import contextvars
import itertools
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from loopserve.engine.engine_thread import RequestGroup
from loopserve.outputs import CompletionOutput, Logprob, RequestOutput
from loopserve.serve.protocol import ApiError
from loopserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from loopserve.serve.reasoning_parsers import ThinkParser
    from loopserve.serve.structured import ToolListScanner
    from loopserve.serve.tool_parsers import HermesParser

log = logging.getLogger("loopserve.serve")
MIN_LOGPROB = -9999.0  # JSON has no -inf
# set in the task of a request whose stream `GroupStreamingResponse` cut on purpose (`CutStreamFilter`)
_STREAM_CUT: contextvars.ContextVar[bool] = contextvars.ContextVar("loopserve_stream_cut", default=False)


def _lp(x: float) -> float:
    return max(x, MIN_LOGPROB) if x == x else MIN_LOGPROB


class ChoiceStream:
    """What has been sent of one choice: tokens, the text offset, the echoed prompt, the finish, and for a
    "required" tool call the scanner that reads its list as it comes (`structured.ToolListScanner`; the text is
    kept only until a call's name is complete: cut before, it is sent as content), and for tool_choice "auto" the
    parser of the model's own calls (`tool_parsers`), and with --reasoning-parser the splitter of its reasoning
    (`reasoning_parsers`). A stream's outputs are DELTA
    ones (the engine holds back text a stop string may still cut), so each chunk costs what is new, not the
    choice's length."""

    def __init__(self) -> None:
        self.chunks = 0
        self.tokens = 0
        self.parts: list[str] = []  # a "required" tool call's text, until a call is named
        self.offset = 0  # text_offset of the next token (completions logprobs)
        self.echoed = False  # completions with echo: the prompt has been sent
        self.finish_reason: str | None = None  # sent with the choice's last chunk
        self.call_id: str | None = None  # a named tool call's, once its first chunk is sent
        self.tool_scan: ToolListScanner | None = None  # a "required" tool call's
        self.tool_parse: HermesParser | None = None  # tool_choice "auto"'s parser of the model's own calls
        self.called = False  # "auto": the output is tool calls (a stream's, once one is named)
        self.reason_parse: ThinkParser | None = None  # --reasoning-parser's, of this choice's reasoning and content

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LogprobFormatter:
    """One request's logprobs in OpenAI's shapes. `tokens_as_ids`: vLLM's return_tokens_as_token_ids, the request's
    (or the server's default): every token string written "token_id:<id>"."""

    def __init__(self, tokenizer: Tokenizer, tokens_as_ids: bool = False) -> None:
        self.tok, self.tokens_as_ids = tokenizer, tokens_as_ids

    def token_str(self, tid: int) -> str:
        if self.tokens_as_ids:  # (vLLM's: so are the text offsets and bytes taken from it)
            return f"token_id:{tid}"
        return self.tok.decode([tid], skip_special_tokens=False)

    def completion_logprobs(self, c: CompletionOutput, count: int, top: int, d: ChoiceStream,
                            echo: RequestOutput | None = None) -> dict | None:
        """Legacy completions logprobs of c's first `count` tokens, each with its `top` alternatives (the request's
        `logprobs`) and itself; with `echo`, the prompt's tokens first (the first has none: nothing precedes it), cut
        to as many though `prompt_logprobs` asked for more (vLLM's rule: an entry's first top + 1, the token first)."""
        if c.logprobs is None:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        pairs: list[tuple[int, dict[int, Logprob] | None]] = []
        if echo is not None:
            scored = echo.prompt_logprobs or [None] * len(echo.prompt_token_ids)
            pairs += zip(echo.prompt_token_ids, scored, strict=True)
        pairs += ((c.token_ids[k], c.logprobs[k]) for k in range(count))
        for tid, entry in pairs:
            s = self.token_str(tid)
            out["tokens"].append(s)
            out["token_logprobs"].append(None if entry is None else _lp(entry[tid].logprob))
            kept = itertools.islice(entry.items(), top + 1) if entry is not None else ()
            ranked = sorted(kept, key=lambda kv: kv[1].rank or 0)
            alternatives = {self.token_str(t): _lp(v.logprob) for t, v in ranked}
            out["top_logprobs"].append(None if entry is None else alternatives)
            out["text_offset"].append(d.offset)
            d.offset += len(s)
        return out

    def prompt_logprobs(self, out: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's `prompt_logprobs` field: per prompt token, None for the first, else {token id: logprob,
        rank, decoded token} for the token and the top ones."""
        if out.prompt_logprobs is None:
            return None
        return [None if entry is None else {str(t): {"logprob": _lp(v.logprob), "rank": v.rank,
                                                     "decoded_token": v.decoded_token} for t, v in entry.items()}
                for entry in out.prompt_logprobs]

    def chat_logprobs(self, c: CompletionOutput, count: int, top: int) -> dict | None:
        if c.logprobs is None:
            return None
        content = []
        for k in range(count):
            tid, entry = c.token_ids[k], c.logprobs[k]
            s = self.token_str(tid)
            ranked = sorted(((t, v) for t, v in entry.items() if v.rank is not None and v.rank <= top),
                            key=lambda kv: kv[1].rank or 0)
            content.append({"token": s, "logprob": _lp(entry[tid].logprob), "bytes": list(s.encode()),
                            "top_logprobs": [{"token": self.token_str(t), "logprob": _lp(v.logprob),
                                              "bytes": list(self.token_str(t).encode())} for t, v in ranked]})
        return {"content": content}


# vLLM returns its response models whole, so a field it has that an answer does not set reads null; a client that
# indexes the JSON (`body["system_fingerprint"]`, `message["refusal"]`) found none of these keys in loopserve's
_RESPONSE_NULLS = ("service_tier", "system_fingerprint", "kv_transfer_params")
_NULLS = {True: (_RESPONSE_NULLS + ("prompt_logprobs", "prompt_token_ids"), ("token_ids",),
                 ("refusal", "annotations", "audio", "function_call", "reasoning")),
          False: (_RESPONSE_NULLS, ("token_ids", "prompt_logprobs", "prompt_token_ids"), ())}


def with_vllms_nulls(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """A chat or completion response (not streamed) with vLLM's fields it leaves unset as null."""
    top, choice, message = _NULLS[chat]
    for key in top:
        body.setdefault(key, None)
    for c in body["choices"]:
        for key in choice:
            c.setdefault(key, None)
        for key in message:
            c["message"].setdefault(key, None)
    return body


def usage_body(outs: list[RequestOutput], completion_tokens: int,
               sample: CompletionOutput | None = None) -> dict[str, Any]:
    """The usage of the requests `outs` (a stream's chunk of one choice with continuous usage: the choice's
    own request, and the choice as `sample`, whose own decode loops it counts; its prompt's are its request's).
    `completion_tokens`: what the response sent (0 for echo with max_tokens 0: the one token the engine ran is
    not sent). `prompt_tokens_details.cached_tokens`: prompt tokens served from the prefix cache (OpenAI's
    field)."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    if sample is not None and sample.metrics is not None:
        loops = sample.metrics.loops_run
    else:
        loops = sum(o.metrics.loops_run for o in outs if o.metrics is not None)
    prefill_loops = sum(o.metrics.prefill_loops for o in outs if o.metrics is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)},
            "loops": loops, "prefill_loops": prefill_loops}


_LINE_SEPARATORS = {0x2028: "\\u2028", 0x2029: "\\u2029"}  # (as JSON escapes)


def sse(obj: Any) -> str:
    """One SSE event of `obj` as JSON. U+2028 and U+2029 are written escaped: SSE does not end a line at them, but
    readers that split lines by Python's rules (httpx's `iter_lines`) do, and cut the event in two."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False).translate(_LINE_SEPARATORS)
    return f"data: {text}\n\n"


class StreamFailed(ApiError):
    """A request that failed after its stream started (its status is sent already), raised inside the
    stream with the status and message a non-streamed response would have. `GroupStreamingResponse` sends
    it as one in-band error event in OpenAI's shape (`data: {"error": {...}}`: the openai client raises it
    as an `APIError` with the message), then cuts the transport, with no [DONE]: a clean EOF, or an
    in-band error followed by [DONE], would read as success to some clients (vLLM's bench client); a
    broken chunked stream does not."""


async def _error_event_on_failure(content: AsyncIterator[str]) -> AsyncIterator[bytes]:
    """`content`, encoded here (so that a chunk which cannot be encoded fails in this stream, not in the server's
    send loop), then, if it raises `StreamFailed`, its error event before the failure goes on to cut. Any other
    exception is a bug the request triggered: the stream ends as a failure does (its traceback logged at the cut),
    with a 500 error event (the status a plain response gets) and a cut, never a silent one (vLLM's streams also
    end an unexpected error with an error event)."""
    try:
        async for chunk in content:
            yield chunk.encode()
    except StreamFailed as e:
        yield sse(e.body()).encode()
        raise
    except Exception as e:  # (logged with its traceback where the cut is: `GroupStreamingResponse`)
        failed = StreamFailed(500, f"internal error: {type(e).__name__}")
        yield sse(failed.body()).encode()
        raise failed from e


class GroupStreamingResponse(StreamingResponse):
    """A streaming response that aborts its engine requests (`group`; None: a beam search's result, streamed once
    the search is over) however the stream ends, and ends a failed one with its error event and a cut
    (`StreamFailed`)."""

    def __init__(self, content: AsyncIterator[str], group: RequestGroup | None) -> None:
        super().__init__(_error_event_on_failure(content), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.group = group

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except StreamFailed as e:
            # Returning without the final chunk makes the server close the connection mid-stream,
            # without the traceback an exception would log for what is an engine-side failure.
            # (a 4xx: the request's own input; 503: the server's shutdown, or an engine failure logged already: not an
            # error of the server's either way)
            # (the traceback only of a bug inside the stream: `_error_event_on_failure` made it a StreamFailed from it)
            log.log(logging.WARNING if e.status < 500 or e.status == 503 else logging.ERROR, "%s: stream cut: %s",
                    scope.get("path"), e, exc_info=e.__cause__ is not None)
            _STREAM_CUT.set(True)  # (this request's task: uvicorn logs its "without completing" line from it)
        finally:
            if self.group is not None:  # (None: nothing left running, a beam search's result)
                self.group.abort()


class QuietPathsFilter(logging.Filter):
    """For uvicorn's access logger (`cli.uvicorn_log_config`, vLLM's --disable-access-log-for-endpoints): drops the
    lines of requests to `paths` (the path without its query string: /health?x=1 is /health)."""

    def __init__(self, paths: list[str]) -> None:
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args  # uvicorn's: (client, method, path with its query, HTTP version, status)
        if not isinstance(args, tuple) or len(args) < 3:
            return True
        return str(args[2]).split("?", 1)[0] not in self.paths


class CutStreamFilter(logging.Filter):
    """For uvicorn's error logger (`cli.uvicorn_log_config`): drops its "ASGI callable returned without completing
    response." ERROR line for a stream `GroupStreamingResponse` cut on purpose (it logged the cut and its cause
    itself); the line stays for any other response left incomplete."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_STREAM_CUT.get() and "without completing response" in str(record.msg))
