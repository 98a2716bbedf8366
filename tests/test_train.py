"""Training objective, micro-model training, lookahead-gate fit and the teacher-forced scorer."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from loopserve import LLM, SamplingParams
from loopserve.exits import ExitRule
from loopserve.model_config import ModelConfig
from loopserve.models.loader import load_model
from loopserve.models.ouro import OuroForCausalLM
from loopserve_lab.tiny import TinySpec, make_tiny
from loopserve_lab.train.objective import exit_cdf, exit_distribution, stage1_loss
from loopserve_lab.train.scorer import score_windows
from loopserve_lab.train.train_tiny import (
    TrainConfig,
    fit_lookahead_gate,
    gate_logits,
    init_weights,
    lookahead_stats,
    model_hf_config,
    step_losses,
    step_states,
)


def test_exit_distribution_by_hand():
    g = torch.tensor([[0.0], [math.log(3.0)], [-math.log(3.0)], [5.0]])  # lambda = 1/2, 3/4, 1/4, (ignored)
    p = exit_distribution(g)[:, 0]
    expected = [0.5, 0.5 * 0.75, 0.5 * 0.25 * 0.25, 0.5 * 0.25 * 0.75]
    assert torch.allclose(p, torch.tensor(expected), atol=1e-6)
    assert torch.allclose(exit_cdf(g)[:, 0], torch.tensor(expected).cumsum(0), atol=1e-6)


def test_stage1_loss_by_hand():
    g = torch.zeros(4, 2)  # lambda = 1/2 everywhere: p = (1/2, 1/4, 1/8, 1/8)
    losses = torch.tensor([[1.0, 2.0], [2.0, 2.0], [3.0, 2.0], [4.0, 2.0]])
    loss, stats = stage1_loss(losses, g, beta=0.1)
    p = [0.5, 0.25, 0.125, 0.125]
    h = -sum(x * math.log(x) for x in p)
    exp0 = sum(pi * li for pi, li in zip(p, [1, 2, 3, 4], strict=True))
    expected = (exp0 + 2.0) / 2 - 0.1 * h
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["entropy"] == pytest.approx(h, rel=1e-6)


def test_stage1_gradient_moves_mass_to_cheaper_steps_and_saturates_cleanly():
    g = torch.zeros(4, 1, requires_grad=True)
    losses = torch.tensor([[5.0], [1.0], [1.0], [1.0]])  # step 1 is bad: its exit probability must fall
    loss, _ = stage1_loss(losses, g, beta=0.05)
    loss.backward()
    assert g.grad[0, 0] > 0  # gradient descent lowers the step-1 gate logit
    g2 = torch.tensor([[60.0], [-60.0], [60.0], [0.0]], requires_grad=True)
    loss2, _ = stage1_loss(torch.ones(4, 1), g2, beta=0.1)
    loss2.backward()
    assert torch.isfinite(loss2) and torch.isfinite(g2.grad).all()


def _micro(seed=0):
    cfg = TrainConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=300, seq_len=16)
    model = OuroForCausalLM(ModelConfig.from_hf(model_hf_config(cfg)))
    init_weights(model, seed)
    return cfg, model


def test_micro_model_trains_and_gradient_reaches_gate():
    torch.manual_seed(0)
    _, model = _micro()
    pattern = torch.tensor([5, 9, 17, 33, 5, 9, 17, 33, 60, 61, 62, 63, 64, 65, 66, 67, 68])
    batch = torch.stack([pattern.roll(i) for i in range(4)])
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    first = None
    for step in range(12):
        states = step_states(model, batch[:, :-1])
        loss, _ = stage1_loss(step_losses(model, states, batch[:, 1:].reshape(-1)), gate_logits(model, states), 0.1)
        opt.zero_grad()
        loss.backward()
        if step == 0:
            first = loss.item()
            grads = {n: p.grad for n, p in model.named_parameters()}
            assert grads["model.early_exit_gate.weight"].abs().sum() > 0
            assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
        opt.step()
    assert loss.item() < first - 0.5


def test_lookahead_gate_fit_predicts_next_gate_logit():
    torch.manual_seed(0)
    _, model = _micro(seed=1)
    with torch.no_grad():
        model.model.early_exit_gate.weight.normal_(0, 1.0)
    wins = torch.randint(3, 300, (8, 16))
    w, b, _ = fit_lookahead_gate(model, wins, ridge=1e-3)
    assert w.shape == (1, 32) and b.shape == (1,)
    model.lookahead_gate = torch.nn.Linear(32, 1)
    with torch.no_grad():
        model.lookahead_gate.weight.copy_(w.float())
        model.lookahead_gate.bias.copy_(b.float())
    stats = lookahead_stats(model, wins)
    assert stats["r2"] > 0.3  # better than predicting the mean


def test_lookahead_tracker_by_hand():
    t = ExitRule("lookahead_gate", 0.5, 2, 4).new_item(0)
    # after step 1: lambda_1 = 0.2; predicted lambda_2 = 0.5 -> CDF_2 = 1 - 0.8 * 0.5 = 0.6 >= 0.5: step 2 is last
    assert t.observe(1, (math.log(0.2 / 0.8), 0.0))
    assert not t.observe(2, (0.0, 0.0))
    assert t.exit_depth == 2
    t = ExitRule("lookahead_gate", 0.99, 2, 4).new_item(0)
    assert t.observe(1, (0.0, 0.0)) and t.observe(2, (0.0, 0.0)) and t.observe(3, (0.0, 0.0))
    assert not t.observe(4, (0.0, 0.0)) and t.exit_depth == 4


@pytest.fixture(scope="module")
def tiny_ref(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "ouro", TinySpec(arch="ouro", seed=3, lookahead_gate=True))


@pytest.mark.parametrize("layout", ["depth_indexed", "last_exited", "shared"])
@pytest.mark.parametrize("lookahead", [False, True])
def test_scorer_matches_reference_decoder(tiny_ref, layout, lookahead):
    """Teacher-forcing the reference decoder's own sampled tokens reproduces its logprobs and depths."""
    model = load_model(tiny_ref, "float64", "cpu").model
    llm = LLM(str(tiny_ref), dtype="float64", scheduler="reference", kv_layout=layout, lookahead=lookahead)
    for q in (0.4, 0.7):
        outs = llm.generate([[5], [9], [44]], SamplingParams(max_tokens=12, temperature=1.0, logprobs=0,
                                                             exit_threshold=q, ignore_eos=True, seed=7))
        wins = torch.tensor([o.prompt_token_ids + o.outputs[0].token_ids for o in outs])
        res = score_windows(model, wins, layout, "gate", q, lookahead=lookahead)
        ref_lp = torch.tensor([[o.outputs[0].logprobs[i][t].logprob for i, t in enumerate(o.outputs[0].token_ids)]
                               for o in outs], dtype=torch.float64)
        ref_depth = torch.tensor([o.outputs[0].exit_depths for o in outs])
        n = res.depths.shape[1]
        assert torch.equal(res.depths, ref_depth[:, 1:1 + n])
        assert torch.allclose(res.logprobs, ref_lp[:, 1:1 + n], atol=1e-10)
        assert 1 < res.mean_depth < 4


