"""Reference backend `--ref transformers`: transformers' `DeepseekV4ForCausalLM` (transformers >= 5.17,
`models/deepseek_v4`) on the same HF checkpoint directory, loaded by transformers itself (its own key
mapping; the FP8/FP4 weights dequantised to bf16 on load on every device, `FineGrainedFP8Config(dequantize=
True)`, which needs `accelerate`; its GPU FP8 path would fetch kernels from the hub). Its numerics are its
own: bf16 weights and activations, no activation quantisation.

Residual taps, at the same points as the oracle: the embedding output (expanded to hc streams), the
input of each decoder layer's `ffn_hc` (the residual after attention) and each decoder layer's output
(the residual after the FFN).

Must not: be imported unless asked for (transformers is optional); pretend to run when a part is missing:
every missing piece is a ValueError naming it (the CLI exits 3).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from deepinfer.config import ModelConfig

MIN_VERSION = "5.17"


def _import_model_class():
    try:
        import transformers
    except ImportError:
        raise ValueError(f"--ref transformers needs the 'transformers' package (>= {MIN_VERSION}, with "
                         "models/deepseek_v4) and 'accelerate': pip install 'transformers>=5.17' accelerate") from None
    cls = getattr(transformers, "DeepseekV4ForCausalLM", None)
    if cls is None:
        raise ValueError(f"transformers {transformers.__version__} has no DeepseekV4ForCausalLM: install "
                         f"transformers >= {MIN_VERSION}")
    return cls


class TransformersReference:
    """`forward(ids [1, S], start_pos)` -> last-position logits [1, V] (fp32) with a transformers cache kept
    between calls; `tap` / `embed_transform` as in `backends.py`."""

    def __init__(self, model_dir: str | Path, max_seq_len: int = 4096) -> None:
        if ModelConfig.from_checkpoint(model_dir).is_v41:
            raise ValueError("--ref transformers: transformers has no DeepSeek-V4.1 model (DeepseekV4 only)")
        cls = _import_model_class()
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        from transformers import FineGrainedFP8Config

        try:  # dequantised on every device: one numerics, and no FP8 kernels fetched from the hub on a GPU
            self.model = cls.from_pretrained(str(model_dir), dtype=torch.bfloat16, device_map=str(self.device),
                                             quantization_config=FineGrainedFP8Config(dequantize=True))
        except ImportError as e:  # e.g. the FP8 quantizer's "requires accelerate"
            raise ValueError(f"--ref transformers could not load {model_dir}: {e}") from None
        self.model.eval()
        self.max_seq_len = max_seq_len
        self.cache = None
        self.seen = 0
        self.tap: Callable[[str, torch.Tensor], None] | None = None
        self.embed_transform: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._install_hooks()

    def _install_hooks(self) -> None:
        inner = self.model.model
        hc = inner.config.hc_mult

        def on_embed(_module, _inputs, out):
            if self.embed_transform is not None:
                out = self.embed_transform(out)
            if self.tap:
                self.tap("embed", out.unsqueeze(2).expand(-1, -1, hc, -1))
            return out

        inner.embed_tokens.register_forward_hook(on_embed)
        for i, layer in enumerate(inner.layers):
            layer.ffn_hc.register_forward_pre_hook(self._tapper(f"layers.{i}.attn", from_input=True))
            layer.register_forward_hook(self._tapper(f"layers.{i}.ffn", from_input=False))

    def _tapper(self, name: str, from_input: bool):
        def hook(_module, inputs, out=None):
            if self.tap:
                self.tap(name, inputs[0] if from_input else out)

        if from_input:
            return lambda module, inputs: hook(module, inputs)
        return hook

    def forward(self, ids: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        if start_pos == 0:
            self.cache, self.seen = None, 0
        if start_pos != self.seen:
            raise ValueError(f"transformers reference: start_pos {start_pos} but {self.seen} tokens are cached")
        if start_pos + ids.shape[1] > self.max_seq_len:
            raise ValueError(f"transformers reference: {start_pos + ids.shape[1]} tokens > max_seq_len "
                             f"{self.max_seq_len}")
        try:
            with torch.no_grad():
                out = self.model(input_ids=ids.to(self.device), past_key_values=self.cache, use_cache=True)
        except ImportError as e:  # a kernel transformers wanted at run time
            raise ValueError(f"--ref transformers: the forward needs a missing package: {e}") from None
        self.cache, self.seen = out.past_key_values, start_pos + ids.shape[1]
        return out.logits[:, -1].float().cpu()
