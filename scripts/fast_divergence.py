"""Where does fast numerics on device B leave fast numerics on device A? Per tap point (the residual after
the embedding, every engram update and every sublayer, the final hidden, the logits), cuda-vs-cpu against a
measured chaos FLOOR, to tell a device defect from chaos.

    PYTHONPATH=$PWD python scripts/fast_divergence.py --family v41 --ops twins --repeat --probe --oracle 3
    PYTHONPATH=$PWD python scripts/fast_divergence.py --family v4 --device-a cpu --device-b cpu   # self-test

Both devices run the test's fast model (tests/test_engine_fast{,_v41}.py::fast_model / build_v4_model: the
tiny checkpoint, its prompts LENS, BLOCKS_PER_SEQ, max_num_seqs = len(LENS)) teacher-forced the way the tests
do (one varlen prefill of every prompt, then STEPS batched decodes). The forced tokens are device A's own
greedy tokens (no oracle: the oracle is not what is compared here).
FLOOR: device A again with its embedding perturbed by one bf16 ulp (random sign) in 10% of the elements
(`parity.layers.perturb_last_bit`, applied to the embedding table, so every occurrence of a token gets the
same perturbed row; the parity tools' layers floor). Read the table as:
* chaos: a~b grows through the layers like the floor does (the ratio x = a~b / floor stays within one order
  of magnitude from layer to layer, whatever its level: device B injects rounding differences at every op,
  the floor only at the embedding, so x > 1 early on is expected);
* defect: a~b jumps at one point while the floor does not (x multiplies by >= 4 at one tap and ends well
  above 10: flagged `<<`); look at the op probe of that sublayer's ops.
--ops: `twins` hides every cuda registry entry (the test's monkeypatch: the torch twins on cuda tensors),
`registered` registers the Triton kernels first (as the test's cuda_kernels fixture).
--repeat: device B three more times on identical inputs (fresh models, no taps, as the tests call them; the
third with a device synchronize around every registry op) and device A once more: logits must be bit-identical
run to run (a race or a nondeterministic scatter shows here), plus the no-tap logits figures of B vs A (the
test's figures against A instead of the oracle).
--oracle N: the tests' oracle run, and the test's own judge (its figures, bounds and PASS/FAIL) applied to A, to
B and to N one-ulp floors of A (seeds 1..N): whether B fails the test where a 1-ulp input change fails it too.
--probe: every registry op called on device A during the prefill and the first decode, replayed on device B
with the same inputs (cloned): max rel diff per op (float outputs) / mismatching elements (integer outputs).
Rounding-order ops show 1e-7 (fp32) to a few bf16 ulps; an op whose device semantics differ shows O(1).
Also a few device probes of code outside the registry (E8M0 decode, division by a scalar, the KV codecs).
Must not: be imported by the package (a script), need a GPU for --device-b cpu.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import time

import torch

from deepinfer import kernels
from deepinfer.config import ModelConfig
from deepinfer.model import ForwardContext, SeqContext
from deepinfer.parity.layers import perturb_last_bit
from deepinfer.tiny import default_model_dir
from deepinfer.weights import load_tensors

FAMILIES = {  # the tests' shapes: tests/test_engine_fast_v41.py and tests/test_engine_fast.py
    "v41": {"lens": (70, 17, 5, 41), "blocks": 2},
    "v4": {"lens": (150, 40, 7, 100), "blocks": 4},
}
STEPS = 8
PERTURB_SEED = 1234


# ---------------------------------------------------------------------------------------------- models
def load(family: str):
    d = default_model_dir(family, seed=0)
    cfg = ModelConfig.from_checkpoint(d)
    tok = None
    if family == "v41":
        from deepinfer.tokenizer import Tokenizer

        tok = Tokenizer.from_checkpoint(d)
    return cfg, load_tensors(d, cfg, progress=False), tok


def prompts(cfg, lens, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, cfg.vocab_size, (n,), generator=g) for n in lens]


def build(family: str, parts, device: str, perturb: bool = False):
    cfg, raw, tok = parts
    spec = FAMILIES[family]
    n_blocks, n_seqs = spec["blocks"] * len(spec["lens"]), len(spec["lens"])
    if family == "v41":
        from deepinfer.model.v41 import build_v41_model

        model = build_v41_model(cfg, raw, tok, "fast", device, num_blocks=n_blocks, max_num_seqs=n_seqs)
    else:
        from deepinfer.model.factory import build_v4_model

        model = build_v4_model(cfg, raw, "fast", device, num_blocks=n_blocks, max_num_seqs=n_seqs)
    if perturb:  # the floor: one bf16 ulp in 10% of the embedding elements (parity.layers' floor)
        table = model.p["embed.weight"]
        model.p["embed.weight"] = perturb_last_bit(table.cpu(), PERTURB_SEED).to(table.device)
    return model


def run(model, ps: list[torch.Tensor], blocks: int, tokens: torch.Tensor | None, taps: bool = True):
    """Teacher-forced like tests/test_engine_fast.py::teacher_forced_batch; tokens None: greedy on this
    model's own logits. -> (logits [STEPS+1, B, V] f64 host, taps [step] {name: [rows, ...] f64 host} with the
    rows of every sequence concatenated in sequence order, tokens [STEPS, B])."""
    dev = model.device
    recorded: list[dict[str, dict[int, torch.Tensor]]] = []
    if taps:
        model.tap = lambda name, x, seq: recorded[-1].setdefault(name, {}).__setitem__(
            seq, x.detach().to("cpu", torch.float64))

    def table(i):
        return tuple(range(blocks * i, blocks * (i + 1)))

    out, chosen = [], []
    try:
        recorded.append({})
        ctx = ForwardContext(tuple(SeqContext(0, len(p), i, i, table(i)) for i, p in enumerate(ps)))
        out.append(model(torch.cat(ps), ctx))
        for k in range(STEPS):
            step = tokens[k] if tokens is not None else out[-1].argmax(-1).cpu()
            chosen.append(step.cpu())
            recorded.append({})
            ctx = ForwardContext(tuple(SeqContext(len(p) + k, 1, i, i, table(i)) for i, p in enumerate(ps)))
            out.append(model(step.to(dev), ctx))  # ids on the model's device, as the cuda test passes them
    finally:
        model.tap = None
    logits = torch.stack(out).to("cpu", torch.float64)
    steps = [{n: torch.cat([per[s] for s in sorted(per)]) for n, per in rec.items()} for rec in recorded]
    return logits, steps, torch.stack(chosen)


# ---------------------------------------------------------------------------------------------- figures
def rel(b: torch.Tensor, a: torch.Tensor) -> float:
    den = float(a.norm())
    return float((b - a).norm()) / den if den else float((b - a).norm())


def logit_figures(got: torch.Tensor, ref: torch.Tensor) -> dict:
    got, ref = got.flatten(0, 1), ref.flatten(0, 1)
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    return {"rel_err": rel(got, ref), "cos_med": float(cos.median()), "cos_min": float(cos.min()),
            "agree": int((got.argmax(-1) == ref.argmax(-1)).sum()), "rows": got.shape[0]}


def fmt_fig(f: dict) -> str:
    return (f"rel_err {f['rel_err']:.4g}  cos median {f['cos_med']:.6f} min {f['cos_min']:.6f}  "
            f"argmax agree {f['agree']}/{f['rows']}")


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:12]


GROUPS = (("prefill", [0]), ("decode1", [1]), ("decodes", list(range(1, STEPS + 1))))


def group_rel(b_steps, a_steps, name: str, steps: list[int]) -> float:
    have = [s for s in steps if name in a_steps[s] and name in b_steps[s]]
    if not have:
        return float("nan")
    a = torch.cat([a_steps[s][name].flatten() for s in have])
    b = torch.cat([b_steps[s][name].flatten() for s in have])
    return rel(b, a)


def table(a_steps, b_steps, f_steps, a_logits, b_logits, f_logits, label_b: str, label_f: str) -> list[str]:
    names = list(dict.fromkeys(n for rec in a_steps for n in rec))
    def tapped(name):
        return lambda steps: (group_rel(b_steps, a_steps, name, steps), group_rel(f_steps, a_steps, name, steps))

    rows = [(n, tapped(n)) for n in names]
    rows.append(("logits", lambda steps: (rel(b_logits[steps], a_logits[steps]),
                                          rel(f_logits[steps], a_logits[steps]))))
    head = f"{'tap':<18}" + "".join(f" | {g + ': a~b':>15} {'floor':>9} {'x':>7}" for g, _ in GROUPS)
    lines = [f"a~b = rel diff {label_b} vs A; floor = {label_f} vs A; x = a~b / floor; "
             f"'<<' = x jumped >= 4x at this tap and is > 10 (a defect candidate)", head, "-" * len(head)]
    prev = {g: None for g, _ in GROUPS}
    for name, fn in rows:
        cells = []
        for g, steps in GROUPS:
            ab, fl = fn(steps)
            x = ab / fl if fl > 0 else (math.inf if ab > 0 else 0.0)
            flag = "<<" if (prev[g] is not None and x > 10 and x >= 4 * max(prev[g], 1.0)) else "  "
            prev[g] = x
            cells.append(f" | {ab:>15.3e} {fl:>9.2e} {x:>7.2f}{flag}")
        lines.append(f"{name:<18}" + "".join(cells))
    return lines


# ---------------------------------------------------------------------------------------------- op probe
@contextlib.contextmanager
def patched_get(wrap):
    """Every `kernels.get(name, device)` the model makes returns wrap(name, device, fn)."""
    original = kernels.get

    def get(name, device="cpu"):
        return wrap(name, device, original(name, device))

    kernels.get = get
    try:
        yield original
    finally:
        kernels.get = original


def _clone(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone() if v.numel() <= 1 << 22 else v  # big ones are params (never written)
    if isinstance(v, (tuple, list)):
        return type(v)(_clone(x) for x in v)
    return v


def _move(v, device, memo: dict):
    if isinstance(v, torch.Tensor) or hasattr(v, "to") and type(v).__name__ in ("QuantLinearWeight", "FP4ExpertBank"):
        key = id(v)
        if key not in memo:
            memo[key] = (v, v.to(device))  # keep v alive so its id is not reused
        return memo[key][1]
    if isinstance(v, (tuple, list)):
        return type(v)(_move(x, device, memo) for x in v)
    if isinstance(v, dict):
        return {k: _move(x, device, memo) for k, x in v.items()}
    return v


def _outputs(v):
    return list(v) if isinstance(v, (tuple, list)) else [v]


def op_probe(model_a, ps, blocks, tokens, device_b: str) -> list[str]:
    calls: list[tuple[str, tuple, dict, object]] = []
    recording = [True]

    def wrap(name, device, fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            if recording[0]:
                calls.append((name, _clone(args), _clone(kwargs), _clone(out)))
            return out
        return call

    with patched_get(wrap) as original:
        dev = model_a.device

        def table_(i):
            return tuple(range(blocks * i, blocks * (i + 1)))

        ctx = ForwardContext(tuple(SeqContext(0, len(p), i, i, table_(i)) for i, p in enumerate(ps)))
        model_a(torch.cat(ps), ctx)
        ctx = ForwardContext(tuple(SeqContext(len(p), 1, i, i, table_(i)) for i, p in enumerate(ps)))
        model_a(tokens[0].to(dev), ctx)
        recording[0] = False
    stats: dict[str, list] = {}
    memo: dict = {}
    btype = torch.device(device_b).type
    for name, args, kwargs, out_a in calls:
        fn = original(name, btype)
        out_b = fn(*_move(args, device_b, memo), **_move(kwargs, device_b, memo))
        s = stats.setdefault(name, [0, 0.0, 0, 0, fn is not original(name, "cpu")])
        s[0] += 1
        for a, b in zip(_outputs(out_a), _outputs(out_b)):
            if not isinstance(a, torch.Tensor):
                continue
            b = b.cpu()
            if a.is_floating_point():
                a64, b64 = a.double(), b.double()
                finite = torch.isfinite(a64) & torch.isfinite(b64)
                same_inf = (a64 == b64) | (torch.isnan(a64) & torch.isnan(b64))
                s[3] += int((~(finite | same_inf)).sum())  # inf/nan where the other side differs
                s[1] = max(s[1], rel(b64[finite], a64[finite]))
                s[2] += int((a64 != b64).sum() - ((a64 != b64) & ~finite & same_inf).sum())
            else:
                s[2] += int((a != b).sum())
                s[3] += int((a != b).sum())  # integer/bool outputs must match exactly
    lines = [f"op probe: every registry op of A's prefill + first decode replayed on {device_b} "
             "(same inputs); max rel = max over calls of ||b-a||/||a||, diff = elements not bit-equal, "
             "BAD = integer/bool mismatches or inf/nan on one side only",
             f"{'op':<34} {'impl':<8} {'calls':>5} {'max rel':>10} {'diff elems':>10} {'BAD':>5}"]
    for name, (n, worst, ndiff, bad, custom) in sorted(stats.items()):
        lines.append(f"{name:<34} {'kernel' if custom else 'twin':<8} {n:>5} {worst:>10.2e} {ndiff:>10} {bad:>5}"
                     + ("  <<" if bad or worst > 1e-2 else ""))
    return lines


def device_probes(device_a: str, device_b: str, cfg) -> list[str]:
    """Code outside the registry that the fast path runs on the params' device."""
    from deepinfer import formats
    from deepinfer.cache.layouts import layouts_for

    g = torch.Generator().manual_seed(0)
    out = []

    def cmp(label, f, *inputs):
        a = f(*[t.to(device_a) for t in inputs])
        b = f(*[t.to(device_b) for t in inputs])
        a, b = a.cpu(), b.cpu()
        if a.dtype == torch.uint8:
            n = int((a != b).sum())
            out.append(f"  {label:<44} bytes differing {n} of {a.numel()}")
        else:
            a, b = a.double(), b.double()
            both_nan = torch.isnan(a) & torch.isnan(b)
            n = int(((a != b) & ~both_nan).sum())
            ok = ~torch.isnan(a) & ~torch.isnan(b)
            out.append(f"  {label:<44} elements differing {n} of {a.numel()}, rel {rel(b[ok], a[ok]):.2e}")

    x = (torch.randn(4096, 512, generator=g) * torch.rand(4096, 1, generator=g) * 4).to(torch.bfloat16)
    cmp("e8m0_to_float(all 256 bytes)", formats.e8m0_to_float, torch.arange(256, dtype=torch.uint8))
    cmp("fp32 x / 6.0 (python scalar)", lambda t: t / 6.0, x.float())
    cmp("fp32 x / 3.0 then * 3.0", lambda t: (t / 3.0) * 3.0, x.float())
    cmp("act_quant_dequant(x, 32)", lambda t: formats.act_quant_dequant(t, 32), x)
    cmp("fp4_fake_quant(x, 32)", lambda t: formats.fp4_fake_quant(t, 32), x)
    cmp("fp4_fake_quant(x, 16, e4m3 scale)", lambda t: formats.fp4_fake_quant(t, 16, True), x)
    for role, layout in layouts_for(cfg).items():
        xs = x[:, : layout.dim]
        cmp(f"layout {layout.name} store", layout.store, xs)
        cmp(f"layout {layout.name} store+load", lambda t, l=layout: l.load(l.store(t)), xs)
    cmp("sigmoid/exp/rsqrt fp32", lambda t: torch.sigmoid(t) + torch.exp(-t.abs()) + torch.rsqrt(t.abs() + 1), x.float())
    return out


