"""Batched next-token sampling and logprobs, run where the logits are (the device).

`sample_batch` takes a stage batch's logits [B, V] and each row's `SamplingParams`, seed and token
index, and samples every row in one call: greedy, temperature, top-k, top-p and min-p with per-row
values, plus top-k logprobs for the rows that ask for them. Only token ids, a finiteness flag per
row and the requested logprobs cross to the host (`SampledBatch` holds them there).

Batch invariance: every operation is row-wise (softmax, sort, cumsum over one row's vocabulary),
in float64, and a random row draws its uniform from a counter-based stream, a hash of (request
seed, token index), instead of a generator shared with other rows, so a row's token never depends
on its neighbours or the batch size. The reference decoder samples through the same function with
a batch of one, which is what makes seeded sampling exact against it.

Before temperature and the filters, `adjust_logits` applies what vLLM applies first, for the rows
that ask for it: the `allowed_token_ids` and `bad_words` masks, `logit_bias`, the `min_tokens` mask
of the stop token ids, then the repetition, frequency and presence penalties over the request's
tokens (`penalize`, row-wise too). A request's
tokens reach the sampler through its params (`bind`): every caller already passes a row's params, and
a batch with no such row pays for none of it. Logprobs are of the raw distribution (the model's own,
before any of these and before temperature): vLLM's default `raw_logprobs`.
First of all, `apply_guides` (engine/grammar.py) sets the tokens a guided row's grammar forbids to -inf, from
the matcher its params carry (structured output), in the raw distribution too, as vLLM masks the logits its
sampler gets; rows without a grammar are not touched. (The masks after it leave a forbidden token at -inf: the
draws are the same either way.) A guided row whose
grammar and other masks together leave no token fails alone with `NothingToSampleError` naming the fields
(`guided_room`, checked on the host bitmasks: no device readback), as does a row whose bad words and min_tokens
leave none of its allowed tokens.

A batch whose rows are all plain greedy (no adjustment, mask, grammar or logprobs) is one argmax over the
logits as they are (float64 would order them the same), with no float64 copy. On the CPU every
argmax is numpy's (`argmax_rows`): the same index, several times faster than torch's there.

A row whose logits are not all finite is flagged instead of sampled from (`NonFiniteError` when
its request takes the sample). If the batched call itself raises, `sample_rows` samples row by
row, so one request's parameters can only ever fail that request.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Protocol

import numpy as np
import torch

from loopserve.device import upload
from loopserve.engine.grammar import apply_guides
from loopserve.errors import GrammarLimitError, NonFiniteError
from loopserve.jit import kernel
from loopserve.random_streams import uniforms
from loopserve.sampling_params import GUIDE_KINDS, SamplingParams


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor, filters: tuple[int, bool, bool] | None = None) -> torch.Tensor:
    """[B, V] sampling distributions (float64) after temperature, then min-p and top-k, then top-p, each a [B]
    tensor of per-row values (top_k = V, top_p = 1, min_p = 0: no filter), in vLLM V1's order: min-p (one of its
    argmax-invariant logits processors) before top-k / top-p, so a nucleus is taken of what min-p left, renormalized
    (min-p and top-k commute: each keeps a row's largest values). `filters` says, from the
    host (asking the device would make the host wait): the largest top_k of the rows that filter by
    it (0: none does), whether any row uses top-p, whether any uses min-p; None: read off the tensors."""
    vocab = logits.shape[-1]
    if filters is None:
        ks = [k for k in top_k.tolist() if k < vocab]
        filters = (max(ks, default=0), bool((top_p < 1).any()), bool((min_p > 0).any()))
    x = logits / temperature[:, None]  # temperature >= MIN_TEMPERATURE (SamplingParams' checks), so x stays finite
    k_max, use_p, use_min_p = filters
    if isinstance(k_max, bool):  # (an old-style (bool, bool, bool) would read True as top-1)
        raise TypeError("filters: (largest top_k of the filtering rows or 0, any top_p, any min_p)")
    if k_max:  # each row's k-th largest value (whatever the order of ties), from the largest k_max alone
        kth = x.topk(k_max).values.gather(1, (top_k.clamp(max=k_max) - 1)[:, None])
        x = x.masked_fill((x < kth) & (top_k < vocab)[:, None], float("-inf"))
    probs = torch.softmax(x, -1)
    if use_min_p:
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0.0)
        if use_p:  # (the nucleus is read off the renormalized distribution: of the rows that use both alone, so that
            # no row's values depend on what its neighbours ask for)
            both = ((min_p > 0) & (top_p < 1))[:, None]
            probs = torch.where(both, probs / probs.sum(-1, keepdim=True), probs)
    if use_p:
        probs = nucleus(probs, top_p)
    return probs / probs.sum(-1, keepdim=True)


def nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`probs` [B, V] with each row's tokens outside its top-p nucleus set to 0 (not renormalized; in
    place on the CPU): in a stable descending sort of the row, a token is kept while the mass strictly
    before it is under top_p (every token at top_p = 1). On the CPU, where sorting a row of 49,152
    float64 values takes about 4 ms, a row is first settled from its largest values alone
    (`_nucleus_from_largest`: the same sums in the same order, so the same tokens and values), and
    sorted whole only if they do not hold its nucleus."""
    cut = torch.where(top_p < 1, top_p, torch.full_like(top_p, float("inf")))
    if probs.device.type != "cpu":  # (a GPU sorts fast; the narrowing below reads sizes on the host)
        return _sorted_nucleus(probs, cut)
    margin = _nucleus_margin(probs.dtype)
    rows = torch.nonzero(top_p < 1).flatten()  # (a row at top_p = 1 keeps every token)
    near_one = cut[rows] + margin >= 1  # never settled from its largest values: sorted at once
    rows, sort_rows, k = rows[~near_one], rows[near_one], _NUCLEUS_FIRST_K
    while len(rows) and k * _NUCLEUS_WIDEST <= probs.shape[1]:
        part = probs if len(rows) == len(probs) else probs[rows]
        unsettled, widest = _nucleus_from_largest(part, cut[rows], k, margin)
        if part is not probs:
            probs[rows] = part
        # the next pass 8x as wide, or as wide as the rows left need at least (flat rows: the sort)
        rows, k = rows[unsettled], max(8 * k, math.ceil(min(widest, probs.shape[1])))
    rest = torch.cat([rows, sort_rows])
    if len(rest):
        probs[rest] = _sorted_nucleus(probs[rest], cut[rest])
    return probs


def _nucleus_margin(dtype: torch.dtype) -> float:
    """How far a row's mass must pass top_p for the later tokens' running sums to stay above it whatever
    their rounding (a few ulps of 1 in the dtype; float64 sums, as the sampler's, get 1e-9)."""
    return max(1e-9, 16 * torch.finfo(dtype).eps)


_NUCLEUS_FIRST_K = 64  # the largest probabilities a row's nucleus is first looked for in (then 8x as many)
_NUCLEUS_WIDEST = 4  # a pass over more than 1/4 of a row's values costs about a sort of the row: sort it


def _sorted_nucleus(probs: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """`nucleus` by a sort of every row (`cut`: top_p, or infinity for rows that keep everything)."""
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
    return torch.zeros_like(probs).scatter(1, order, sorted_p.masked_fill(before >= cut[:, None], 0.0))


def _nucleus_from_largest(probs: torch.Tensor, cut: torch.Tensor, k: int,
                          margin: float) -> tuple[torch.Tensor, float]:
    """`_sorted_nucleus`, in place, of each row whose nucleus lies among its values >= its k-th largest
    (k or more: ties are all in). Returns the mask of the other rows, left as they were, and how many
    largest values the widest of them needs at least (each value left is at most the k-th largest;
    inf: no pass will do, sort them). A stable descending sort puts those values first, in the order it
    puts them (by value, then index), so their running sums are the sort's; a row is settled when their
    mass reaches `cut` + `margin` (far above rounding), so that every later token has more than `cut`
    before it. A row with no positive value (its logits all masked, or NaN) is never settled here."""
    kth = probs.topk(k, sorted=False).values.amin(-1)
    inside = (probs >= kth[:, None]) & (probs > 0)  # (> 0: after a top-k filter most of a row is 0, which
    count = inside.sum(-1)  # adds nothing and stays 0)
    m = int(count.max())
    if m == 0 or m * _NUCLEUS_WIDEST > probs.shape[1]:  # (no positive value, or so many ties at the k-th)
        return torch.ones(len(probs), dtype=torch.bool, device=probs.device), float("inf")
    # the `inside` indices by index (a row with fewer than m gets other, outside indices after them)
    idx = inside.to(torch.uint8).topk(m, sorted=False).indices.sort(-1).values
    vals = probs.gather(1, idx).masked_fill(~inside.gather(1, idx), 0.0)
    sorted_p, o = vals.sort(dim=-1, descending=True, stable=True)
    total = sorted_p.cumsum(-1)
    settled = total[:, -1] >= cut + margin
    drop = (total - sorted_p >= cut[:, None]) & settled[:, None]
    # zero what lies below a row's smallest kept value, then what the sort drops among the values above it
    smallest = sorted_p.masked_fill(drop, float("inf")).amin(-1).masked_fill(~settled, 0.0)
    probs.masked_fill_(probs < smallest[:, None], 0.0)
    order = idx.gather(1, o)
    probs.scatter_(1, order, probs.gather(1, order).masked_fill_(drop, 0.0))
    reach = count + (cut + margin - total[:, -1]) / kth  # (nan, inf where kth is 0 or NaN: sort)
    left = reach[~settled]
    widest = float(left.nan_to_num(float("inf")).max()) if len(left) else 0.0
    return ~settled, widest


class NothingToSampleError(ValueError):
    """A request's own sampling constraints leave it no token to sample at this step: `bad_words` (of several
    tokens, banning a word's last one after the others) and what `min_tokens` holds back cover every one of its
    `allowed_token_ids`, or, for a guided request, every token its grammar allows there (`guided_room`). Its
    input is at fault, not the engine: it fails alone, with status 400."""


# The failures of one request's own making, which fail it alone and are reported as they are (no traceback):
# its model outputs (non-finite: status 500) and its input (its grammar past the parser's limits, sampling
# constraints that leave no token: status 400). Any other exception a request raises is a bug.
REQUEST_ERRORS = (NonFiniteError, GrammarLimitError, NothingToSampleError)


class TokenHistory(Protocol):
    """What penalties, `min_tokens` and `bad_words` read of a request besides its params (its `Sequence`)."""

    prompt_ids: list[int]
    eos_ids: set[int]  # empty under ignore_eos

    @property
    def output_ids(self) -> list[int]: ...


class LogitBias(dict[int, float]):
    """A request's `logit_bias` as the sampler applies it at every step: its token ids and biases also as
    tensors, built once (rebuilt from the dict at every step, a bias over Ouro's 49,152 tokens added
    about 100 ms to every step of the batch it was in). The request's own snapshot: changing the dict it
    was made from does not change it."""

    def __init__(self, bias: dict[int, float]) -> None:
        super().__init__(bias)
        self.ids = torch.tensor(list(self.keys()), dtype=torch.long)
        self.biases = torch.tensor(list(self.values()), dtype=torch.float64)
        self.top = max(self.keys(), default=-1)


class StopTokenIds(list[int]):
    """A request's `stop_token_ids`, with what `min_tokens` holds back until it is reached (these and the
    end-of-sequence tokens, unique, sorted) as a tensor, built once: rebuilt at every step, 49,152 stop
    ids held every other request's stream up 0.6 s at a time."""

    def __init__(self, ids: list[int], eos_ids: set[int]) -> None:
        super().__init__(ids)
        # (an id past int64 is in no vocabulary: taken, as one past the model's, and never met)
        self.held = torch.tensor(sorted(t for t in eos_ids.union(ids) if t < 2**63), dtype=torch.long)


class AllowedTokenIds(list[int]):
    """A request's `allowed_token_ids` as a set: unique and sorted, also as a tensor, built once per request
    (`make_sequence`) and shared by its samples (as `LogitBias`: a list as long as a real vocabulary, rebuilt at
    every step, would cost every step of its batch; built per sample, 10^6 ids made n copies of it). Never
    modified after: samples, and the steps of each, read the one object."""

    def __init__(self, ids: Iterable[int]) -> None:
        given = ids if isinstance(ids, list) else list(ids)
        # by numpy (10^6 ids: 16 ms, where torch.tensor of the list took 49); SamplingParams has made its list
        # unique and sorted, which is checked here in one vectorized pass rather than sorted again (45 ms)
        array = np.array(given, dtype=np.int64)
        if not (array[1:] > array[:-1]).all():
            array = np.unique(array)  # (sorted)
            given = array.tolist()
        super().__init__(given)
        self.ids = torch.from_numpy(array)
        self.top = self[-1] if self else -1
        self._keep: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._packed: dict[int, np.ndarray] = {}

    def keep(self, vocab: int, dev: torch.device) -> torch.Tensor:
        """[vocab] bool on `dev`, true at the allowed ids (all < vocab), made once: every step of every sample
        stacks the one mask (where scattering its ids into a fresh one cost each row O(ids) at every step)."""
        mask = self._keep.get((vocab, dev))
        if mask is None:
            host = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, self.ids, True)
            mask = self._keep[(vocab, dev)] = upload(host, dev)
        return mask

    def packed(self, words: int) -> np.ndarray:
        """[words] uint32 on the host, a grammar's bitmask layout (bit t % 32 of word t // 32: token t), set at
        the allowed ids below words * 32; made once, read-only (a guided row's check, `guided_room`)."""
        mask = self._packed.get(words)
        if mask is None:
            bits = np.zeros(words * 32, dtype=bool)
            ids = self.ids.numpy()
            bits[ids[ids < len(bits)]] = True
            mask = self._packed[words] = _bitmask_words(np.packbits(bits, bitorder="little"))
            mask.flags.writeable = False
        return mask


class BadWords(list[str]):
    """A request's `bad_words` with the token sequences the sampler bans (`tokenize`), made once per request."""

    def __init__(self, words: list[str], token_ids: list[list[int]]) -> None:
        super().__init__(words)
        self.token_ids = token_ids
        # the words of one token: banned at every step, the first output token's included
        self.always = [ids[0] for ids in token_ids if len(ids) == 1]

    @classmethod
    def tokenize(cls, words: list[str], encode: Callable[[list[str]], list[list[int]]], vocab: int) -> BadWords:
        """vLLM's rule: each word with its leading whitespace stripped, and after one space too when that gives
        as many tokens starting with another one (a tokenizer that folds the space into the word's first token,
        as byte-level BPE does: the word's form inside a text). Any other spaced form is the word's own tokens
        after a space token, which the word's own sequence already bans. ValueError naming the word's field for
        a word that gives no token, or one outside the model's vocabulary. `encode` tokenizes a list of texts
        (`Tokenizer.encode_texts`: one call for all the forms)."""
        stripped = [word.lstrip() for word in words]
        forms = encode(stripped + [" " + word for word in stripped])
        seqs: list[list[int]] = []
        for i, (alone, spaced) in enumerate(zip(forms[:len(words)], forms[len(words):], strict=True)):
            if not alone:
                raise ValueError(f"bad_words.{i}: the word gives no token")
            kept = [alone, spaced] if len(spaced) == len(alone) and spaced[0] != alone[0] else [alone]
            if any(t >= vocab for ids in kept for t in ids):
                raise ValueError(f"bad_words.{i}: tokenizes to ids outside the model's vocabulary [0, {vocab})")
            seqs += kept
        return cls(words, seqs)


def bind(params: SamplingParams, history: TokenHistory) -> SamplingParams:
    """The params a request samples with: as given, or its own copy when its sampling reads more than they
    say: its tokens (penalties, min_tokens, bad_words; params may be shared by many requests, the history is
    one's), its `logit_bias`, `allowed_token_ids` or what `min_tokens` holds back, as tensors. Allowed token ids
    already an `AllowedTokenIds` (`make_sequence` builds one per request) are kept, the object itself: a request's
    samples share it."""
    built = params.allowed_token_ids is None or isinstance(params.allowed_token_ids, AllowedTokenIds)
    if not (params.penalized or params.min_tokens or params.logit_bias or params.bad_words or not built):
        return params
    bound = copy.copy(params)
    bound.history = history
    if params.logit_bias:
        bound.logit_bias = LogitBias(params.logit_bias)
    if params.min_tokens:
        bound.stop_token_ids = StopTokenIds(params.stop_token_ids, history.eos_ids)
    if not built:
        bound.allowed_token_ids = _allowed(params)
    return bound


def _held(p: SamplingParams) -> torch.Tensor:
    """The tokens `min_tokens` holds back for a request: its stop ids and eos tokens (see `StopTokenIds`)."""
    ids = p.stop_token_ids
    return ids.held if isinstance(ids, StopTokenIds) else StopTokenIds(ids, _history(p).eos_ids).held


def _history(p: SamplingParams) -> TokenHistory:
    history = p.history
    if history is None:
        raise ValueError("penalties, min_tokens and bad_words need the request's tokens: sample with "
                         "bind(params, sequence)")
    return history


def token_counts(rows: list[list[int]], vocab: int, dev: torch.device) -> torch.Tensor:
    """[len(rows), vocab] float64: how many times each token occurs in each row's list (one bincount)."""
    flat = upload(list(chain.from_iterable(rows)), dev)
    which = upload(torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([len(r) for r in rows])), dev)
    counts = torch.bincount(which * vocab + flat, minlength=len(rows) * vocab)
    return counts.view(len(rows), vocab).to(torch.float64)


