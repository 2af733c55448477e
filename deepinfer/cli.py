"""`deepinfer` command line: argument parsing and printing only; the work happens in the library."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ids wants comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--ids is empty")
    return ids


def _model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from deepinfer.tiny import default_model_dir

    return default_model_dir()


def cmd_ask(args: argparse.Namespace) -> int:
    from deepinfer.ask import ask, format_report

    if args.prompt is None and args.ids is None:
        print("deepinfer ask: give a PROMPT or --ids", file=sys.stderr)
        return 2
    report = ask(
        _model_dir(args.model), prompt=args.prompt, ids=args.ids, chat=not args.raw, thinking=args.thinking,
        max_tokens=args.max_tokens, top=args.top, numerics=args.numerics, revision=args.revision,
        temperature=args.temperature, seed=args.seed,
    )
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from deepinfer.tiny import write_tiny

    out = write_tiny(args.dir, family=args.family, seed=args.seed)
    print(f"wrote tiny {args.family} checkpoint (seed {args.seed}) to {out}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from deepinfer.config import ModelConfig
    from deepinfer.weights import CheckpointReader, check_checkpoint

    model_dir = _model_dir(args.model)
    cfg = ModelConfig.from_checkpoint(model_dir)
    print(f"{model_dir}: family {cfg.family}, dim {cfg.dim}, {cfg.n_layers} layers + {cfg.n_mtp_layers} MTP/DSpark")
    print(f"{'layer':>5} {'kind':8} {'ratio':>5} {'indexer':7} {'hash':5} {'kv_src':>6} {'idx_src':>7} {'rope':>8}")
    for row in cfg.schedule():
        print(f"{row['layer']:>5} {row['kind']:8} {row['ratio']:>5} {str(row['indexer']):7} {str(row['hash_routed']):5} "
              f"{str(row['kv_source']):>6} {str(row['index_source']):>7} {row['rope_base']:>8.0f}")
    if not args.no_check:
        report = check_checkpoint(CheckpointReader(model_dir), cfg)
        print(report.summary())
        return 0 if report.ok else 1
    return 0


PARITY_CANNOT_RUN = 3  # distinct from a finding: parity commands exit 0 whenever they ran


def cmd_parity(args: argparse.Namespace) -> int:
    from deepinfer.parity.backends import parse_ref
    from deepinfer.parity.drift import run_drift
    from deepinfer.parity.kv import run_kv
    from deepinfer.parity.layers import run_layers
    from deepinfer.parity.next_token import run_next_token
    from deepinfer.parity.weights import run_weights

    model_dir = _model_dir(args.model)
    try:
        if args.parity_command == "weights":
            report = run_weights(model_dir, args.filter)
        elif args.parity_command == "kv":
            report = run_kv(model_dir, args.layouts.split(",") if args.layouts else None)
        elif args.parity_command == "layers":
            report = run_layers(model_dir, args.ids, args.numerics, parse_ref(args.ref), args.dump)
        elif args.parity_command == "drift":
            report = run_drift(model_dir, args.ids, args.steps, args.numerics, parse_ref(args.ref))
        else:
            report = run_next_token(model_dir, args.ids, args.force_ids or [], args.numerics, args.api_steps,
                                    parse_ref(args.ref), args.api_speculative)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"deepinfer parity {args.parity_command}: could not run: {e}", file=sys.stderr)
        return PARITY_CANNOT_RUN
    from deepinfer.parity.dump import rank_and_world

    if rank_and_world()[0] != 0:  # under torchrun every rank ran the same comparison: rank 0 reports it
        return 0
    print(report.table(limit=args.limit))
    if args.json:
        report.write_json(args.json)
    if args.plot:
        from deepinfer.parity.plots import write_plots

        try:
            for path in write_plots(report, args.plot):
                print(f"plot: {path}")
        except ValueError as e:
            print(f"deepinfer parity {args.parity_command}: could not plot: {e}", file=sys.stderr)
            return PARITY_CANNOT_RUN
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepinfer", description="DeepSeek-V4 family inference with parity tools")
    sub = p.add_subparsers(dest="command", required=True)

    a = sub.add_parser("ask", help="greedy/temperature completion by the reference oracle, with top-k per step")
    a.add_argument("prompt", nargs="?", help="prompt text (chat-encoded unless --raw)")
    a.add_argument("--ids", type=_ids, help="comma-separated token ids, used as they are")
    mode = a.add_mutually_exclusive_group()
    mode.add_argument("--chat", action="store_true", help="encode PROMPT as one user turn (default)")
    mode.add_argument("--raw", action="store_true", help="tokenize PROMPT as plain text")
    a.add_argument("--thinking", action="store_true", help="chat in thinking mode (ends with <think>)")
    a.add_argument("--max-tokens", type=int, default=16)
    a.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    a.add_argument("--top", type=int, default=5, help="top-K tokens shown per step")
    a.add_argument("--numerics", choices=("official", "exact"), default="official")
    a.add_argument("--revision", choices=("current", "initial"), default="current",
                   help="V4-Flash release whose kernels are emulated (official numerics)")
    a.add_argument("--temperature", type=float, default=0.0)
    a.add_argument("--seed", type=int, default=33377335)
    a.add_argument("--json", help="also write the report as JSON to this file")
    a.set_defaults(func=cmd_ask)

    t = sub.add_parser("make-tiny", help="write a synthetic checkpoint in the official on-disk format")
    t.add_argument("dir")
    t.add_argument("--family", default="v4", choices=("v4", "v41", "v4-0731"))  # tiny.TINY_FAMILIES
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_make_tiny)

    par = sub.add_parser("parity", help="engine vs reference: find where and why they differ")
    psub = par.add_subparsers(dest="parity_command", required=True)

    def reference(sp):
        sp.add_argument("--ref", default="oracle",
                        help="reference: 'oracle' (default), 'official:PATH' (the official inference/ folder at "
                             "PATH, run unmodified; needs --numerics official) or 'transformers' "
                             "(DeepseekV4ForCausalLM; --numerics official)")

    def common(sp):
        sp.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
        sp.add_argument("--json", help="also write the results as JSON to this file")
        sp.add_argument("--limit", type=int, default=60, help="table rows printed (all rows go to --json)")
        sp.add_argument("--plot", help="also write PNG plots into this directory (needs matplotlib)")
        sp.set_defaults(func=cmd_parity)

    pw = psub.add_parser("weights", help="every quantised tensor as the engine uses it vs its official decoding")
    pw.add_argument("--filter", help="regular expression on tensor names")
    common(pw)
    pk = psub.add_parser("kv", help="store->load of every KV layout, and bit-exactness against the oracle")
    pk.add_argument("--layouts", help="comma-separated layout names (default: all)")
    common(pk)
    pn = psub.add_parser("next-token", help="engine vs reference next token, prefill and step-by-step decode")
    pn.add_argument("--ids", type=_ids, required=True, help="context token ids")
    pn.add_argument("--force-ids", type=_ids, help="ids fed one at a time after the context")
    pn.add_argument("--numerics", choices=("exact", "official"), default="exact")
    reference(pn)
    pn.add_argument("--api-steps", type=int, default=4,
                    help="also generate this many tokens through the full engine API beside decoy requests, "
                         "checking tokens and reported logprobs (0: off)")
    pn.add_argument("--api-speculative", type=int, default=0, metavar="K",
                    help="run that API path with K MTP draft tokens per step (the row map under drafting)")
    common(pn)
    pl = psub.add_parser("layers", help="per-sublayer residual state vs reference, against a measured floor")
    pl.add_argument("--ids", type=_ids, required=True, help="token ids (one prefill)")
    pl.add_argument("--numerics", choices=("exact", "official"), default="exact")
    pl.add_argument("--dump", help="also write both sides' states to DIR/rank{r}-pid{p}-layers-{side}.pt")
    reference(pl)
    common(pl)
    pd = psub.add_parser("drift", help="prefill-vs-decode table: flips judged by the reference margin vs noise")
    pd.add_argument("--ids", type=_ids, required=True, help="context token ids")
    pd.add_argument("--steps", type=int, default=16)
    pd.add_argument("--numerics", choices=("exact", "official"), default="exact")
    reference(pd)
    common(pd)

    i = sub.add_parser("inspect", help="config, layer schedule and tensor check of a checkpoint")
    i.add_argument("model", nargs="?")
    i.add_argument("--no-check", action="store_true")
    i.set_defaults(func=cmd_inspect)

    from deepinfer.server.cli_args import add_serve_parser  # argparse only; FastAPI loads when serving

    add_serve_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # bad input or a bad checkpoint: say what, no traceback
        print(f"deepinfer {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
