"""The shipped Shakespeare model: folder layout, loader, default-model path, gate math."""

from __future__ import annotations

import json

import pytest
import torch

from loopserve import LLM, SamplingParams
from loopserve.exits import ExitRule
from loopserve.models.loader import embedded_model_path, load_model
from loopserve_lab.train.objective import exit_cdf
from loopserve_lab.train.scorer import score_windows
from loopserve_lab.train.train_tiny import gate_logits, step_states

PATH = embedded_model_path()
TEXT = "BRUTUS:\nWhat means this shouting? I do fear, the people\nChoose Caesar for their king.\n"

pytestmark = pytest.mark.skipif(not (PATH / "model.safetensors").is_file(), reason="embedded model not built")




@pytest.fixture(scope="module")
def loaded():
    return load_model(PATH, "float32", "cpu")


def test_folder_layout():
    files = {p.name for p in PATH.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.json",
            "merges.txt", "special_tokens_map.json", "generation_config.json"} <= files
    size = sum(p.stat().st_size for p in PATH.iterdir())
    assert size <= 15 * 2**20
    cfg = json.loads((PATH / "config.json").read_text())
    assert cfg["architectures"] == ["OuroForCausalLM"] and cfg["total_ut_steps"] == 4
    assert 0 < cfg["early_exit_threshold"] < 1
    assert json.loads((PATH / "generation_config.json").read_text())["eos_token_id"] == [0, 2]


def test_loader_picks_up_lookahead_gate(loaded):
    m = loaded.model
    assert m.has_lookahead_gate and m.lookahead_gate.weight.shape == (1, m.config.hidden_size)
    assert loaded.config.r_max == 4 and loaded.config.vocab_size == loaded.tokenizer.vocab_size
    assert loaded.tokenizer.encode("<|im_start|>user")[0] == 1
    assert loaded.tokenizer.eos_token_ids == {0, 2}


def test_default_model_is_the_embedded_one():
    from loopserve.llm import default_model_path

    assert default_model_path().resolve() == PATH.resolve()


def test_gate_math_on_shipped_weights(loaded):
    """Exit CDF from the training objective == the engine's ExitTracker, and the scorer's exits on a
    teacher-forced text agree with the full-depth gate wherever no early exit changed the KV."""
    m, tok = loaded.model, loaded.tokenizer
    ids = tok.encode(TEXT)
    with torch.no_grad():
        g = gate_logits(m, step_states(m, torch.tensor([ids])))  # [4, N]
    q = loaded.config.exit_threshold
    cdf = exit_cdf(g.double())
    by_cdf = []
    for i in range(len(ids)):
        hits = (cdf[:-1, i] >= q).nonzero()  # steps 1..3 by the CDF rule; step 4 always exits
        by_cdf.append(int(hits[0]) + 1 if len(hits) else 4)
    rule = ExitRule("gate", q, 1, 4)
    by_tracker = []
    for i in range(len(ids)):
        t = rule.new_item(0)
        r = 0
        while True:
            r += 1
            if not t.observe(r, float(g[r - 1, i])):
                break
        by_tracker.append(t.exit_depth)
    assert by_cdf == by_tracker
    assert 1 <= sum(by_cdf) / len(by_cdf) < 4  # the gate is not collapsed on this text
    # the first decode item sees only the full-depth prompt token: same exit as the full-depth gate
    res = score_windows(m, torch.tensor([ids]), "depth_indexed", "gate", q)
    assert int(res.depths[0, 0]) == by_cdf[1]


def test_llm_generates_with_exit_histogram():
    llm = LLM(str(PATH), scheduler="reference")
    out = llm.generate("ROMEO:\n", SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0]
    assert len(out.token_ids) >= 1 and out.text
    assert all(1 <= d <= 4 for d in out.exit_depths)


def test_generate_reports_the_decode_tokens_depths(capsys):
    """`loopserve generate` (and the demo) report the exit depths of the decode tokens, as the README's 2.0 loops and
    the server's stats and metrics count them: an output's first token is its prompt's, at full depth, and was
    counted in (mean 2.05 over 64 tokens beside the stats line's 2.00)."""
    from loopserve.cli import main as cli_main

    llm = LLM(str(PATH), scheduler="reference")
    prompts = ["ROMEO:\n", "JULIET:\n"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    decoded = [d for o in outs for d in o.outputs[0].exit_depths[1:]]
    assert cli_main(["generate", "--scheduler", "reference", "--max-tokens", "12", "--temperature", "0", *prompts]) == 0
    printed = capsys.readouterr().out
    assert f"exit depth: mean {sum(decoded) / len(decoded):.2f} over {len(decoded)} decode tokens" in printed, printed