# ---------------------------------------------------------------------------------------------- oracle judge
def oracle_run(family: str, parts, ps: list[torch.Tensor]):
    """tests/test_engine_fast.py::oracle_decode_run with the tests' oracle (official numerics, batch 1):
    (logits [STEPS+1, B, V], greedy tokens [STEPS, B], the one-prefill floor logits)."""
    from deepinfer.reference.numerics import Numerics
    from deepinfer.reference.params import prepare_params

    cfg, raw, tok = parts
    num = Numerics("official", "current", cfg.act_block)
    pp = prepare_params(raw, cfg, num)
    if family == "v41":
        from deepinfer.reference.v41 import V41Model

        def make():
            return V41Model(cfg, pp, num, 1, 256, quirks_official=False, tokenizer=tok)
    else:
        from deepinfer.reference.v4 import V4Model

        def make():
            return V4Model(cfg, pp, num, 1, 512, keep_stale_state=False)
    out, floor, tokens = [], [], []
    for p in ps:
        orc = make()
        lg = orc(p[None], 0)[0]
        rows, toks = [lg], []
        for k in range(STEPS):
            toks.append(int(lg.argmax()))
            lg = orc(torch.tensor([[toks[-1]]]), len(p) + k)[0]
            rows.append(lg)
        out.append(torch.stack(rows))
        tokens.append(toks)
        full = torch.cat([p, torch.tensor(toks)])
        floor.append(make().forward(full[None], 0, all_logits=True)[0][len(p) - 1 :])
    return torch.stack(out, 1).double(), torch.tensor(tokens).T, torch.stack(floor, 1).double()


