"""`deepinfer ask` / `inspect` / `make-tiny` end to end on the embedded tiny model."""
from __future__ import annotations

import re

from deepinfer.cli import main
from deepinfer.reference import load_reference
from deepinfer.reference.generate import generate


def test_ask_prints_oracle_tokens_and_margins(tiny_v4_dir, capsys):
    ids = [2056, 768, 17607, 2793, 3139, 12108, 6692, 7624, 768]
    assert main(["ask", "--ids", ",".join(map(str, ids)), "--max-tokens", "4", "--model", str(tiny_v4_dir),
                 "--top", "3"]) == 0
    out = capsys.readouterr().out
    printed = [int(t) for t in re.search(r"generated ids: \[([0-9, ]+)\]", out).group(1).split(",")]
    model = load_reference(tiny_v4_dir, "official", max_batch_size=1, max_seq_len=len(ids) + 4, progress=False)
    expected = generate(model, [ids], 4)[0]
    assert printed == expected.tokens
    steps = re.findall(r"^\s+(\d+)\s+(\d+)\s+(-?[0-9.]+)\s", out, flags=re.M)
    assert len(steps) == 4
    for (_, token, margin), logits in zip(steps, expected.step_logits):
        top2 = logits.topk(2).values
        assert int(token) == int(logits.argmax()) and abs(float(margin) - float(top2[0] - top2[1])) < 1e-3


def test_ask_chat_encodes_the_seed_prompt(tiny_v4_dir, capsys):
    assert main(["ask", "问题：中国的首都是哪里？", "--max-tokens", "1", "--model", str(tiny_v4_dir)]) == 0
    out = capsys.readouterr().out
    assert "[0, 128803, 2056, 768, 17607, 2793, 3139, 12108, 1148, 128804, 128822]" in out


def test_ask_rejects_bad_input(tiny_v4_dir, capsys):
    assert main(["ask", "--ids", "1,2", "--max-tokens", "0", "--model", str(tiny_v4_dir)]) == 2
    assert "max-tokens" in capsys.readouterr().err
    assert main(["ask", "--ids", "1,999999", "--model", str(tiny_v4_dir)]) == 2
    assert "token ids" in capsys.readouterr().err


def test_inspect_checks_the_checkpoint(tiny_v4_dir, capsys):
    assert main(["inspect", str(tiny_v4_dir)]) == 0
    out = capsys.readouterr().out
    assert "family v4" in out and re.search(r"^\s+2 backbone\s+4 True", out, flags=re.M)


def test_exact_numerics_flag(tiny_v4_dir, capsys):
    assert main(["ask", "--ids", "5,6,7", "--max-tokens", "2", "--numerics", "exact", "--model", str(tiny_v4_dir)]) == 0
    assert "numerics: exact" in capsys.readouterr().out


def test_ask_on_tiny_v41(tiny_v41_dir, capsys):
    assert main(["ask", "--ids", "5,6,7,8", "--max-tokens", "3", "--model", str(tiny_v41_dir)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"generated ids: \[\d+, \d+, \d+\]", out)


def test_make_tiny_cli(tmp_path, capsys, monkeypatch):
    from deepinfer import tiny
    from deepinfer.config import ModelConfig

    small = ModelConfig.from_dict({**tiny.tiny_config().to_inference_json(), "vocab_size": 512})
    monkeypatch.setattr(tiny, "tiny_config", lambda family="v4": small)
    assert main(["make-tiny", str(tmp_path / "t"), "--seed", "1"]) == 0
    assert (tmp_path / "t" / "model.safetensors.index.json").exists()