def penalize(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor | None, presence: torch.Tensor,
             frequency: torch.Tensor, repetition: torch.Tensor | None) -> torch.Tensor:
    """Penalties on [B, V] float64 logits, per-row values [B]: the repetition penalty divides the positive
    logit (multiplies the negative one) of each token that occurs in the prompt (`in_prompt` [B, V]) or
    the output, then logits -= frequency * count + presence * (count > 0), `counts` [B, V] being the
    output's (OpenAI's definition). `in_prompt` and `repetition` are None when no row uses it."""
    generated = counts > 0
    x = logits
    if repetition is not None and in_prompt is not None:
        rep = repetition[:, None]
        x = torch.where(generated | in_prompt, torch.where(x > 0, x / rep, x * rep), x)
    return x - frequency[:, None] * counts - presence[:, None] * generated


def _banned(p: SamplingParams, n: int) -> list[int]:
    """The tokens a request's `bad_words` ban after its first n output tokens: the last token of each word's
    sequence whose other tokens end them (vLLM's rule: the output, not the prompt)."""
    words = p.bad_words
    if not isinstance(words, BadWords):
        raise ValueError("bad_words: not tokenized; sample with the params of a Sequence, which tokenizes them")
    out = _history(p).output_ids
    return [ids[-1] for ids in words.token_ids if len(ids) - 1 <= n and out[n - len(ids) + 1:n] == ids[:-1]]


