"""The offline API: `LLM(model=DIR).generate(prompts, SamplingParams(...))` -> one `RequestOutput` per
prompt, in prompt order, shaped as vLLM users expect. `n > 1` fans out into n engine requests (seeded
requests get seed, seed+1, ...) whose completions are gathered under the prompt's output.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.outputs import RequestOutput
from deepinfer.sampling import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | Path | None = None, speculative: dict | None = None, **engine_kwargs) -> None:
        """speculative: e.g. {"method": "mtp" | "dspark", "num_speculative_tokens": k} (spec/)."""
        if model is None:
            from deepinfer.tiny import default_model_dir  # the embedded default model

            model = default_model_dir()
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_kwargs), speculative=speculative)
        self._counter = 0

    def shutdown(self) -> None:
        """Stop the worker ranks of a parallel engine (tensor/expert/data parallel); no-op in one process."""
        shutdown = getattr(self.engine.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion. A prompt is text or a list of token ids."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt (text or ids)
        params = sampling_params or SamplingParams()
        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        children: dict[str, tuple[int, int]] = {}  # engine request id -> (prompt index, completion index)
        added: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, per_prompt)):
                for k in range(p.n):
                    # FINAL_ONLY: generate() returns finished requests only, so the engine builds no output
                    # before a request ends (a per-step cumulative copy grows with the output's length)
                    child = replace(p, n=1, seed=None if p.seed is None else p.seed + k,
                                    output_kind=RequestOutputKind.FINAL_ONLY)
                    rid = f"gen-{self._counter}-{i}-{k}"
                    self.engine.add_request(rid, list(prompt) if not isinstance(prompt, str) else prompt, child)
                    children[rid] = (i, k)
                    added.append(rid)
        except ValueError:
            for rid in added:  # a bad prompt rejects the call; nothing of it stays queued
                self.engine.abort(rid)
            while self.engine.has_unfinished():
                self.engine.step()
            raise
        self._counter += 1
        results: list[RequestOutput | None] = [None] * len(prompts)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if not out.finished or out.request_id not in children:
                    continue
                i, k = children[out.request_id]
                completion = out.outputs[0]
                completion.index = k
                if results[i] is None:
                    results[i] = RequestOutput(f"gen-{self._counter - 1}-{i}", out.prompt, out.prompt_token_ids,
                                               [], out.prompt_logprobs, finished=True)
                merged = results[i]
                merged.outputs.append(completion)
                merged.num_output_tokens += out.num_output_tokens  # (over the prompt's n completions)
                if out.first_token_time is not None and (merged.first_token_time is None
                                                         or out.first_token_time < merged.first_token_time):
                    merged.first_token_time = out.first_token_time
                if out.error and not results[i].error:
                    results[i].error = out.error
        for r in results:
            r.outputs.sort(key=lambda c: c.index)
        return results
