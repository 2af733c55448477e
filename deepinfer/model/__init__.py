"""Engine model per family (V4 first): flat varlen batches, paged caches, ops through `kernels.get`.

Must not: import `deepinfer.reference` (the oracle is an independent second implementation).
"""
from deepinfer.model.cache import V4Cache
from deepinfer.model.context import ForwardContext, SeqContext, forward_context, get_forward_context
from deepinfer.model.params import prepare_params
from deepinfer.model.v4 import V4EngineModel

__all__ = ["ForwardContext", "SeqContext", "V4Cache", "V4EngineModel", "forward_context", "get_forward_context",
           "prepare_params"]
