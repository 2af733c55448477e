"""Turning logits into tokens: sampling parameters, filters, the sampler (with logprobs of the very
logits it sampled), prompt logprobs and stop conditions."""
from deepinfer.sampling.logprobs import TokenLogprobs, gather_logprobs, prompt_logprobs
from deepinfer.sampling.params import MAX_LOGPROBS, RequestOutputKind, SamplingParams
from deepinfer.sampling.sampler import Sampler, SamplerOutput, make_generator
from deepinfer.sampling.stop import StopChecker, StopMatch

__all__ = [
    "MAX_LOGPROBS", "RequestOutputKind", "Sampler", "SamplerOutput", "SamplingParams", "StopChecker", "StopMatch", "TokenLogprobs",
    "gather_logprobs", "make_generator", "prompt_logprobs",
]
