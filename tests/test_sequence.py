"""A request's token bookkeeping on the batch path: the tokens `StatePool.requeue_quiet` lets a coda batch
record by `HeldTokens.add` alone are exactly those `Sequence.append` would take without finishing
the request, and the sequence reads them back in order; and
`KVCacheManager.ensure_slots` (what a prelude batch calls) makes room token by token as `ensure` does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loopserve.cache.manager import KVCacheManager
from loopserve.cache.pool import KVStore
from loopserve.engine.held_tokens import HOLD
from loopserve.engine.runner import StatePool
from loopserve.engine.sequence import Sequence
from loopserve.exits import ExitRule
from loopserve.models.loader import read_generation_config
from loopserve.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams
from loopserve.tokenizer import Tokenizer


def _sequence(tok: Tokenizer, params: SamplingParams) -> Sequence:
    return Sequence("r", None, [5], params, ExitRule("fixed", None, 1, 1), 0, tok, 4096, tok.vocab_size)


@settings(max_examples=80, deadline=None)
@given(tokens=st.lists(st.integers(0, 40), min_size=1, max_size=3 * HOLD),
       max_tokens=st.integers(1, 3 * HOLD), min_tokens=st.integers(0, 4),
       stop_ids=st.lists(st.integers(0, 12), max_size=3), ignore_eos=st.booleans(),
       other_stops=st.lists(st.integers(0, 12), max_size=2), reads=st.sets(st.integers(0, 3 * HOLD)))
def test_quiet_tokens_held_are_the_appends_that_finish_nothing(tiny_ouro, tokens, max_tokens, min_tokens, stop_ids,
                                                              ignore_eos, other_stops, reads):
    """Feeding tokens through `StatePool.requeue_quiet` (which holds them by `HeldTokens.add`) where it takes them
    (as `Scheduler.after_coda` does), else through `append`, leaves the request as `append` alone does:
    tokens, depths, loops, finish, stop reason, text, times, whether it reads its lists between tokens
    (`reads`) or not (the slot then settles its sequence every `HOLD` tokens), and when another sequence
    takes the slot (the holder settles first). It declines every token that may finish the request, and
    the stop tokens of the sequence in another slot, and nothing else."""
    # (the generation config's second eos id too: one that ends the request with itself as stop_reason)
    tok = Tokenizer(tiny_ouro, extra_eos_ids=read_generation_config(tiny_ouro).eos_token_ids)
    assert len(tok.eos_token_ids) > 1
    eos = min(tok.eos_token_ids)
    stream = [eos if t == 0 else t for t in tokens]  # eos at times, stop ids at times
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens), stop_token_ids=stop_ids,
                            ignore_eos=ignore_eos, output_kind=RequestOutputKind.FINAL_ONLY)
    batch, plain = _sequence(tok, params), _sequence(tok, params)
    other = _sequence(tok, SamplingParams(stop_token_ids=other_stops, ignore_eos=True))
    pool = StatePool(1, 4, torch.float32, torch.device("cpu"), with_inject=False)  # (one row: the batch's)
    facts, held = pool.sequences, pool.held  # (both grow)
    pool.kv_slot[0] = 2  # (the row's sequence: `batch`)
    for slot, seq in ((3, other), (2, batch), (1, other), (1, plain)):  # `plain` in the place of `other`: its
        facts.admit(slot, seq)  # stop tokens no longer count there
        held.admit(slot, seq)
    stoppers = set(stop_ids) | (set() if ignore_eos else set(tok.eos_token_ids))
    assert batch.quiet and facts.stops_counted()
    for k, t in enumerate(stream):
        now, depth, loops = float(k), k % 4 + 1, 2 * k + 1
        pool.decode_index[0], pool.exits.exit_depth[0], pool.r[0] = k - 1, depth, loops  # (fed generated token k - 1)
        picked, slots = pool.requeue_quiet([None], np.zeros(1, np.int64), np.array([t]), np.ones(1, bool), 0, 1,
                                           now)  # type: ignore[list-item]
        quiet = len(picked) == 1
        assert slots.tolist() == ([2] if quiet else [])
        if not quiet:
            batch.metrics.loops_run += loops
            batch.append(t, depth, now)
        plain.metrics.loops_run += loops
        plain.append(t, depth, now)
        # it declines a stop token (even one min_tokens keeps from stopping) and the last token allowed
        assert quiet == (t not in stoppers | set(other_stops) and len(plain.output_ids) < max_tokens)
        assert held.count[2] <= HOLD
        if k in reads:
            assert batch.output_ids == plain.output_ids and held.count[2] == 0
        if plain.finished:
            break
    held.admit(4 * HOLD, _sequence(tok, params))  # the arrays grow: the tokens held in slot 2 stay
    held.admit(2, other)  # the slot's next sequence: `batch` takes its tokens in and lets go
    assert batch.held is None and held.count[2] == 0
    for name in ("output_ids", "exit_depths", "finish_reason", "stop_reason", "text"):
        assert getattr(batch, name) == getattr(plain, name), name
    assert (batch.metrics.first_token_time, batch.metrics.last_token_time, batch.metrics.loops_run) == (
        plain.metrics.first_token_time, plain.metrics.last_token_time, plain.metrics.loops_run)


@pytest.mark.parametrize("loud", [dict(logprobs=2), dict(stop=["ab"]),
                                  dict(guided_decoding=GuidedDecodingParams(regex="a+"))])
def test_requests_that_read_each_token_are_not_quiet(tiny_ouro, loud):
    """Logprobs, stop strings and grammars need `append`'s work at every token; streaming alone does not (its
    text and output are made for a whole batch's quiet tokens)."""
    tok = Tokenizer(tiny_ouro)
    for kind in RequestOutputKind:
        assert _sequence(tok, SamplingParams(max_tokens=4, output_kind=kind)).quiet
    assert not _sequence(tok, SamplingParams(max_tokens=4, **{"output_kind": RequestOutputKind.FINAL_ONLY,
                                                               **loud})).quiet


