"""vLLM's parameter types as vLLM scripts use them: numpy numbers in SamplingParams (np.arange / np.linspace sweeps;
arrays of any shape, a 2-d one refused naming its field), `SamplingParams.clone`, GuidedDecodingParams /
StructuredOutputsParams' other fields (backend, disable_fallback, disable_additional_properties, structural_tag),
and the prompt types `TextPrompt` / `TokensPrompt` (multimodal keys refused, never ignored, whatever their value's
type)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from loopserve import (
    LLM,
    GuidedDecodingParams,
    SamplingParams,
    StructuredOutputsParams,
    TextPrompt,
    TokensPrompt,
)
from loopserve.engine.grammar import new_guide
from loopserve.engine.sequence import parse_prompt
from loopserve.models.loader import load_model

pytestmark = pytest.mark.timeout(120)


# -- numpy numbers -------------------------------------------------------------------------------------------------
def test_numpy_numbers_are_taken_as_the_python_numbers_they_hold():
    p = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), top_p=np.float64(0.9), top_k=np.int32(3),
                       max_tokens=np.int64(5), seed=np.uint64(2**64 - 1), ignore_eos=np.True_,
                       stop_token_ids=[np.int64(3), 4], allowed_token_ids=np.arange(5, 0, -1),
                       logit_bias={np.int64(4): np.float32(1.5)}, exit_trace=np.array([1, 2]), min_loops=np.int8(1))
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed, p.ignore_eos) == (
        2, 0.5, 0.9, 3, 5, 2**64 - 1, True)
    assert p.stop_token_ids == [3, 4] and p.allowed_token_ids == [1, 2, 3, 4, 5] and p.exit_trace == [1, 2]
    assert p.logit_bias == {4: 1.5} and p.min_loops == 1
    # plain Python values come out, not numpy ones (they are compared, hashed, put in JSON as such)
    for value in (p.n, p.temperature, p.top_k, p.max_tokens, p.seed, *p.stop_token_ids, *p.allowed_token_ids,
                  *p.logit_bias, *p.logit_bias.values(), *p.exit_trace):
        assert type(value) in (int, float), value
    assert type(p.ignore_eos) is bool
    json.dumps(p.logit_bias)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": np.float32(-0.5)}, "temperature"),
    ({"max_tokens": np.int64(0)}, "max_tokens"),
    ({"ignore_eos": np.int64(1)}, "ignore_eos"),  # (an integer is not a boolean, numpy's or not)
    ({"n": np.float64(2.0)}, "n"),
    ({"stop_token_ids": [np.int64(-1)]}, "stop_token_ids"),
])
def test_bad_numpy_numbers_are_named_with_their_value(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("field", ["stop_token_ids", "allowed_token_ids"])
def test_a_two_dimensional_array_is_refused_naming_its_field(field):
    """Every array becomes a list, so a 2-d one is a nested list the checks refuse by name (not numpy's "truth
    value of an array is ambiguous")."""
    with pytest.raises(ValueError, match=rf"^{field}: .*\[\[1, 2\], \[3, 4\]\]"):
        SamplingParams(**{field: np.array([[1, 2], [3, 4]])})
    with pytest.raises(ValueError, match=rf"^{field}: "):
        SamplingParams(**{field: [np.array([1, 2])]})  # (an array inside the list: not a token id either)
    assert getattr(SamplingParams(**{field: np.array([4, 2])}), field) in ([4, 2], [2, 4])


def test_a_numpy_sweep_runs_like_its_python_twin(tiny_ouro):
    llm = LLM(tiny_ouro, scheduler="cdb", dtype="float32", device="cpu")
    for t in np.linspace(0.0, 1.0, 3):
        as_numpy = SamplingParams(temperature=t, max_tokens=np.int64(4), seed=np.int64(7), ignore_eos=True)
        as_python = SamplingParams(temperature=float(t), max_tokens=4, seed=7, ignore_eos=True)
        a, b = (llm.generate("ROMEO:", p, use_tqdm=False)[0].outputs[0].token_ids for p in (as_numpy, as_python))
        assert a == b and len(a) == 4


# -- clone ---------------------------------------------------------------------------------------------------------
def test_clone_is_deep_and_leaves_the_engines_state_behind():
    p = SamplingParams(stop=["x"], stop_token_ids=[1], logit_bias={2: 1.0}, allowed_token_ids=[3, 4], seed=5,
                       structured_outputs={"choice": ["a", "b"]})
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y")
    q.stop_token_ids.append(9)
    q.logit_bias[7] = 2.0
    q.allowed_token_ids.append(8)
    assert p.stop == ["x"] and p.stop_token_ids == [1] and p.logit_bias == {2: 1.0} and p.allowed_token_ids == [3, 4]
    assert q.grammar_spec == p.grammar_spec and q.grammar_spec is not p.grammar_spec
    p.guide, p.history = object(), object()  # (what the engine sets on a request's own copy)
    r = p.clone()
    assert r.guide is None and r.history is None


# -- structured outputs: vLLM's other fields -------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_backend_names_that_mean_llguidance_are_taken_others_refused():
    for backend in (None, "auto", "guidance"):
        assert GuidedDecodingParams(choice=["x"], backend=backend).backend == backend
    for backend in ("xgrammar", "outlines", "lm-format-enforcer", 1):
        with pytest.raises(ValueError, match=r"^backend: loopserve compiles every grammar with llguidance"):
            StructuredOutputsParams(choice=["x"], backend=backend)
    with pytest.raises(ValueError, match=r"^structured_outputs\.backend: "):
        SamplingParams(structured_outputs={"choice": ["x"], "backend": "xgrammar"})


def test_structural_tag_is_refused_and_disable_fallback_taken():
    with pytest.raises(ValueError, match=r"^structural_tag: not supported"):
        GuidedDecodingParams(choice=["x"], structural_tag='{"structures": []}')
    assert GuidedDecodingParams(choice=["x"], disable_fallback=True).disable_fallback is True
    with pytest.raises(ValueError, match=r"^disable_fallback: must be true or false"):
        GuidedDecodingParams(choice=["x"], disable_fallback="yes")


def test_disable_additional_properties_closes_every_schema_with_properties_that_does_not_say():
    """vLLM's rule (backend_guidance `_walk_json_for_additional_properties`): a schema that lists `properties` or
    `patternProperties` and does not set `additionalProperties` is closed, whatever its `type`; a free-form
    `{"type": "object"}` stays open."""
    schema = {"type": "object", "properties": {
        "type": {"type": "object", "properties": {"properties": {"type": "object"}}},  # (names, not keywords)
        "list": {"type": "array", "items": {"properties": {"x": {"type": "integer"}}}},  # (no type: closed)
        "either": {"anyOf": [{"type": ["object", "null"], "properties": {"y": {}}}, {"type": "integer"}]},
        "free": {"type": "object"},  # (no properties: open)
        "pattern": {"type": "object", "patternProperties": {"^a": {"type": "integer"}}},
        "open": {"type": "object", "properties": {"z": {}}, "additionalProperties": True}},
        "$defs": {"d": {"type": "object", "properties": {"w": {"type": "string"}}}, "e": {"type": "object"}}}
    spec = GuidedDecodingParams(json=schema, disable_additional_properties=True)
    got = spec.json
    props = got["properties"]
    assert got["additionalProperties"] is False
    assert props["type"]["additionalProperties"] is False
    assert "additionalProperties" not in props["type"]["properties"]  # (a property named so: untouched)
    assert "additionalProperties" not in props["type"]["properties"]["properties"]  # (free-form: open)
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in props["either"]["anyOf"][1]
    assert "additionalProperties" not in props["free"]
    assert props["pattern"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True  # (said otherwise: kept)
    assert got["$defs"]["d"]["additionalProperties"] is False and "additionalProperties" not in got["$defs"]["e"]
    assert "additionalProperties" not in schema and "additionalProperties" not in schema["properties"]["type"]
    as_text = GuidedDecodingParams(json=json.dumps(schema), disable_additional_properties=True)
    assert json.loads(as_text.json) == got
    assert GuidedDecodingParams(json=schema, backend="guidance").json == schema  # (off: the schema as given)
    free = {"type": "object"}
    assert GuidedDecodingParams(json=free, disable_additional_properties=True).json == free


def test_the_default_backend_leaves_composed_objects_open():
    """A schema composed with allOf (or anyOf / oneOf beside properties of its own) describes one object in several
    schemas, each listing some of its properties: closing each (`additionalProperties` sees only its own schema's)
    refused the others' properties, so `{"a": 1, "b": 2}` was refused (only `{}` admitted), and an allOf of two
    required properties was an unsatisfiable schema. Nested objects are still closed."""
    composed = {"type": "object", "properties": {"a": {"type": "integer"}, "inner": {"properties": {"x": {}}}},
                "allOf": [{"properties": {"b": {"type": "integer"}}}],
                "anyOf": [{"properties": {"c": {}}}, {"properties": {"d": {}}}]}
    got = GuidedDecodingParams(json=composed).json
    assert "additionalProperties" not in got
    assert all("additionalProperties" not in x for x in (*got["allOf"], *got["anyOf"]))
    assert got["properties"]["inner"]["additionalProperties"] is False
    alternatives = {"oneOf": [{"type": "object", "properties": {"a": {}}}, {"type": "integer"}]}  # (whole objects)
    assert GuidedDecodingParams(json=alternatives).json["oneOf"][0]["additionalProperties"] is False
    both = {"allOf": [{"type": "object", "properties": {"a": {}}, "required": ["a"]},
                      {"type": "object", "properties": {"b": {}}, "required": ["b"]}]}
    assert GuidedDecodingParams(json=both).json == both  # (compiles: it was "Unsatisfiable schema")


@pytest.mark.parametrize("backend", [None, "auto"])
def test_the_default_backend_closes_objects_and_tuples_as_vllms_default(backend):
    """vLLM's "auto" compiles a JSON schema with xgrammar, whose strict mode (its default) admits no property an
    object does not list and no item past a tuple's `prefixItems`: so does loopserve's default, whatever
    disable_additional_properties says (a migrated script got `{"a": -2, " speak...": ...}` to max_tokens where vLLM
    closed the object); "guidance" keeps llguidance's rule, as vLLM's guidance backend does."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "pair": {
        "type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}, "free": {"type": "object"}}}
    got = GuidedDecodingParams(json=schema, backend=backend).json
    assert got["additionalProperties"] is False and got["properties"]["pair"]["items"] is False
    assert "additionalProperties" not in got["properties"]["free"]
    assert GuidedDecodingParams(json=schema, backend="guidance").json == schema
    tuples_kept = GuidedDecodingParams(json=schema, backend="guidance", disable_additional_properties=True).json
    assert tuples_kept["additionalProperties"] is False and "items" not in tuples_kept["properties"]["pair"]
    said = {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"},
            "allOf": [{"prefixItems": [{}], "items": {"type": "integer"}}]}
    assert GuidedDecodingParams(json=said, backend=backend).json == said  # (what a schema says is kept)


def _accepts(spec: GuidedDecodingParams, text: str, tiny_ouro) -> bool:
    loaded = load_model(tiny_ouro, "float32", "cpu")
    guide = new_guide(spec, loaded.tokenizer, loaded.config.vocab_size)
    try:
        for token in loaded.tokenizer.encode(text, add_special_tokens=False):
            guide.advance(token)
    except ValueError:
        return False
    return True


def test_disable_additional_properties_changes_what_the_grammar_admits(tiny_ouro):
    extra = '{"a": 1, "b": 2}'
    assert _accepts(GuidedDecodingParams(json=SCHEMA, backend="guidance"), extra, tiny_ouro)
    for closed in (GuidedDecodingParams(json=SCHEMA, backend="guidance", disable_additional_properties=True),
                   GuidedDecodingParams(json=SCHEMA)):  # (the default backend's rule: vLLM's xgrammar)
        assert not _accepts(closed, extra, tiny_ouro)
        assert _accepts(closed, '{"a": 1}', tiny_ouro)


# -- prompt types ----------------------------------------------------------------------------------------------------
def test_text_and_tokens_prompts_run_as_their_plain_forms(tiny_ouro):
    llm = LLM(tiny_ouro, scheduler="cdb", dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    ids = llm.get_tokenizer().encode("ROMEO:")
    outs = llm.generate([TextPrompt(prompt="ROMEO:"), TokensPrompt(prompt_token_ids=ids), "ROMEO:"], params,
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert outs[1].prompt is None and outs[0].prompt == "ROMEO:"


@pytest.mark.parametrize("key", ["multi_modal_data", "mm_processor_kwargs", "prompt_embeds", "multi_modal_uuids"])
def test_multimodal_prompt_keys_are_refused_not_ignored(tiny_ouro, key):
    llm = LLM(tiny_ouro, scheduler="reference", dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=rf"^{key}: not supported"):
        llm.generate({"prompt": "ROMEO:", key: {"image": 1}}, use_tqdm=False)
    llm.generate({"prompt": "ROMEO:", key: None}, SamplingParams(max_tokens=1), use_tqdm=False)  # (unset: fine)
    llm.generate({"prompt": "ROMEO:", key: {}}, SamplingParams(max_tokens=1), use_tqdm=False)  # (empty: unset)


@pytest.mark.parametrize("key, value", [
    ("prompt_embeds", torch.zeros(3, 8)), ("prompt_embeds", torch.ones(1)), ("multi_modal_data", np.zeros((2, 2))),
    ("multi_modal_data", np.array([1])),
])
def test_an_array_or_tensor_under_a_multimodal_key_is_refused_naming_it(key, value):
    """Set means not None (nor an empty dict, list or tuple), never the value's truth value: a tensor or an
    array (which has none, or an ambiguous one) is refused naming its key."""
    for prompt in ({"prompt": "ROMEO:", key: value}, {"prompt_token_ids": [1, 2], key: value}):
        with pytest.raises(ValueError, match=rf"^{key}: not supported"):
            parse_prompt(prompt, None)


def test_a_prompts_cache_salt_keeps_its_prefix_cache_entries_apart(tiny_ouro):
    llm = LLM(tiny_ouro, scheduler="cdb", dtype="float32", device="cpu", enable_prefix_caching=True, block_size=16)
    ids = list(range(5, 75))
    params = SamplingParams(max_tokens=1)

    def cached(prompt) -> int:
        return llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens

    assert cached(TokensPrompt(prompt_token_ids=ids, cache_salt="a")) == 0
    assert cached(TokensPrompt(prompt_token_ids=ids, cache_salt="a")) == 64  # (its 4 full blocks)
    assert cached(TokensPrompt(prompt_token_ids=ids, cache_salt="b")) == 0
    assert cached(TokensPrompt(prompt_token_ids=ids)) == 0
    assert cached(ids) == 64
    text = llm.get_tokenizer().decode(ids)
    assert cached(TextPrompt(prompt=text, cache_salt="c")) == 0
    for salt in ("", 5):
        with pytest.raises(ValueError, match=r"^cache_salt: must be a non-empty string"):
            llm.generate({"prompt_token_ids": ids, "cache_salt": salt}, params, use_tqdm=False)