def bad_word_bans(params: list[SamplingParams], counters: list[int]) -> dict[int, list[int]]:
    """Row -> the tokens its `bad_words` ban at this step (`_banned`; `counters`: tokens generated so far), for the
    rows that have bad words: worked out once a step, for their mask (`adjust_logits`) and, for a guided row, its
    check (`_check_guided`)."""
    return {i: _banned(p, counters[i]) for i, p in enumerate(params) if p.bad_words}


def _mask_tokens(x: torch.Tensor, params: list[SamplingParams], counters: list[int], rows: list[int],
                 bans: dict[int, list[int]]) -> torch.Tensor:
    """`x` with `allowed_token_ids` and `bad_words` applied to `rows`: every token but the allowed ones, and
    every token the bad words ban now (`bans`: `bad_word_bans`'s), at -inf. `NothingToSampleError` if that (with
    what min_tokens holds back) leaves an allowed row nothing: its argmax would be any token, allowed or not.
    (Admission refuses a request that would be left nothing at its first token, `make_sequence`: only a bad word
    of several tokens, banning its last one after the others, leaves one nothing later.)"""
    dev, vocab = x.device, x.shape[-1]
    allowed = {i: _allowed(params[i]) for i in rows if params[i].allowed_token_ids is not None}
    if allowed:
        if max(a.top for a in allowed.values()) >= vocab:  # (as logit_bias: a CUDA index error is fatal)
            raise ValueError(f"allowed_token_ids: token ids must be in [0, {vocab}) (the model's vocabulary)")
        for i, a in allowed.items():
            gone = set(bans.get(i, ()))
            if counters[i] < params[i].min_tokens:
                gone.update(_held(params[i]).tolist())
            if len(gone) >= len(a) and gone.issuperset(a):
                raise NothingToSampleError(f"allowed_token_ids: bad_words"
                                           f"{' and min_tokens' if counters[i] < params[i].min_tokens else ''} "
                                           f"ban every one of them at output token {counters[i] + 1}: no token can "
                                           "be sampled")
        keep = torch.stack([a.keep(vocab, dev) for a in allowed.values()])
        idx = upload(list(allowed), dev)
        x = x.index_put((idx,), x[idx].masked_fill(~keep, float("-inf")))
    hits = [(i, t) for i, ts in bans.items() for t in ts]
    if hits:
        x = x.index_put((upload([i for i, _ in hits], dev), upload([t for _, t in hits], dev)),
                        torch.full((), float("-inf"), dtype=x.dtype, device=dev))
    return x


