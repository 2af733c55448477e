"""What a parallel group's step broadcast costs on the host against the context: rank 0 pickles the step
(`broadcast_object_list` pickles its objects), every worker unpickles it. Before 2026-12-05 the message held
every sequence's whole block table each step; now (engine/step_message.py) a table crosses only when it
changed, and then only its new blocks. B sequences decode one token a step, each gaining a block every
`block_size` steps (staggered, as a real batch's are); no model, no group: the message's host work alone.

    PYTHONPATH=$PWD python benchmarks/bench_step_message.py [--batch 128] [--contexts 4096 32768 131072]

Prints, per context, the median over 256 steps of the pickled bytes and of rank 0's encode + pickle and a
worker's unpickle + decode, for both forms.
"""
from __future__ import annotations

import argparse
import pickle
import statistics
import time

from deepinfer.engine.step_message import StepDecoder, StepEncoder
from deepinfer.model.context import SeqContext


def steps(batch: int, context: int, block: int, n: int):
    """n decode steps of `batch` sequences at ~`context` tokens (tables grow as positions cross blocks)."""
    pos = [context + (i * block) // batch for i in range(batch)]  # staggered block crossings
    tables = [tuple(range(i * 100_000, i * 100_000 + p // block + 1)) for i, p in enumerate(pos)]
    for _ in range(n):
        for i in range(batch):
            pos[i] += 1
            if pos[i] // block + 1 > len(tables[i]):
                tables[i] = tables[i] + (tables[i][-1] + 1,)
        yield list(range(batch)), tuple(SeqContext(pos[i], 1, i, i, tables[i]) for i in range(batch))


def measure(batch: int, context: int, block: int = 128, n: int = 256) -> dict[str, tuple[float, float, float]]:
    out = {}
    # before: ("step", ids, seqs, all_logits) pickled whole
    size, send, recv = [], [], []
    for ids, seqs in steps(batch, context, block, n):
        t0 = time.perf_counter()
        wire = pickle.dumps([("step", ids, seqs, False)])
        t1 = time.perf_counter()
        pickle.loads(wire)
        t2 = time.perf_counter()
        size.append(len(wire)), send.append((t1 - t0) * 1e6), recv.append((t2 - t1) * 1e6)
    out["whole tables"] = (statistics.median(size), statistics.median(send), statistics.median(recv))
    enc, dec = StepEncoder(), StepDecoder()
    size, send, recv = [], [], []
    for ids, seqs in steps(batch, context, block, n):
        t0 = time.perf_counter()
        wire = pickle.dumps([("step", enc.encode(len(ids), seqs, False))])  # (+ the ids: a tensor broadcast)
        t1 = time.perf_counter()
        dec.decode(pickle.loads(wire)[0][1])
        t2 = time.perf_counter()
        size.append(len(wire)), send.append((t1 - t0) * 1e6), recv.append((t2 - t1) * 1e6)
    out["changes"] = (statistics.median(size), statistics.median(send), statistics.median(recv))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    args = ap.parse_args()
    print(f"step messages of {args.batch} decoding sequences, 128-token blocks (median of 256 steps)")
    for c in args.contexts:
        for form, (size, send, recv) in measure(args.batch, c).items():
            print(f"context {c:7d} {form:12s}: {size / 1024:8.1f} KiB, rank 0 encode + pickle {send:8.1f} us, "
                  f"a worker unpickle + decode {recv:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
