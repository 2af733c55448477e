"""`deepinfer serve --speculative-method mtp --num-speculative-tokens 2`: completions equal the offline
non-drafting greedy output, and /metrics reports drafts and acceptance per draft position."""
from __future__ import annotations

import argparse

import httpx

from deepinfer.engine.llm import LLM
from deepinfer.sampling import SamplingParams
from deepinfer.server import ServerConfig
from deepinfer.server.cli_args import add_serve_parser
from deepinfer.server.testing import ThreadedServer

ENGINE = dict(max_model_len=256, max_num_seqs=4, num_blocks=8)


def test_serve_with_mtp_drafts(tiny_v4_dir):
    ref = LLM(tiny_v4_dir, **ENGINE).generate("The capital of France",
                                              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    cfg = ServerConfig(model=str(tiny_v4_dir), served_model_name="m", port=0, speculative_method="mtp",
                       num_speculative_tokens=2, **ENGINE)
    with ThreadedServer(cfg) as s, httpx.Client(base_url=s.url, timeout=60) as h:
        r = h.post("/v1/completions", json={"model": "m", "prompt": "The capital of France", "max_tokens": 8,
                                             "temperature": 0, "ignore_eos": True}).json()
        assert r["choices"][0]["text"] == ref.outputs[0].text
        text = h.get("/metrics").text
    for pos in ("1", "2"):
        assert f'deepinfer_spec_decode_num_draft_tokens_total{{position="{pos}"}}' in text
        assert f'deepinfer_spec_decode_acceptance_rate{{position="{pos}"}}' in text


def test_serve_flags_parse():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--speculative-method", "dspark", "--num-speculative-tokens", "4"])
    assert (args.speculative_method, args.num_speculative_tokens) == ("dspark", 4)
