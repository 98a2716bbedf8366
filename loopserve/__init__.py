"""loopserve: a serving engine for looped (recurrent-depth) language models."""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

try:
    __version__ = _version("loopserve")  # (vLLM's `vllm.__version__`; also `loopserve --version` and GET /version)
except _PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "unknown"

from loopserve.async_llm import AsyncEngineArgs, AsyncLLM, AsyncLLMEngine, EngineArgs
from loopserve.engine.config import EngineConfig
from loopserve.engine.engine import LLMEngine
from loopserve.engine.sequence import PromptType, TextPrompt, TokensPrompt
from loopserve.llm import LLM
from loopserve.outputs import CompletionOutput, Logprob, RequestOutput
from loopserve.sampling_params import (
    BeamSearchParams,
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from loopserve.vllm_neutral import PoolingParams

__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "AsyncLLM", "EngineArgs", "AsyncEngineArgs", "EngineConfig",
           "SamplingParams", "RequestOutputKind", "GuidedDecodingParams", "StructuredOutputsParams", "BeamSearchParams",
           "TextPrompt", "TokensPrompt", "PromptType", "PoolingParams", "RequestOutput", "CompletionOutput", "Logprob"]
