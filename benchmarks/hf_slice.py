"""The same V4-Flash layer slice through transformers' DeepseekV4ForCausalLM (random init, bf16 weights: the
transformers model has no FP8/FP4 compute path), for the tokens/s ratio the issue asks for.

Decode: a batch of `batch` sequences with a `context`-token prompt prefilled, then one-token steps through its
DynamicCache; prefill: one sequence of `tokens` tokens. Times are CUDA-event medians of whole forwards
(transformers' own default attention and experts implementations, as a user would get them).
"""
from __future__ import annotations

import torch

from timing import cuda_time_ms


def build(num_layers: int, ratios: list[int]):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(num_hidden_layers=num_layers, compress_ratios=list(ratios),
                           mlp_layer_types=["moe"] * num_layers, num_nextn_predict_layers=0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = DeepseekV4ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    return model, cfg


@torch.no_grad()
def decode_ms(model, vocab: int, batch: int, context: int, reps: int = 5) -> float:
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, vocab, (batch, context), device="cuda", generator=g)
    out = model(ids, use_cache=True)
    pkv = out.past_key_values
    nxt = out.logits[:, -1:].argmax(-1)

    def step():
        nonlocal nxt
        o = model(nxt, past_key_values=pkv, use_cache=True)
        nxt = o.logits[:, -1:].argmax(-1)

    return cuda_time_ms(step, reps=reps, warmup=2)


@torch.no_grad()
def prefill_ms(model, vocab: int, tokens: int, reps: int = 3) -> float:
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, vocab, (1, tokens), device="cuda", generator=g)
    return cuda_time_ms(lambda: model(ids, use_cache=False, logits_to_keep=1), reps=reps, warmup=1)
