"""DeepInfer: an inference engine for the DeepSeek-V4 family whose tokens match the official reference.

The public offline API (LLM, SamplingParams) arrives with the serving engine; today the package offers
the checkpoint format, tokenizer and chat encoding, the reference oracle and the `deepinfer` CLI.
"""
__version__ = "0.1.0"
