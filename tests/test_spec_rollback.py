"""Rollback of per-sequence state after rejected drafts (spec/rollback.py), at the model level, exact
numerics: a sequence that verifies k + 1 wrong tokens across a window wrap and compressed-block boundaries
(ratio 4 / 128 on V4, ratio 2 / 1 and the engram history on V4.1), is restored and then extends the real
tokens must give the same logits (1e-12) and the same state as one that never saw the drafts; without the
restore it must not (the test can fail)."""
from __future__ import annotations

import pytest
import torch

from deepinfer import LLM
from deepinfer.model.context import ForwardContext, SeqContext
from deepinfer.spec.rollback import SequenceSnapshot, slot_tensors


@pytest.fixture(scope="module")
def models(tiny_v4_dir, tiny_v41_dir):
    """One engine model per family; every test restarts its three slots at position 0 (a reset)."""
    built = {}

    def get(family):
        if family not in built:
            d = tiny_v4_dir if family == "v4" else tiny_v41_dir
            built[family] = LLM(d, max_model_len=256, max_num_seqs=3, num_blocks=6).engine.runner.model
        return built[family]

    return get


def _extend(model, slot, start, ids):
    seq = SeqContext(start, len(ids), slot, slot, (2 * slot, 2 * slot + 1))
    return model.forward(torch.tensor(ids), ForwardContext((seq,), all_logits=True))


@pytest.mark.parametrize("family", ["v4", "v41"])
@pytest.mark.parametrize("start,k", [(126, 3), (125, 4), (127, 1), (40, 3)])
def test_restore_equals_never_drafted(models, family, start, k):
    model = models(family)
    g = torch.Generator().manual_seed(start * 10 + k)
    tokens = torch.randint(0, 129280, (start + 8,), generator=g).tolist()
    wrong = torch.randint(0, 129280, (k,), generator=g).tolist()
    for slot in range(3):
        _extend(model, slot, 0, tokens[:start])
    # slot 0: verify [last real token, k wrong drafts] at positions start-1.., restore, redo the real tokens
    # slot 1: never drafted; slot 2: verified the wrong drafts but was NOT restored (negative control)
    for slot in (0, 2):
        snap = SequenceSnapshot.take(model.cache, slot, slot)
        _extend(model, slot, start - 1, [tokens[start - 1]] + wrong)  # rejected at draft 1
        if slot == 0:
            snap.restore()
    # slots 0 and 2 rewound to start - 1; slot 1 catches up from the same point
    outs = {slot: _extend(model, slot, start - 1, tokens[start - 1 :]) for slot in range(3)}
    assert torch.allclose(outs[0], outs[1], rtol=0, atol=1e-12)
    for (a, ra), (b, rb) in zip(slot_tensors(model.cache, 0, 0), slot_tensors(model.cache, 1, 1)):
        assert torch.equal(a[ra], b[rb]) or torch.allclose(a[ra], b[rb], rtol=0, atol=1e-12)
    assert not torch.allclose(outs[2], outs[1], rtol=0, atol=1e-6), "without the restore the state is wrong"