def test_scorer_fixed_depth_equals_dense_forward(tiny_ref):
    model = load_model(tiny_ref, "float64", "cpu").model
    wins = torch.randint(3, 512, (2, 12))
    states = step_states(model, wins[:, :-1])
    dense = step_losses(model, states, wins[:, 1:].reshape(-1)).view(4, 2, 11)[:, :, 1:]  # drop the prompt's
    for d in (1, 4):
        res = score_windows(model, wins, "depth_indexed", "fixed", depth=d)
        assert torch.allclose(-res.logprobs, dense[d - 1].double(), atol=1e-9)
        assert (res.depths == d).all()


def test_lookahead_gate_mode_exits_no_earlier_than_two(tiny_ref):
    model = load_model(tiny_ref, "float32", "cpu").model
    res = score_windows(model, torch.randint(3, 512, (3, 10)), "depth_indexed", "lookahead_gate", threshold=0.3)
    assert res.depths.min() >= 2 and torch.equal(res.depths, res.loops)


# -- the lab's dtype: float32 on the CPU unless --dtype says otherwise -------------------------------------------
@pytest.fixture
def bf16_checkpoint(tiny_ref, tmp_path, monkeypatch):
    """tiny_ref declaring bfloat16, as the embedded model does, on a CPU with bfloat16 kernels: where LLM's dtype
    auto runs it in bfloat16. Yields the folder and the dtypes each load resolves to, in order."""
    from loopserve import device
    from loopserve.models import loader

    folder = tmp_path / "bf16"
    shutil.copytree(tiny_ref, folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "torch_dtype": "bfloat16"}))
    monkeypatch.setattr(device, "cpu_has_bf16_kernels", lambda: True)
    chosen: list[str] = []
    resolve = loader.resolve_dtype
    monkeypatch.setattr(loader, "resolve_dtype", lambda *a: chosen.append(resolve(*a)) or chosen[-1])
    return folder, chosen


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_trajectories_record_in_one_dtype(bf16_checkpoint, tmp_path, monkeypatch, dtype):
    """The gate logits (load_model) and the sampled continuations (LLM) of one recording: float32 by default, as
    before, or --dtype's; the LLM ran in auto's bfloat16 while the logits were float32."""
    from loopserve_lab.train import evaluate, trajectories

    folder, chosen = bf16_checkpoint
    monkeypatch.setattr(evaluate, "eval_texts", lambda tok: (None, torch.randint(3, 500, (40,))))
    monkeypatch.setattr(trajectories, "setup_mtbench", lambda: tmp_path / "question.jsonl")
    (tmp_path / "question.jsonl").write_text(json.dumps({"question_id": 1, "category": "writing",
                                                         "turns": ["Hello"]}) + "\n")
    trajectories.record(folder, tmp_path / "out", heldout_windows=2, seq_len=12, max_tokens=3, log=lambda _: None,
                        **({} if dtype is None else {"dtype": dtype}))
    assert chosen == [dtype or "float32"] * 2
    head = json.loads((tmp_path / "out" / "mtbench.json").read_text())
    assert head["dtype"] == (dtype or "float32") and len(head["requests"]) == 1