def _allowed(p: SamplingParams) -> AllowedTokenIds:
    ids = p.allowed_token_ids
    assert ids is not None
    return ids if isinstance(ids, AllowedTokenIds) else AllowedTokenIds(ids)


def _bitmask_words(mask: np.ndarray) -> np.ndarray:
    """A bitmask (int32 words as llguidance fills them, or bytes in little bit order) as uint32 words."""
    return mask.view(np.uint32)


def _any_below(words: np.ndarray, vocab: int) -> np.ndarray:
    """Whether each row of uint32 bitmask `words` [..., W] has a bit set for a token below `vocab`."""
    full, rem = divmod(vocab, 32)
    found = np.asarray(words[..., :full].any(-1))
    if rem and full < words.shape[-1]:
        found |= (words[..., full] & np.uint32((1 << rem) - 1)) != 0
    return found


def guided_room(p: SamplingParams, grammar: np.ndarray, vocab: int, counter: int, bans: list[int],
                held: np.ndarray | None) -> str | None:
    """Why a guided row has no token to sample at output token counter + 1, or None if it has one: `grammar` is
    the bitmask of the tokens its grammar allows there (int32 or uint32 words), `bans` the tokens its bad words
    ban then, `held` those min_tokens holds back (None: none), on top of its `allowed_token_ids` (the masks
    `adjust_logits` and `apply_guides` set to -inf; logit_bias, within +-100, and the penalties mask none). The reason
    names the grammar's field (`structured_outputs` or `guided_decoding`, as the params name it) and each other
    field that masks one of the tokens the grammar allows, the first of those (allowed_token_ids, bad_words,
    min_tokens) ahead as the field at fault (a server's `param`). O(words + banned ids) while a token is left; the
    names are worked out only when none is."""
    words = _bitmask_words(grammar)
    left = words
    if p.allowed_token_ids is not None:
        left = left & _allowed(p).packed(len(words))
    gone = np.asarray(bans, dtype=np.int64)
    if held is not None and len(held):
        gone = np.concatenate([gone, held.astype(np.int64, copy=False)])
    gone = gone[gone < min(vocab, len(words) * 32)]
    if len(gone):
        left = left.copy() if left is words else left
        np.bitwise_and.at(left, gone >> 5, ~(np.uint32(1) << (gone & 31).astype(np.uint32)))
    if _any_below(left, vocab):
        return None
    allows = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab])
    names = []
    if p.allowed_token_ids is not None and not np.isin(allows, _allowed(p).ids.numpy()).all():
        names.append("allowed_token_ids")
    if np.isin(allows, bans).any():
        names.append("bad_words")
    if held is not None and np.isin(allows, held).any():
        names.append("min_tokens")
    spec, field = p.grammar_spec, p.grammar_field
    kind = next((k for k in GUIDE_KINDS if getattr(spec, k, None) is not None),
                "json_object")
    at = f"at output token {counter + 1}"
    if not names:
        return f"{field}: the grammar ({kind}) allows no token of the model's vocabulary [0, {vocab}) {at}"
    fields = ", ".join([f"{field} ({kind})", *names[:-1]]) + f" and {names[-1]}"
    why = " (min_tokens holds back the end-of-sequence and stop tokens)" if "min_tokens" in names else ""
    return f"{names[0]}: {fields} leave no token to sample {at}{why}"


