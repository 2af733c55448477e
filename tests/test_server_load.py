"""Load and lifecycle: 64 concurrent streams give the offline greedy text and leave every KV block free;
`deepinfer serve` as a subprocess finishes an in-flight stream on SIGTERM and exits cleanly; the
incremental `</think>` splitter."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from deepinfer.engine.llm import LLM
from deepinfer.sampling import SamplingParams
from deepinfer.server import ServerConfig
from deepinfer.server.reasoning import ReasoningSplitter, split
from deepinfer.server.testing import ThreadedServer, free_port

ENGINE = dict(max_model_len=256, max_num_seqs=32, num_blocks=40, max_num_batched_tokens=256)


def test_64_concurrent_streams_match_offline_and_free_kv(tiny_v4_dir):
    prompts = [f"request number {i}" for i in range(64)]
    ref = LLM(tiny_v4_dir, **ENGINE).generate(prompts, SamplingParams(temperature=0, max_tokens=4))
    with ThreadedServer(ServerConfig(model=str(tiny_v4_dir), port=0, **ENGINE)) as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)

        async def one(prompt: str) -> str:
            stream = await client.completions.create(model=(await client.models.list()).data[0].id, prompt=prompt,
                                                     max_tokens=4, temperature=0, stream=True)
            return "".join([ch.choices[0].text async for ch in stream if ch.choices])

        async def main():
            try:
                return await asyncio.gather(*(one(p) for p in prompts))
            finally:
                await client.close()

        texts = asyncio.run(main())
        assert texts == [r.outputs[0].text for r in ref]
        pool = server.engine.block_pool
        deadline = time.monotonic() + 5
        while pool.num_free != pool.num_blocks and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.num_free == pool.num_blocks and not server.engine.has_unfinished()


def test_cli_serve_finishes_in_flight_stream_on_sigterm(tiny_v4_dir, tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer.cli", "serve", "--model", str(tiny_v4_dir), "--port",
                             str(port), "--max-model-len", "256", "--num-blocks", "8", "--served-model-name", "t", "--shutdown-grace", "120"],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        body = {"model": "t", "prompt": "hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            proc.send_signal(signal.SIGTERM)  # mid-stream: the stream still completes
            rest = [line for line in lines if line.startswith("data:")]
        assert first and rest[-1] == "data: [DONE]"
        assert '"finish_reason": "length"' in rest[-2]
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once shut down
        assert "Application shutdown complete" in (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("cut", range(1, 12))
def test_reasoning_splitter_is_split_at_any_delta_boundary(cut):
    text = "I think so</think>The answer"
    s = ReasoningSplitter(thinking=True)
    parts = [s.feed(text[:cut]), s.feed(text[cut:]), s.flush()]
    assert "".join(r for r, _ in parts) == "I think so" == split(text, True)[0]
    assert "".join(c for _, c in parts) == "The answer" == split(text, True)[1]


def test_reasoning_splitter_without_thinking_and_unfinished_thought():
    assert ReasoningSplitter(False).feed("a</think>b") == ("", "a</think>b")
    s = ReasoningSplitter(True)
    assert s.feed("abc</th") == ("abc", "") and s.flush() == ("</th", "")
    assert split("still thinking", True) == ("still thinking", "")