def test_eval_samples_run_in_the_scored_dtype(bf16_checkpoint):
    """`eval ppl --samples` sampled with LLM's auto (bfloat16 here) next to float32 perplexities."""
    from loopserve_lab.train.cli import samples

    folder, chosen = bf16_checkpoint
    assert len(samples(str(folder), n_tokens=2)) == 4
    assert chosen == ["float32"]
    assert len(samples(str(folder), n_tokens=2, dtype="bfloat16")) == 4
    assert chosen == ["float32", "bfloat16"]


def test_eval_commands_take_dtype_defaulting_to_float32():
    from loopserve.cli import build_parser

    parser = build_parser()
    for command in ("ppl", "trajectories"):
        assert parser.parse_args(["eval", command]).dtype == "float32"
        assert parser.parse_args(["eval", command, "--dtype", "bfloat16"]).dtype == "bfloat16"
        with pytest.raises(SystemExit):
            parser.parse_args(["eval", command, "--dtype", "half"])


@pytest.mark.parametrize("flags,words", [(["--steps", "0"], "--steps: must be an integer >= 1"),
                                         (["--lr", "0"], "--lr: must be a number"),
                                         (["--gate-warmup", "2"], "--gate-warmup: must be a number in [0.0, 1.0]")])
def test_train_tiny_refuses_settings_it_cannot_train_with(flags, words, capsys):
    """One `error:` line, before any data is read (--steps 0 ran to the end and divided by zero there)."""
    from loopserve.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["train-tiny", "--no-progress", "--cache-dir", "/nonexistent", *flags])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("error: ") and words in err and err.count("\n") == 1, err