def first_token_room(p: SamplingParams) -> None:
    """ValueError (`guided_room`'s reason) if a guided request could sample no first token: the sampler's masks
    at output token 1 are exactly its grammar's first mask, its allowed_token_ids, its bad words of one token and,
    with min_tokens, its end-of-sequence and stop tokens, so this refuses a request only if its first token would
    fail it. `p`: a sample's params as its `Sequence` binds them (`make_sequence` checks a request's first sample:
    its samples share those masks). Later tokens are the sampler's (`NothingToSampleError`)."""
    guide = p.guide
    if guide is None:
        return
    words = p.bad_words
    bans = words.always if isinstance(words, BadWords) else []
    why = guided_room(p, guide.first, guide.vocab, 0, bans, _held(p).numpy() if p.min_tokens else None)
    if why is not None:
        raise ValueError(why)


def _check_guided(params: list[SamplingParams], counters: list[int], bans: dict[int, list[int]], vocab: int,
                  rows: list[int], masks: np.ndarray) -> None:
    """`apply_guides`' check of the guided rows' bitmasks `masks` (row j: rows[j]'s): `NothingToSampleError` for
    the first row that its grammar with its other masks (`bans`: `bad_word_bans`'s) leaves no token (its argmax,
    or its draw from an all-zero distribution, would be a token the grammar refuses: `sample_rows` then fails it
    alone). A row with no other mask is checked in one vectorized pass for the batch."""
    alone = _any_below(_bitmask_words(masks), vocab)
    for j, i in enumerate(rows):
        p = params[i]
        early = counters[i] < p.min_tokens
        if alone[j] and p.allowed_token_ids is None and not p.bad_words and not early:
            continue
        why = guided_room(p, masks[j], vocab, counters[i], bans.get(i, []), _held(p).numpy() if early else None)
        if why is not None:
            raise NothingToSampleError(why)


