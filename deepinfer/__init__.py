"""DeepInfer: an inference engine for the DeepSeek-V4 family whose tokens match the official reference.

Offline API: `from deepinfer import LLM, SamplingParams; LLM(model=DIR).generate(prompts, SamplingParams())`.
"""
__version__ = "0.1.0"


def __getattr__(name: str):
    # lazy: `import deepinfer` stays cheap for the CLI and the pure-Python parts
    if name in ("LLM", "LLMEngine", "EngineConfig", "RequestOutput", "CompletionOutput", "Logprob"):
        from deepinfer import engine

        return getattr(engine, name)
    if name in ("SamplingParams", "RequestOutputKind"):
        from deepinfer import sampling

        return getattr(sampling, name)
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")


__all__ = ["LLM", "LLMEngine", "EngineConfig", "RequestOutput", "CompletionOutput", "Logprob", "SamplingParams",
           "RequestOutputKind"]
