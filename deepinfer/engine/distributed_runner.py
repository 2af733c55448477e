"""Multi-process serving: one process per rank, torch.distributed underneath (gloo on CPU, nccl on CUDA).

Owns: starting the group (`start_parallel_runner`: spawned local ranks, or a `torchrun` launch), the
`ParallelRunner` (a `ModelRunner` over this rank's checkpoint slices), the workers' step loop, and
turning any rank's failure into one clear `GroupFailure` on rank 0 instead of a hang.

Protocol (chosen: the scheduler and the sampler run on rank 0 only):
1. rank 0's `LLMEngine` schedules as in one process; `ParallelRunner.forward_batch` broadcasts the step
   (the `SeqContext`s, all_logits, the number of ids) to every rank (`broadcast_object_list`), block
   tables as changes against what the workers hold (engine/step_message.py: whole tables every step grew
   with the context), then the token ids as a tensor broadcast from rank 0's device: with asynchronous
   scheduling some are the previous step's sampled tokens, still on the device, and reading them on the
   host would wait for that step;
2. every rank runs the forward on its share: the whole batch when dp = 1 (the tp group splits heads,
   vocabulary and experts inside the model; with fast numerics a pure-decode step takes the batched decode
   path on every rank, as in one process: every rank decides from the same broadcast batch, so the
   collectives inside come in the same order), else the sequences whose state slot is its dp group's (a
   share that is all decode takes the batched path; every path makes one MoE exchange per layer, the
   only collective between dp groups)
   (`ParallelConfig.owns_sequence`). A dp group with nothing to run still joins each layer's MoE token
   exchange (`idle_moe`) when experts span the dp groups; official numerics runs one call per sequence,
   so every dp group makes as many calls as the busiest one;
3. with dp = 1 rank 0 already holds the batch's logits on its device and samples there; else the
   tp-rank-0 of each dp group sends its logits rows to rank 0 (`gather_object`, host tensors), which puts
   them back in batch order, moves them to its device and samples. Workers keep no request state
   besides their caches; every rank allocates the same number of KV blocks (the minimum over ranks) and
   uses the global block ids.
Failures: a worker that raises reports (rank, traceback) on a queue and exits hard, so rank 0's pending
collective fails at once (gloo: connection closed; nccl/hung peers: `distributed_timeout_s`); rank 0
then stops every worker, tears the group down and raises `GroupFailure` naming the failing rank. Every
later step raises the same error: a group that lost a rank cannot resume.
Fault injection (tests): env `DEEPINFER_FAULT_INJECT="RANK:STEP"` makes that rank raise at that step
(STEP "load": a spawned rank, right after joining the group).

Multi-node: launch every rank with torchrun (it sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT), e.g. on each of 2 nodes with 8 GPUs:
    torchrun --nnodes 2 --nproc-per-node 8 --node-rank $N --master-addr $HOST0 --master-port 29500 \\
        -m deepinfer.cli serve --model DIR --tp 8 --dp 2 --ep 16
Rank 0 serves HTTP; the other ranks enter the worker loop and exit when rank 0 shuts down.
Must not: sample, schedule, or keep per-request state on the workers.
"""
from __future__ import annotations

import atexit
import datetime
import os
import queue
import time
import traceback
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer.config import ModelConfig
from deepinfer.devices import host_to_device
from deepinfer.distributed import Communicator, ParallelConfig
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.engine.step_message import StepDecoder, StepEncoder
from deepinfer.model.context import ForwardContext

FAULT_ENV = "DEEPINFER_FAULT_INJECT"
_STOP = ("stop",)


class GroupFailure(RuntimeError):
    """A rank of the parallel group failed: the group is down (LLMEngine re-raises it, never retries)."""

    fatal = True


def parallel_config(config: EngineConfig, rank: int = 0) -> ParallelConfig:
    return ParallelConfig(config.tensor_parallel_size, config.expert_parallel_size, config.data_parallel_size, rank)


def is_parallel(config: EngineConfig) -> bool:
    return parallel_config(config).world_size > 1