def adjust_logits(x: torch.Tensor, params: list[SamplingParams], counters: list[int],
                  bans: dict[int, list[int]] | None = None) -> torch.Tensor:
    """The `allowed_token_ids` and `bad_words` masks (first, as vLLM applies them; a -inf stays -inf whatever
    follows), `logit_bias`, the `min_tokens` mask and the penalties, on the rows that ask for them (`counters`:
    tokens generated so far); the other rows come back as they are, without a copy when none asks. `bans`:
    `bad_word_bans(params, counters)` where the caller has it already (None: worked out here)."""
    dev, vocab = x.device, x.shape[-1]
    masked = [i for i, p in enumerate(params) if p.allowed_token_ids is not None or p.bad_words]
    if masked:
        x = _mask_tokens(x, params, counters, masked, bad_word_bans(params, counters) if bans is None else bans)
    given = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
    if given:
        biases = [b if isinstance(b, LogitBias) else LogitBias(b) for _, b in given]
        if max(b.top for b in biases) >= vocab:  # checked here, not left to the device (a CUDA index error is fatal)
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab}) (the model's vocabulary)")
        which = torch.repeat_interleave(torch.tensor([i for i, _ in given]), torch.tensor([len(b) for b in biases]))
        x = x.index_put((upload(which, dev), upload(torch.cat([b.ids for b in biases]), dev)),
                        upload(torch.cat([b.biases for b in biases]), dev), accumulate=True)
    early = [i for i, p in enumerate(params) if counters[i] < p.min_tokens]
    if early:  # before min_tokens tokens, nothing that stops the request can be sampled
        held = [h[: int(torch.searchsorted(h, vocab))] for h in (_held(params[i]) for i in early)]  # (sorted)
        which = torch.repeat_interleave(torch.tensor(early), torch.tensor([len(h) for h in held]))
        if len(which):
            x = x.index_put((upload(which, dev), upload(torch.cat(held), dev)),
                            torch.full((), float("-inf"), dtype=torch.float64, device=dev))  # (a fill, no copy)
    pen = [i for i, p in enumerate(params) if p.penalized]
    if pen:
        ps, hist = [params[i] for i in pen], [_history(params[i]) for i in pen]
        counts = token_counts([h.output_ids[:counters[i]] for i, h in zip(pen, hist, strict=True)], vocab, dev)
        rep = in_prompt = None
        if any(p.repetition_penalty != 1 for p in ps):
            rep = upload([p.repetition_penalty for p in ps], dev, torch.float64)
            in_prompt = token_counts([h.prompt_ids for h in hist], vocab, dev) > 0
        presence = upload([p.presence_penalty for p in ps], dev, torch.float64)
        frequency = upload([p.frequency_penalty for p in ps], dev, torch.float64)
        idx = upload(pen, dev)
        x = x.index_put((idx,), penalize(x[idx], counts, in_prompt, presence, frequency, rep))
    return x


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """For rows asking for logprobs: the sampled token's logprob and rank in the raw distribution,
    and the top-k (ids, logprobs) in rank order. The rank counts the tokens whose logprob is at least the
    token's own (vLLM V1's `batched_count_greater_than`): a token tied with others takes the last of their ranks,
    which bfloat16 logits make common."""
    lp = torch.log_softmax(logits, -1)
    chosen = lp.gather(1, tokens[:, None])[:, 0]
    out = {"lp_chosen": chosen, "lp_rank": (lp >= chosen[:, None]).sum(-1)}
    if k > 0:
        out["lp_top_vals"], out["lp_top_ids"] = _top_k_ties_by_id(lp, min(k, lp.shape[-1]))
    return out


def _top_k_ties_by_id(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of `x` [R, V] and their ids, largest first, equal values by lowest id (as
    `argmax_rows` breaks ties), so that which of tied tokens a row reports does not depend on its batch: `topk`
    leaves ties in any order, and a grammar's row, its disallowed tokens all -inf, reported other -inf tokens
    batched than alone. The multiset of the k values is `topk`'s; the tied ones at the k-th value are taken
    lowest ids first."""
    t = x.topk(k, -1).values[:, -1:]  # the k-th largest value of each row
    above, at = x > t, x == t  # (fewer than k above it; at least k at or above it)
    take = above | (at & (at.cumsum(-1) <= k - above.sum(-1, keepdim=True)))  # k per row
    ids = take.nonzero()[:, 1].view(-1, k)  # (ascending ids)
    vals = x.gather(1, ids)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices  # (stable: ascending ids kept on ties)
    return vals.gather(1, order), ids.gather(1, order)


def finite_rows(x: torch.Tensor) -> torch.Tensor:
    """[B] bool: row i of `x` [B, V] holds no NaN or infinity. On a device, read off one matrix-vector product:
    the sum of the row's values each scaled by 2^-k, where 2^k >= 2V. A power of two keeps NaN and
    infinities as they are and brings the sum of V finite values under half the dtype's largest value, so
    in any order of summation it cannot overflow: the sum is finite exactly when the row is. One vectorized
    pass, no [B, V] temporary: on this CPU, float32 [256, 49152] takes 2.0 ms, where a float64 sum per
    row took 51 ms and an `amax` with an `amin` 3.6 ms (docs/benchmarks.md section 8.11). On the CPU, in
    float32 or float64, one compiled pass (`_finite_pass`) instead: numpy's product went to OpenBLAS, whose
    worker thread then spun on another core for milliseconds after each call (a core taken from the
    server, and several ms of CPU counted in a tick), and it cost 5 us at [77, 512] float32 against 14
    (docs/benchmarks.md section 8.49)."""
    if _numpy_can(x):
        a = x.numpy()
        out = np.empty(a.shape[0], np.bool_)
        _finite_pass(a, out)
        return torch.from_numpy(out)
    return torch.isfinite(x @ _finite_probe(x.shape[-1], x.dtype, x.device))


@kernel
def _finite_pass(x: np.ndarray, out: np.ndarray) -> None:
    """out[i]: row i of `x` is finite. v - v is 0 for a finite v and NaN for NaN or an infinity, so a row's
    sum of them is 0 exactly when the row is finite (whatever order the vectorized sum takes)."""
    zero = np.zeros(1, x.dtype)[0]  # (of the rows' dtype: a float64 zero would widen every term)
    for i in range(x.shape[0]):
        row, total = x[i], zero
        for j in range(row.shape[0]):
            total += row[j] - row[j]
        out[i] = total == 0


@functools.lru_cache(maxsize=16)
def _finite_probe(vocab: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`finite_rows`' vector: 2^-k in every entry, 2^k >= 2 * vocab."""
    return torch.full((vocab,), 2.0 ** -(math.ceil(math.log2(vocab)) + 1), dtype=dtype, device=device)


def _raw64(logits: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """The logits as a float64 copy of their own, a non-finite row (flagged in `finite`, never sampled from)
    zeroed in place. (Finiteness is read on the narrower logits and the row zeroed in the copy: on a
    1,900 x 49,152 prompt-logprobs batch that took 2.5 s instead of 3.7 s, against an `isfinite` mask and a
    second copy.)"""
    x = logits.detach().to(torch.float64, copy=True)
    return x.masked_fill_(~finite[:, None], 0.0)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """[B] int64: the index of each row's largest value in `x` [B, V], the first one on ties (the rule of
    torch and of numpy alike). On the CPU, in float32 or float64, by numpy: one thread of torch's argmax
    is 5-17x slower there (float32 [82, 512]: 34 us against 6 us; [256, 49152]: 8.6 ms against 1.7 ms;
    docs/benchmarks.md section 8.13)."""
    if _numpy_can(x):
        return torch.from_numpy(x.numpy().argmax(-1))
    return x.argmax(-1)


_NUMPY_FLOATS = (torch.float32, torch.float64)


def _numpy_can(x: torch.Tensor) -> bool:
    """Whether numpy can read `x` in place: on the CPU, in float32 or float64. (`is_cpu`: `device` makes an
    object each read.)"""
    return x.is_cpu and x.dtype in _NUMPY_FLOATS


GREEDY = SamplingParams(temperature=0.0)  # a plain greedy row's params, for a batch known to be all such rows


def plain_greedy(p: SamplingParams) -> bool:
    """Sampled by the argmax of the raw logits: nothing adjusts, masks or reports them."""
    return (p.greedy and p.logprobs is None and not p.logit_bias and not p.min_tokens and not p.penalized
            and p.guide is None and p.allowed_token_ids is None and not p.bad_words)


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                 counters: list[int], plain: bool | None = None) -> dict[str, torch.Tensor]:
    """Sample every row of `logits` [B, V] (any float dtype, on any device); the result stays on that
    device for one readback: "tokens" [B], "finite" [B] and, for the rows with `logprobs` set (in
    order), "lp_chosen", "lp_rank" and "lp_top_ids" / "lp_top_vals" [R, max k]. `plain`: whether every
    row is `plain_greedy`, if the caller knows (None: read off `params`)."""
    dev = logits.device
    values = logits.detach()
    finite = finite_rows(values)
    if plain is None:
        plain = all(plain_greedy(p) for p in params)
    if plain:  # the common case: one argmax, no float64 copy of the logits
        return {"tokens": argmax_rows(values), "finite": finite}  # (the order of values is the same)
    raw = _raw64(logits, finite)
    bans = bad_word_bans(params, counters)  # (read by the bad-words mask and by a guided row's check)
    # structured output: each guided row's grammar mask (engine/grammar.py), refused for a row it leaves no token;
    # on the model's distribution itself, as vLLM applies the grammar's bitmask to the logits before its sampler (a
    # guided row's logprobs are of the tokens its grammar allows)
    raw = apply_guides(raw, params, functools.partial(_check_guided, params, counters, bans, raw.shape[-1]))
    x = adjust_logits(raw, params, counters, bans)
    rand = [i for i, p in enumerate(params) if not p.greedy]
    every = bool(rand) and len(rand) == len(params)  # (then no row takes the argmax, none is copied out)
    tokens = None if every else argmax_rows(x)
    if rand:
        ps = [params[i] for i in rand]
        vocab = x.shape[-1]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in ps]
        filters = (max((k for k in top_k if k < vocab), default=0), any(p.top_p < 1 for p in ps),
                   any(p.min_p > 0 for p in ps))
        # the rows' values in two uploads, their uniforms drawn on the host (on a GPU each upload and each op of
        # the draw is a launch from the host: seven uploads and a dozen ops became two uploads)
        drawn = uniforms(np.array([seeds[i] for i in rand], np.int64), np.array([counters[i] for i in rand], np.int64))
        idx, k = upload([rand, top_k], dev).unbind(0)
        temperature, top_p, min_p, u = upload(
            np.stack([[p.temperature for p in ps], [p.top_p for p in ps], [p.min_p for p in ps], drawn]), dev,
            torch.float64).unbind(0)
        probs = filtered_probs(x if every else x[idx], temperature, k, top_p, min_p, filters)
        cdf = probs.cumsum(-1)
        draw = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=vocab - 1)
        tokens = draw if tokens is None else tokens.index_put((idx,), draw)
        # a row whose adjusted logits lost finiteness (no finite total to draw against) is never taken: a NaN
        # total would draw the last token (no host sync: the flag goes back with the tokens)
        total = cdf[:, -1]
        finite = finite.index_put((idx,), finite[idx] & torch.isfinite(total) & (total > 0))
    assert tokens is not None
    out = {"tokens": tokens, "finite": finite}
    asked = [i for i, p in enumerate(params) if p.logprobs is not None]
    if asked:
        idx = upload(asked, dev)
        out.update(top_logprobs(raw[idx], tokens[idx], max(params[i].logprobs or 0 for i in asked)))
    return out