def judge_line(name: str, got: torch.Tensor, ref: torch.Tensor, floor_logits: torch.Tensor) -> str:
    """tests/test_engine_fast.py::judge's figures and bounds, as one line (PASS/FAIL instead of asserts)."""
    def figs(g):
        g2, r2 = g.flatten(0, 1), ref.flatten(0, 1)
        cos = torch.nn.functional.cosine_similarity(g2, r2, dim=-1)
        top = r2.topk(2, dim=-1).indices
        margin = (r2.gather(1, top[:, :1]) - r2.gather(1, top[:, 1:])).squeeze(1)
        dm = ((g2.gather(1, top[:, :1]) - g2.gather(1, top[:, 1:])).squeeze(1) - margin).abs()
        return rel(g2, r2), float(cos.median()), float(cos.min()), margin, dm, g2.argmax(-1) == r2.argmax(-1)

    fr, fmed, _, _, fdm, _ = figs(floor_logits)
    r, med, cmin, margin, _, agree = figs(got)
    noise = float(fdm.max())
    sure = margin > noise
    ok = r <= 2 * fr and 1 - med <= 2 * (1 - fmed) and bool(agree[sure].all())
    return (f"  {name:<34} rel_err {r:.4f} ({r / fr:4.1f}x floor)  cos median {med:.6f} min {cmin:.4f}  greedy "
            f"{int(agree.sum())}/{agree.numel()}  above-noise rows agree {bool(agree[sure].all())!s:<5} "
            f"{'PASS' if ok else 'FAIL'}")


