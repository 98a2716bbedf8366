"""vLLM's `vllm.engine.arg_utils` import path: it only re-exports `EngineArgs` and `AsyncEngineArgs`, which
loopserve/async_llm.py owns."""

from loopserve.async_llm import AsyncEngineArgs, EngineArgs

__all__ = ["AsyncEngineArgs", "EngineArgs"]
