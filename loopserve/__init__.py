"""loopserve: a serving engine for looped (recurrent-depth) language models."""

from loopserve.llm import LLM
from loopserve.outputs import CompletionOutput, Logprob, RequestOutput
from loopserve.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "GuidedDecodingParams", "RequestOutput", "CompletionOutput",
           "Logprob"]