def oracle_judge(family: str, parts, ps, blocks: int, device_a: str, device_b: str, seeds: int) -> list[str]:
    ref, tokens, floor_logits = oracle_run(family, parts, ps)
    fr = rel(floor_logits.flatten(0, 1), ref.flatten(0, 1))
    lines = [f"the test's judge (vs the oracle, official numerics, on its greedy tokens; its floor = one-prefill "
             f"vs prefill+decodes, rel_err {fr:.4f}): the same judge applied to A, B and to A with its "
             "embedding perturbed by one bf16 ulp (10% of elements; several seeds = the chaos a 1-ulp input "
             "difference alone causes)"]
    runs = [(f"A ({device_a})", device_a, None), (f"B ({device_b})", device_b, None)]
    runs += [(f"A ({device_a}) embed 1-ulp seed {s}", device_a, s) for s in range(1, seeds + 1)]
    for label, dev, seed in runs:
        model = build(family, parts, dev)
        if seed is not None:
            t = model.p["embed.weight"]
            model.p["embed.weight"] = perturb_last_bit(t.cpu(), seed).to(t.device)
        got = run(model, ps, blocks, tokens, taps=False)[0]
        lines.append(judge_line(label, got, ref, floor_logits))
    return lines


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=sorted(FAMILIES), default="v41")
    ap.add_argument("--ops", choices=("twins", "registered"), default="twins")
    ap.add_argument("--device-a", default="cpu", help="the reference side (and the floor's device)")
    ap.add_argument("--device-b", default="cuda")
    ap.add_argument("--floor-device", choices=("a", "b"), default="a",
                    help="run the perturbed floor on device A (default) or B (B's own chaos)")
    ap.add_argument("--repeat", action="store_true", help="run-to-run bit-identity of B (and A)")
    ap.add_argument("--probe", action="store_true", help="replay A's registry ops on B; device probes")
    ap.add_argument("--oracle", type=int, default=0, metavar="SEEDS",
                    help="also run the oracle and apply the test's judge to A, B and SEEDS 1-ulp floors of A")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (the tests use 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    uses_cuda = "cuda" in (args.device_a + args.device_b)
    if uses_cuda:
        from deepinfer.engine.model_runner import start_cuda_kernels

        start_cuda_kernels()  # what the tests' cuda_kernels fixture does
    if args.ops == "twins":  # the test's monkeypatch: hide every cuda entry
        kernels._REGISTRY = {k: v for k, v in kernels._REGISTRY.items() if k[1] == "cpu"}
    custom = sorted(n for n in kernels.ops() if kernels.get(n, "cuda") is not kernels.get(n))
    spec = FAMILIES[args.family]
    parts = load(args.family)
    cfg = parts[0]
    ps = prompts(cfg, spec["lens"])
    blocks = spec["blocks"]
    print(f"family {args.family}  ops {args.ops}  A={args.device_a}  B={args.device_b}  torch {torch.__version__}  "
          f"lens {spec['lens']} + {STEPS} decodes  cuda kernels registered: {custom or 'none'}")
    if uses_cuda:
        print(f"cuda {torch.cuda.get_device_name()}  tf32 matmul {torch.backends.cuda.matmul.allow_tf32}  "
              f"bf16 reduced-precision reduction {torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction}  "
              f"fp32 matmul precision {torch.get_float32_matmul_precision()}")

    a_logits, a_steps, tokens = run(build(args.family, parts, args.device_a), ps, blocks, None)
    b_logits, b_steps, _ = run(build(args.family, parts, args.device_b), ps, blocks, tokens)
    fdev = args.device_a if args.floor_device == "a" else args.device_b
    f_logits, f_steps, _ = run(build(args.family, parts, fdev, perturb=True), ps, blocks, tokens)
    label_f = f"floor ({fdev}, embed 1 ulp)"
    print(f"\nforced tokens: A's greedy; step 0 = the prefill (every prompt's last row), steps 1..{STEPS} decodes")
    for line in table(a_steps, b_steps, f_steps, a_logits, b_logits, f_logits, f"B ({args.device_b})", label_f):
        print(line)
    print(f"\nlogits (tapped runs)  B vs A: {fmt_fig(logit_figures(b_logits, a_logits))}")
    print(f"                  floor vs A: {fmt_fig(logit_figures(f_logits, a_logits))}")
    per_step = " ".join(f"{rel(b_logits[k], a_logits[k]):.3f}/{rel(f_logits[k], a_logits[k]):.3f}"
                        for k in range(STEPS + 1))
    print(f"logits rel per step (B/floor): {per_step}")
    per_seq = " ".join(f"{rel(b_logits[:, i], a_logits[:, i]):.3f}/{rel(f_logits[:, i], a_logits[:, i]):.3f}"
                       for i in range(len(ps)))
    print(f"logits rel per sequence (B/floor): {per_seq}")

    if args.repeat:
        print("\nrepeat (fresh models, no taps, the same forced tokens):")
        a2 = run(build(args.family, parts, args.device_a), ps, blocks, tokens, taps=False)[0]
        b1 = run(build(args.family, parts, args.device_b), ps, blocks, tokens, taps=False)[0]
        b2 = run(build(args.family, parts, args.device_b), ps, blocks, tokens, taps=False)[0]

        def synced(name, device, fn):
            if torch.device(args.device_b).type != "cuda":
                return fn

            def call(*a, **k):
                torch.cuda.synchronize()
                out = fn(*a, **k)
                torch.cuda.synchronize()
                return out
            return call

        with patched_get(synced):
            b3 = run(build(args.family, parts, args.device_b), ps, blocks, tokens, taps=False)[0]
        for label, x, y in (("A run 2 vs A (tapped)", a2, a_logits), ("B run 2 vs B run 1", b2, b1),
                            ("B run 3 (synced ops) vs B run 1", b3, b1), ("B run 1 vs B (tapped)", b1, b_logits)):
            same = torch.equal(x, y)
            steps = [k for k in range(STEPS + 1) if not torch.equal(x[k], y[k])]
            print(f"  {label:<34} bit-identical {str(same):<5}  max |diff| {float((x - y).abs().max()):.3e}"
                  + (f"  differing steps {steps}" if steps else ""))
        print(f"  digests: A {digest(a_logits)}  B1 {digest(b1)}  B2 {digest(b2)}  B3 {digest(b3)}")
        print(f"  no-tap logits B vs A: {fmt_fig(logit_figures(b1, a2))}")

    if args.probe:
        print()
        for line in op_probe(build(args.family, parts, args.device_a), ps, blocks, tokens, args.device_b):
            print(line)
        print(f"device probes ({args.device_a} vs {args.device_b}, random inputs):")
        for line in device_probes(args.device_a, args.device_b, cfg):
            print(line)
    if args.oracle:
        print()
        for line in oracle_judge(args.family, parts, ps, blocks, args.device_a, args.device_b, args.oracle):
            print(line)
    print(f"\ndone in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
