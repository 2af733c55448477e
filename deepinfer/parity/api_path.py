"""The engine's full request path (scheduler -> runner -> sampler -> outputs) checked against the
reference: the request of interest runs greedily beside decoy requests of other lengths (so its logits
row is NOT row 0 and partial prefills sample no row), and at every generated step the token the API
returned must be the reference's argmax on the same prefix and the logprob it reported must be the
reference's log_softmax at that token. This catches what a model-level comparison cannot: logits rows
mapped to the wrong request (the seed's P4.2), and logprobs that never reach the output (P5: all 0.0).
With `speculative=k` the engine drafts k tokens per step with the checkpoint's MTP layer and verifies
them in the same extend, so a request samples k+1 rows per step (the row map under drafting); greedy
verification is lossless, so the same per-token judgement applies.
"""
from __future__ import annotations

from pathlib import Path

import torch

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.reference import load_reference
from deepinfer.sampling import SamplingParams

LOGPROB_TOLERANCE = {"exact": 1e-6, "official": 1e-2}


def api_rows(model_dir: str | Path, ids: list[int], steps: int, numerics: str,
             speculative: int = 0) -> tuple[list[dict], list[str]]:
    draft = {"method": "mtp", "num_speculative_tokens": speculative} if speculative else None
    config = EngineConfig(model=str(model_dir), numerics=numerics, max_model_len=max(512, len(ids) + steps + 1),
                          max_num_seqs=4, max_num_batched_tokens=64, num_blocks=16)
    engine = LLMEngine(config, speculative=draft)
    greedy = SamplingParams(temperature=0, max_tokens=steps, logprobs=1, ignore_eos=True)
    decoys = [[7] * 90, [11, 12, 13], [5] * 40]  # a long prefill in chunks, a short one, a middling one
    engine.add_request("decoy-0", decoys[0], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    engine.add_request("target", list(ids), greedy)
    for i, d in enumerate(decoys[1:], 1):
        engine.add_request(f"decoy-{i}", d, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    result = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == "target" and out.finished:
                result = out
    if result is None:
        raise ValueError("the target request did not finish")
    comp = result.outputs[0]
    ref = load_reference(model_dir, numerics=numerics, max_batch_size=1, max_seq_len=len(ids) + steps + 1,
                         progress=False)
    seq = torch.tensor([list(ids) + comp.token_ids[:-1]])
    logits = ref.forward(seq, 0, all_logits=True)[0][len(ids) - 1 :]  # row i predicts generated token i
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    rows, defects = [], []
    for i, tok in enumerate(comp.token_ids):
        want = int(logits[i].argmax())
        reported = comp.logprobs[i][tok].logprob if comp.logprobs else None
        expected = float(logprobs[i, tok])
        bad_lp = reported is None or abs(reported - expected) > LOGPROB_TOLERANCE[numerics]
        rows.append({"mode": "api+draft" if speculative else "api", "position": len(ids) - 1 + i,
                     "engine_top1": tok, "ref_top1": want, "reported_logprob": reported, "ref_logprob": expected, "flip": tok != want})
        if tok != want:
            defects.append(f"api step {i}: the API returned token {tok}, the reference's argmax is {want} "
                           "(a logits row mapped to the wrong request?)")
        if bad_lp:
            defects.append(f"api step {i}: reported logprob {reported} vs reference {expected:.6g} "
                           "(logprobs not taken from the sampled logits?)")
    return rows, defects