@dataclass(slots=True)
class Sample:
    """One row's sampling result on the host (slots: one is made per sampled token)."""

    token: int
    finite: bool
    logprob: float | None = None  # the sampled token's, when logprobs were asked for
    rank: int | None = None
    top: list[tuple[int, float]] | None = None  # (token id, logprob) in rank order, k of them
    error: str | None = None  # sampling this row raised (see `sample_rows`)
    cause: Exception | None = None  # what it raised

    def checked(self) -> Sample:
        if self.error is not None:
            if isinstance(self.cause, REQUEST_ERRORS):  # the request's own failure, as raised (its status)
                raise self.cause
            raise RuntimeError(self.error)
        if not self.finite:
            raise NonFiniteError("the model produced non-finite logits for this request")
        return self


class SampledBatch:
    """A batch's samples on the host. Every row's token and whether it may be taken (its logits were
    finite and it was sampled without error) are arrays, read for the whole batch at once; a row's
    `Sample` (with its logprobs, or its error) is made only for a row that asks for it, so a batch whose
    rows need nothing but their token makes no Python object per row."""

    def __init__(self, host: dict[str, torch.Tensor] | None, params: list[SamplingParams],
                 rows: list[Sample] | None = None) -> None:
        """`sample_batch`'s host result (`params`: the rows', or none if no row asked for logprobs), or
        the `Sample`s of `sample_rows`' row-by-row fallback (`rows`)."""
        self._rows = rows
        if rows is not None:
            self.tokens = np.array([s.token for s in rows], np.int64)
            self.ok = np.array([s.finite and s.error is None for s in rows], bool)
            return
        assert host is not None
        self.tokens, self.ok = host["tokens"].numpy(), host["finite"].numpy()
        self._host, self._params = host, params
        self._asked = {i: a for a, i in enumerate(i for i, p in enumerate(params) if p.logprobs is not None)}
        self._lists: tuple[list, list, list | None, list | None] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, j: int) -> Sample:
        if self._rows is not None:
            return self._rows[j]
        sample = Sample(int(self.tokens[j]), bool(self.ok[j]))
        a = self._asked.get(j)
        if a is not None:
            if self._lists is None:
                self._lists = _logprob_lists(self._host)
            _fill_logprob(sample, self._lists, a, self._params[j].logprobs or 0)
        return sample

    def __iter__(self) -> Iterator[Sample]:
        return map(self.__getitem__, range(len(self)))


