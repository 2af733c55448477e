"""`MTPProposer`: drafts with the V4 MTP block (model/mtp.py), greedily.

Bookkeeping per request: `done[rid]` = MTP positions computed (0..done-1) in the MTP's window ring. The MTP
at position t needs the target's hidden at t (valid once tokens 0..t are all real) and token t + 1, so after
a step it catches up to t < min(target computed end, num_tokens - 1); the last of those rows predicts the
first draft. Hidden rows of positions the target later rolls back are still valid when their tokens were
accepted (they depend only on real tokens), so a rewind of the target never rewinds the MTP below them.
Drafts 2..k chain the MTP's own output residual at throwaway positions; the ring rows they overwrite are
restored afterwards (rollback.SequenceSnapshot), so only real positions ever stay in the MTP cache.
A sequence restarting at position 0 (new or preempted) resets its MTP ring.

Must not: touch the target cache or scheduler state.
"""
from __future__ import annotations

from typing import Sequence

import torch

from deepinfer.model.context import ForwardContext, SeqContext
from deepinfer.model.mtp import V4MTP
from deepinfer.scheduler import Request
from deepinfer.spec.proposer import Proposer, TargetStep
from deepinfer.spec.rollback import SequenceSnapshot


class MTPProposer(Proposer):
    needs_hidden = True

    def __init__(self, mtp: V4MTP) -> None:
        self.mtp = mtp
        self.done: dict[str, int] = {}
        self.slot: dict[str, int] = {}
        self.last: dict[str, tuple[torch.Tensor, int]] = {}  # rid -> (MTP output row [hc, D], draft 1)

    def release(self, request_id: str) -> None:
        for d in (self.done, self.slot, self.last):
            d.pop(request_id, None)

    def observe(self, requests: dict[str, Request], step: TargetStep) -> None:
        seqs, hid, nxt, rids = [], [], [], []
        for rid, c in step.computed.items():
            start, hidden, slot = c.start, c.hidden, c.window_slot
            req = requests.get(rid)
            self.last.pop(rid, None)
            if req is None or req.is_finished:
                self.release(rid)
                continue
            if hidden is None:
                raise RuntimeError(f"{rid}: the MTP drafter needs the target's hidden rows")
            if start == 0 or self.slot.get(rid) != slot:  # a fresh (or re-admitted) sequence
                self.mtp.cache.reset(slot)
                self.done[rid], self.slot[rid] = 0, slot
            lo = self.done[rid]
            if lo < start:
                raise RuntimeError(f"{rid}: MTP computed {lo} positions but the target's hidden starts at {start}")
            hi = min(start + hidden.shape[0], req.num_tokens - 1)
            if hi <= lo:
                continue
            seqs.append(SeqContext(lo, hi - lo, slot, slot))
            hid.append(hidden[lo - start : hi - start])
            nxt += req.known_token_ids(lo + 1, hi + 1)  # (hi < num_tokens: every id is known)
            rids.append(rid)
        if not seqs:
            return
        ctx = ForwardContext(tuple(seqs))
        out, logits = self.mtp.forward(torch.cat(hid), torch.tensor(nxt, dtype=torch.long), ctx)
        ends = [c - 1 for c in ctx.cu_tokens[1:]]
        for i, rid in enumerate(rids):
            self.done[rid] = seqs[i].end_pos
            if self.done[rid] == requests[rid].num_tokens - 1:  # caught up: this row predicts the next token
                self.last[rid] = (out[ends[i]], int(logits[i].argmax()))

    def propose(self, requests: Sequence[Request], k: int) -> dict[str, list[int]]:
        ready = [r for r in requests if r.request_id in self.last]
        drafts = {r.request_id: [self.last[r.request_id][1]] for r in ready}
        if k == 1 or not ready:
            return drafts
        saved = [SequenceSnapshot.take(self.mtp.cache, self.slot[r.request_id], self.slot[r.request_id])
                 for r in ready]
        try:
            hidden = torch.stack([self.last[r.request_id][0] for r in ready])
            for j in range(1, k):  # draft j + 1 from the MTP at throwaway position num_tokens - 2 + j
                seqs = [SeqContext(r.num_tokens - 2 + j, 1, self.slot[r.request_id], self.slot[r.request_id])
                        for r in ready]
                ids = torch.tensor([drafts[r.request_id][-1] for r in ready], dtype=torch.long)
                hidden, logits = self.mtp.forward(hidden, ids, ForwardContext(tuple(seqs)))
                for r, row in zip(ready, logits.argmax(dim=-1).tolist()):
                    drafts[r.request_id].append(int(row))
        finally:
            for s in saved:
                s.restore()
        return drafts
