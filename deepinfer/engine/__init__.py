"""The serving engine: ModelRunner (one varlen forward per step), LLMEngine (add_request/step/abort),
and the offline `LLM` API."""
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.llm import LLM
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["EngineConfig", "LLM", "LLMEngine", "CompletionOutput", "Logprob", "RequestOutput"]