def unpack(host: dict[str, torch.Tensor], params: list[SamplingParams]) -> list[Sample]:
    """The host copy of `sample_batch`'s result as one `Sample` per row (`params`: the rows', or none if
    no row asked for logprobs)."""
    return list(SampledBatch(host, params))


def _logprob_lists(host: dict[str, torch.Tensor]) -> tuple[list, list, list | None, list | None]:
    """`top_logprobs`' host result as lists: chosen, ranks, top ids and top values (None: k = 0)."""
    ids = host["lp_top_ids"].tolist() if "lp_top_ids" in host else None
    vals = host["lp_top_vals"].tolist() if "lp_top_vals" in host else None
    return host["lp_chosen"].tolist(), host["lp_rank"].tolist(), ids, vals


def _fill_logprob(s: Sample, lists: tuple[list, list, list | None, list | None], j: int, k: int) -> None:
    """Give `s` row j of `top_logprobs`' result (`_logprob_lists`), keeping its top k."""
    chosen, ranks, ids, vals = lists
    s.logprob, s.rank = chosen[j], ranks[j]
    s.top = list(zip(ids[j][:k], vals[j][:k], strict=True)) if ids is not None and vals is not None else []


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Logprobs of prompt tokens: row i of `logits` [R, V] scores `targets[i]` (the prompt token after
    the row's position). The raw distribution, in float64, row-wise like the sampler; stays on the
    device for one readback ("tokens", "finite" and `top_logprobs`' fields, top `k`)."""
    finite = finite_rows(logits.detach())
    return {"tokens": targets, "finite": finite, **top_logprobs(_raw64(logits, finite), targets, k)}


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                counters: list[int], plain: bool | None = None) -> dict[str, torch.Tensor] | list[Sample]:
    """`sample_batch`, or if it raises, row by row on the host: a row that raises alone gets a
    `Sample` with its error, the others exactly what the batched call would have given them."""
    try:
        return sample_batch(logits, params, seeds, counters, plain)
    except Exception:
        rows: list[Sample] = []
        for i in range(logits.shape[0]):
            try:
                rows.append(sample_one(logits[i], params[i], seeds[i], counters[i]))
            except Exception as e:
                rows.append(Sample(0, True, error=f"{type(e).__name__}: {e}", cause=e))
        return rows


def sample_one(logits: torch.Tensor, p: SamplingParams, seed: int, counter: int) -> Sample:
    """One row (the reference decoder): the same computation as a batch of one."""
    return unpack({k: v.cpu() for k, v in sample_batch(logits[None], [p], [seed], [counter]).items()}, [p])[0]