def test_train_tiny_and_eval_refuse_their_outputs_before_running(tmp_path, capsys):
    """train-tiny replaced a checkpoint in a non-empty folder without a word; eval's outputs named as a folder
    (or a file for a folder) failed with a traceback after the whole evaluation."""
    from loopserve.cli import main

    taken = tmp_path / "model"
    taken.mkdir()
    (taken / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exited:
        main(["train-tiny", str(taken), "--no-progress", "--cache-dir", "/nonexistent"])
    assert exited.value.code == 2 and "the folder is not empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # with --overwrite it goes on, to the settings' own check
        main(["train-tiny", str(taken), "--overwrite", "--steps", "0", "--no-progress", "--cache-dir", "/nonexistent"])
    assert "--steps: must be an integer >= 1" in capsys.readouterr().err
    for argv, words in ((["eval", "ppl", "--out-json", str(tmp_path)], "is a folder; name a file"),
                        (["eval", "ppl", "--plots-dir", str(taken / "config.json")], "exists and is not a folder"),
                        (["eval", "trajectories", "--out-dir", str(taken / "config.json" / "x")], "is a file, not a"),
                        (["eval", "ppl", "--windows", "0"], "--windows: must be >= 1")):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2 and words in capsys.readouterr().err, argv


@pytest.fixture
def eval_offline(tmp_path, monkeypatch):
    """`eval`'s inputs without the network: a few held-out tokens, and one MT-Bench question."""
    from loopserve_lab.bench import workloads
    from loopserve_lab.train import evaluate, trajectories

    questions = tmp_path / "question.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["Hello"]}) + "\n")
    monkeypatch.setattr(evaluate, "eval_texts", lambda tok: (None, torch.randint(3, 500, (40,))))
    for module in (workloads, trajectories):
        monkeypatch.setattr(module, "setup_mtbench", lambda: questions)


@pytest.mark.parametrize("command", ["ppl", "trajectories"])
def test_eval_refuses_a_checkpoint_that_does_not_load_with_one_error_line(tiny_ref, tmp_path, eval_offline, capsys,
                                                                          command):
    """A tensor of the wrong shape was a traceback (exit 1) from inside the evaluation, where generate, serve and
    bench print the load's error as one `error:` line (exit 2)."""
    from safetensors.torch import load_file, save_file

    from loopserve.cli import main

    bad = tmp_path / "bad"
    shutil.copytree(tiny_ref, bad)
    tensors = load_file(bad / "model.safetensors")
    save_file({**tensors, "model.norm.weight": torch.ones(65)}, bad / "model.safetensors")
    out = ["--out-json", str(tmp_path / "r.json")] if command == "ppl" else ["--out-dir", str(tmp_path / "t")]
    with pytest.raises(SystemExit) as exited:
        main(["eval", command, str(bad), *out])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err == (f"error: {bad / 'model.safetensors'}: tensor 'model.norm.weight' has "
                                              "shape (65,), expected (64,)\n"), err


@pytest.mark.parametrize("command", ["ppl", "trajectories"])
def test_eval_refuses_huginn_up_front(tiny_huginn, tmp_path, eval_offline, capsys, command):
    """Both evaluations read Ouro's learned exit gate: a Huginn checkpoint (like-init state by default) crashed
    inside the scorer ("like-init state needs per-row seeds"), zero-state in the gate."""
    from loopserve.cli import main

    out = ["--out-json", str(tmp_path / "r.json")] if command == "ppl" else ["--out-dir", str(tmp_path / "t")]
    with pytest.raises(SystemExit) as exited:
        main(["eval", command, str(tiny_huginn), "--seq-len", "12", *out])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith(f"error: model: '{tiny_huginn}' is a RavenForCausalLM "
                                                     "checkpoint; `loopserve eval` evaluates OuroForCausalLM"), err
