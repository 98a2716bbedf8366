"""vLLM's `vllm.inputs` import path: it only re-exports the prompt types, which loopserve/engine/sequence.py owns."""

from loopserve.engine.sequence import PromptType, TextPrompt, TokensPrompt

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