def _maybe_inject_fault(rank: int, step: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if spec and spec == f"{rank}:{step}":
        raise RuntimeError(f"injected fault ({FAULT_ENV}={spec})")


class ParallelRunner(ModelRunner):
    """A `ModelRunner` on one rank; on rank 0 `forward_batch` drives the whole group."""

    def __init__(self, config: EngineConfig, cfg: ModelConfig, comm: Communicator, workers=(), errors=None) -> None:
        super().__init__(config, cfg, comm)
        self.pc = comm.parallel
        self.workers, self.errors = list(workers), errors
        self.failure: str | None = None
        self.steps = 0
        self._closed = False
        self._encoder, self._decoder = StepEncoder(), StepDecoder()  # rank 0's / a worker's side of the steps

    # ------------------------------------------------------------------ rank 0
    def forward_batch(self, ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.failure:
            raise GroupFailure(self.failure)
        if getattr(self.model, "tap", None) is not None:  # rank-local state the workers would not see
            raise RuntimeError("a tapped model (the parity tools) runs in one process: the ranks of a parallel "
                               "group must take the same path through every step")
        try:
            message = self._encoder.encode(ids.shape[0], ctx.seqs, ctx.all_logits)
            dist.broadcast_object_list([("step", message)], src=0)
            ids = host_to_device(ids.long(), self.device) if ids.device != self.device else ids.long()
            dist.broadcast(ids, src=0)  # (nccl: on the device, in stream order; no host sync)
            return self.run_step(ids, ctx)
        except Exception as err:  # any rank's failure ends the group: collectives cannot resynchronise
            raise GroupFailure(self._fail(err)) from err

    def _fail(self, err: BaseException) -> str:
        reports = []
        start = time.monotonic()
        while self.errors is not None and time.monotonic() - start < 5:
            try:  # a failing worker reports before it exits
                reports.append(self.errors.get(timeout=0.1))
                break
            except queue.Empty:
                if time.monotonic() - start > 1 and all(p.is_alive() for p in self.workers):
                    break  # every worker is alive: the failure is rank 0's own
        if reports:
            rank, tb = reports[0]
            msg = f"rank {rank} of the parallel group failed:\n{tb.rstrip()}"
        else:
            msg = f"rank {self.pc.rank} of the parallel group failed: {type(err).__name__}: {err}"
        self.failure = msg
        self._teardown(graceful=False)
        return msg

    def shutdown(self) -> None:
        """Stop the workers and leave the group (rank 0; idempotent)."""
        if self._closed:
            return
        if self.failure is None and self.pc.rank == 0 and dist.is_initialized():
            try:
                dist.broadcast_object_list([_STOP], src=0)
                # every rank has left its step loop before any tears its group down: a rank destroying its
                # gloo group while a peer still talks to it made that peer abort at exit ("terminate called
                # without an active exception", 2 of 4 torchrun test runs on the 2-core CI machine)
                dist.barrier()
            except Exception:  # a dead peer: fall through to the hard stop
                pass
        self._teardown(graceful=self.failure is None)

    def _teardown(self, graceful: bool) -> None:
        self._closed = True
        atexit.unregister(self.shutdown)  # the exit hook held this runner, and with it rank 0's model, for good
        for p in self.workers:
            p.join(timeout=30 if graceful else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # the group may already be broken by the failure being reported
                pass

    # ------------------------------------------------------------------ every rank
    def run_step(self, ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """This rank's share of one step; rank 0 gets the logits of the whole batch in batch order."""
        _maybe_inject_fault(self.pc.rank, self.steps)
        self.steps += 1
        pc = self.pc
        if pc.dp == 1:  # rank 0 keeps its logits on its device, where the engine samples
            # (the one-process choice of path, every rank deciding the same on the same batch)
            logits = self.route(ids, ctx, self.split_mixed)
            return logits if pc.rank == 0 else None
        owner = [s.state_slot % pc.dp for s in ctx.seqs]
        mine = [i for i, d in enumerate(owner) if d == pc.dp_rank]
        per_sequence = self.numerics == "official"  # the official path runs one sequence per call anyway
        calls = [[i] for i in mine] if per_sequence else ([mine] if mine else [])
        n_calls = len(calls)
        if pc.moe_gathers_dp:  # every dp group must join the same number of MoE exchanges
            n_calls = max(owner.count(d) for d in range(pc.dp)) if per_sequence else 1
        rows: dict[int, torch.Tensor] = {}
        for k in range(n_calls):
            if k >= len(calls):
                self.model.idle_moe()
                continue
            sub = ForwardContext(tuple(ctx.seqs[i] for i in calls[k]), ctx.all_logits)
            sub_ids = torch.cat([ids[ctx.rows(i)] for i in calls[k]])
            # never the mixed-step split here: the MoE exchange spans the dp groups, and every path makes
            # one MoE call per layer (as idle_moe does), where a split share would make two
            logits = self.route(sub_ids, sub, split_mixed=False).to("cpu")
            for j, i in enumerate(calls[k]):
                rows[i] = logits[sub.rows(j)] if ctx.all_logits else logits[j : j + 1]
        sent = rows if pc.tp_rank == 0 else None
        gathered = [None] * pc.world_size if pc.rank == 0 else None
        dist.gather_object(sent, gathered, dst=0)
        if pc.rank != 0:
            return None
        merged: dict[int, torch.Tensor] = {}
        for part in gathered:
            merged.update(part or {})
        # the rows crossed as host tensors (gather_object pickles); rank 0 samples on its own device
        return torch.cat([merged[i] for i in range(len(ctx.seqs))]).to(self.device)

    def serve_forever(self) -> None:
        """Worker ranks: run the steps rank 0 broadcasts until it says stop."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            msg = box[0]
            if msg == _STOP:
                dist.barrier()  # rank 0's shutdown waits here too (see shutdown)
                return
            num_ids, seqs, all_logits = self._decoder.decode(msg[1])
            ids = torch.empty(num_ids, dtype=torch.long, device=self.device)
            dist.broadcast(ids, src=0)
            self.run_step(ids, ForwardContext(seqs, all_logits))


# ---------------------------------------------------------------------- launch
def _rank_config(config: EngineConfig, local_rank: int) -> EngineConfig:
    if config.device.startswith("cuda"):  # one GPU per rank
        torch.cuda.set_device(local_rank)
        return replace(config, device=f"cuda:{local_rank}")
    return config


def _init_group(config: EngineConfig, rank: int, init_method: str | None = None, store=None) -> None:
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=init_method, store=store, rank=rank,
                            world_size=parallel_config(config).world_size,
                            timeout=datetime.timedelta(seconds=config.distributed_timeout_s))


def _store(config: EngineConfig, port: int, master: bool) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, parallel_config(config).world_size, master,
                         timeout=datetime.timedelta(seconds=config.distributed_timeout_s), wait_for_workers=False)


def _wait_for_workers(store: dist.TCPStore, workers, errors, timeout_s: float) -> None:
    """Rank 0 waits for every spawned rank to reach the store, failing at once if one dies first (the
    plain rendezvous would wait for the full timeout)."""
    start = time.monotonic()
    pending = {int(p.name.removeprefix("deepinfer-rank")): p for p in workers}
    while pending:
        for r in list(pending):
            if store.check([f"ready{r}"]):
                del pending[r]
        dead = [r for r, p in pending.items() if not p.is_alive()]
        if dead:
            raise RuntimeError(f"rank {dead[0]} exited before joining the group")
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"ranks {sorted(pending)} did not join the group within {timeout_s:.0f} s")
        time.sleep(0.05)


def _worker_main(rank: int, config: EngineConfig, port: int, errors) -> None:
    """Entry of a spawned rank (>= 1)."""
    if not config.device.startswith("cuda"):  # CPU ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // parallel_config(config).world_size))
    try:
        config = _rank_config(config, rank)
        store = _store(config, port, master=False)
        store.set(f"ready{rank}", "1")
        # the group and all its subgroups first: gloo connects every pair at creation, so a failure while
        # loading closes live connections and rank 0's next collective fails at once (not at the timeout)
        _init_group(config, rank, store=store)
        comm = Communicator(parallel_config(config, rank))
        _maybe_inject_fault(rank, "load")
        cfg = ModelConfig.from_checkpoint(config.model)
        runner = ParallelRunner(config, cfg, comm)
        runner.serve_forever()
        dist.destroy_process_group()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        errors.close()
        errors.join_thread()
        os._exit(1)  # closes this rank's sockets now, so the peers' collectives fail instead of waiting


def start_parallel_runner(config: EngineConfig, cfg: ModelConfig) -> ParallelRunner:
    """Rank 0's runner. Under torchrun (RANK/WORLD_SIZE set) every process calls this: ranks > 0 serve
    until rank 0 stops, then exit the process (SystemExit(0))."""
    pc = parallel_config(config)
    pc.check_model(cfg)  # shape errors before any process starts
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed group is already initialised in this process "
                           "(shut the previous parallel LLM down first: LLM.shutdown())")
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _start_torchrun(config, cfg, pc)
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    workers = []
    try:
        # port 0: the OS picks a free port as the store binds it (a port probed free first could be taken by
        # another process before the bind: two engines or test workers starting at once)
        store = _store(config, 0, master=True)
        workers = [ctx.Process(target=_worker_main, args=(r, config, store.port, errors), daemon=True,
                               name=f"deepinfer-rank{r}") for r in range(1, pc.world_size)]
        for p in workers:
            p.start()
        _wait_for_workers(store, workers, errors, config.distributed_timeout_s)
        config = _rank_config(config, 0)
        _init_group(config, 0, store=store)
        runner = ParallelRunner(config, cfg, Communicator(pc), workers, errors)
    except Exception as err:
        stub = _Failed(pc, workers, errors)
        raise GroupFailure(stub._fail(err)) from err
    atexit.register(runner.shutdown)
    return runner


class _Failed(ParallelRunner):
    """Only the failure path of a group that never finished starting (no model on rank 0)."""

    def __init__(self, pc: ParallelConfig, workers, errors) -> None:  # noqa: D401 - no ModelRunner state
        self.pc, self.workers, self.errors, self.failure, self._closed = pc, list(workers), errors, None, False


def _start_torchrun(config: EngineConfig, cfg: ModelConfig, pc: ParallelConfig) -> ParallelRunner:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world != pc.world_size:
        raise ValueError(f"torchrun started {world} processes but tp {pc.tp} x dp {pc.dp} = {pc.world_size}")
    config = _rank_config(config, int(os.environ.get("LOCAL_RANK", rank)))
    _init_group(config, rank, "env://")
    runner = ParallelRunner(config, cfg, Communicator(pc.for_rank(rank)))
    if rank == 0:
        atexit.register(runner.shutdown)
        return runner
    runner.serve_forever()
    dist.destroy_process_group()
    raise SystemExit(0)
