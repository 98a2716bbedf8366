"""loopserve: a serving engine for looped (recurrent-depth) language models."""

from loopserve.engine.config import EngineConfig
from loopserve.engine.engine import LLMEngine
from loopserve.llm import LLM
from loopserve.outputs import CompletionOutput, Logprob, RequestOutput
from loopserve.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutputKind", "GuidedDecodingParams",
           "RequestOutput", "CompletionOutput", "Logprob"]