@settings(max_examples=80, deadline=None)
@given(blocks=st.integers(1, 12), calls=st.lists(
    st.lists(st.tuples(st.integers(0, 5), st.integers(1, 40)), min_size=1, max_size=6), max_size=8))
def test_ensure_slots_makes_room_in_order_and_stops_at_the_first_short(blocks, calls):
    """Each call gives room to a prefix of its sequences (by slot, a slot maybe listed twice), in order, as
    `ensure` one by one does: every one of them holds blocks for its tokens afterwards, its tokens in use at
    least those; the first left out needs more blocks than are free, its table untouched. The slot arrays
    stay those of the tables (`check_invariants`)."""
    bs = 4
    kv = KVCacheManager(KVStore(blocks * bs, 1, 1, 2, torch.float32), bs, num_slots=2)  # (slot arrays grow)
    for i in range(6):
        kv.adopt(f"s{i}", [])
    one_by_one = KVCacheManager(KVStore(blocks * bs, 1, 1, 2, torch.float32), bs, num_slots=2)
    for i in range(6):
        one_by_one.adopt(f"s{i}", [])
    for call in calls:
        ids = [f"s{i}" for i, _ in call]
        ns = [n for _, n in call]
        before = {sid: (kv.blocks(sid), kv.num_tokens(sid)) for sid in kv.tables}
        got = kv.ensure_slots(np.array([kv.slot(sid) for sid in ids], np.int64), np.array(ns, np.int64))
        expect = next((j for j, (sid, n) in enumerate(zip(ids, ns, strict=True)) if not one_by_one.ensure(sid, n)),
                      len(ids))
        assert got == expect
        for sid, n in zip(ids[:got], ns[:got], strict=True):
            assert len(kv.blocks(sid)) * bs >= n and kv.num_tokens(sid) >= n
        for sid in kv.tables:
            assert (kv.blocks(sid), kv.num_tokens(sid)) == (one_by_one.blocks(sid), one_by_one.num_tokens(sid))
        if got < len(ids):
            short = ids[got]
            assert kv.blocks_needed(short, ns[got]) > kv.num_free
            if short not in ids[:got]:  # (not grown earlier in this call)
                assert (kv.blocks(short), kv.num_tokens(short)) == before[short]
        kv.check_invariants(set(kv.tables))
        held = sum(len(kv.blocks(sid)) for sid in kv.tables)
        assert held + kv.num_free == kv.num_blocks
