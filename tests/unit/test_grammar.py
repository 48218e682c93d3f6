"""Grammar-constrained sampling (worker_svc/layers/grammar.py, common/constraint.py) on the tiny tokenizer.

Outputs are drawn from random logits under the masks, so the grammar alone makes them valid: if a
mask let one wrong token through, some of the hundreds of draws here would take it. Constrained
rows share each batch with free rows, as in the worker.
"""
from __future__ import annotations

import ast
import json
import re

import jsonschema
import pytest
import torch

from common.constraint import Constraint, GrammarError, enforceable_schema, to_grammar
from scheduler_svc.frontend.tokenizer import load_tokenizer
from tests.support.constraint_cases import ARITHMETIC, REGEXES, random_schemas, whitespace_run
from worker_svc.layers.grammar import GrammarBitmask, GrammarCompiler, apply_bitmask
from tests.support.markers import requires_cuda

VOCAB_SIZE = 512
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def stop_ids(tiny_model_dir) -> list[int]:
    return json.loads((tiny_model_dir / "generation_config.json").read_text())["eos_token_id"]


@pytest.fixture(scope="module")
def compiler(tiny_model_dir, stop_ids) -> GrammarCompiler:
    return GrammarCompiler.from_model_dir(tiny_model_dir, VOCAB_SIZE, stop_ids)


def allowed_ids(bitmask_row: torch.Tensor) -> set[int]:
    bits = (bitmask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.flatten().nonzero().flatten().tolist())


def sample_batch(compiler, constraints, *, seed: int, greedy: bool, free_rows: int = 2,
                 max_tokens: int = MAX_TOKENS, bias: torch.Tensor | None = None) -> list[tuple[list[int], bool]]:
    """Decodes all constraints together, interleaved with `free_rows` unconstrained rows, from random
    logits (plus `bias`, a [vocab] tensor); returns each constraint's (output ids without the stop
    token, whether it stopped)."""
    generator = torch.Generator().manual_seed(seed)
    matchers = [compiler.matcher(c) for c in constraints]
    rows = [free_rows + i for i in range(len(constraints))]   # free rows come first in the batch
    outputs: list[list[int]] = [[] for _ in constraints]
    done = [False] * len(constraints)
    bitmask = GrammarBitmask(VOCAB_SIZE)
    for _ in range(max_tokens):
        live = [i for i in range(len(constraints)) if not done[i]]
        if not live:
            break
        logits = torch.randn(free_rows + len(constraints), VOCAB_SIZE, generator=generator) * 4
        if bias is not None:
            logits += bias
        apply_bitmask(logits, [rows[i] for i in live], bitmask.fill([matchers[i] for i in live]))
        if greedy:
            tokens = logits.argmax(-1)
        else:
            tokens = torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)
        for i in live:
            token = int(tokens[rows[i]])
            assert matchers[i].accept_token(token), f"token {token} was allowed by the mask, then refused"
            if token in compiler.stop_token_ids:
                done[i] = True
            else:
                outputs[i].append(token)
    return list(zip(outputs, done))


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_thirty_random_schemas_give_strict_json_that_validates(compiler, tokenizer, greedy):
    schemas = random_schemas(seed=17, count=30)
    results = sample_batch(compiler, [Constraint("json_schema", json.dumps(s)) for s in schemas],
                           seed=1 + greedy, greedy=greedy)
    for schema, (ids, stopped) in zip(schemas, results):
        text = tokenizer.decode(ids)
        assert stopped, f"no stop within {MAX_TOKENS} tokens: {text!r}"
        value = json.loads(text)   # strict: a raw control character in a string fails here
        jsonschema.validate(value, schema, cls=jsonschema.Draft202012Validator)
        assert whitespace_run(text) == 0, f"not compact: {text!r}"


def test_json_object_gives_a_compact_object(compiler, tokenizer):
    # Free-form keys and strings end when a random model picks '"' among ~500 tokens: favour the
    # closing tokens so that outputs end; the mask alone still decides what is valid.
    bias = torch.zeros(VOCAB_SIZE)
    bias[[tokenizer.encode(t)[0] for t in ('"', "}", "]", "1")]] = 8.0
    for ids, stopped in sample_batch(compiler, [Constraint("json_object")] * 6, seed=3, greedy=False, bias=bias):
        text = tokenizer.decode(ids)
        assert stopped and isinstance(json.loads(text), dict) and whitespace_run(text) == 0, text


def test_twenty_regexes_fullmatch(compiler, tokenizer):
    assert len(REGEXES) == 20
    for greedy in (True, False):
        results = sample_batch(compiler, [Constraint("regex", r) for r in REGEXES], seed=5, greedy=greedy)
        for regex, (ids, stopped) in zip(REGEXES, results):
            text = tokenizer.decode(ids)
            assert stopped and re.fullmatch(regex, text, flags=re.ASCII), (regex, text)


def test_ebnf_grammar_gives_arithmetic_expressions(compiler, tokenizer):
    results = sample_batch(compiler, [Constraint("grammar", ARITHMETIC)] * 8, seed=7, greedy=False)
    for ids, stopped in results:
        text = tokenizer.decode(ids)
        assert stopped and re.fullmatch(r"[0-9+\-*/()]+", text), text
        tree = ast.parse(text, mode="eval")   # a syntax error here is a grammar violation
        assert all(isinstance(node, (ast.Expression, ast.BinOp, ast.Constant, ast.operator)) for node in ast.walk(tree))


@pytest.mark.parametrize("constraint, message", [
    (("json_schema", '{"type": '), "invalid json_schema: not valid JSON"),
    (("json_schema", '{"type": "foo"}'), 'invalid json_schema: Unsupported type "foo"'),
    (("json_schema", '{"type": "string", "minLength": 5, "maxLength": 2}'), "minLength 5 is greater than maxLength 2"),
    (("json_schema", "[1, 2]"), "invalid json_schema: Schema should be an object or bool"),
    (("regex", "(ab"), "invalid regex: Regex parsing error at position 4: The parenthesis is not closed"),
    (("regex", "a{3,1}"), "invalid regex: "),
    (("grammar", 'root ::= "a" |'), "invalid grammar: EBNF parser error at line 1"),
    (("grammar", "root ::= undefined_rule"), 'Rule "undefined_rule" is not defined'),
    (("grammar", 'start ::= "a"'), 'The root rule with name "root" is not found'),
    (("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}'), "invalid structural_tag: "),
    (("regex", "   "), "invalid regex: empty"),
    (("json_schema", '{"type": "object", "properties": {"not": {"if": {}}}}'),
     "'if' at #/properties/not is not supported"),
    (("structural_tag", json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<f>", "end": "</f>",
        "content": {"type": "json_schema", "json_schema": {"type": "array", "contains": {"const": 1}}}}})),
     "invalid structural_tag: 'contains' at # is not supported"),
    (("xml", "<a/>"), "invalid constraint: unknown kind 'xml'"),
    (("grammar", "root ::= root"), "invalid grammar: it matches no output"),
    (("regex", "[^\\x00-\\U0010ffff]"), "invalid regex: it matches no output"),
])
def test_bad_constraints_raise_a_grammar_error_naming_the_problem(compiler, constraint, message):
    with pytest.raises(GrammarError) as caught:
        compiler.compile(Constraint(*constraint))
    assert message in str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert not str(caught.value).startswith("[")   # xgrammar's "[time] file.cc:line:" prefix is gone


@pytest.mark.parametrize("grammar", ['root ::= ""', 'root ::= "a" root', 'root ::= "a" | root'])
def test_a_grammar_that_matches_something_compiles_even_the_empty_string_or_an_endless_one(compiler, grammar):
    compiler.compile(Constraint("grammar", grammar))


@pytest.mark.parametrize("schema", [
    {"type": "object", "required": ["a"]},
    {"anyOf": [{"type": "object", "required": ["z"]}, {"type": "null"}]},
])
def test_a_required_property_the_schema_does_not_declare_is_written(compiler, tokenizer, schema):
    """Strict objects write only declared properties: a required one is declared for the grammar."""
    outputs = sample_batch(compiler, [Constraint("json_schema", json.dumps(schema))] * 4, seed=3, greedy=False)
    for ids, stopped in outputs:
        assert stopped
        jsonschema.validate(json.loads(tokenizer.decode(ids)), schema, cls=jsonschema.Draft202012Validator)


def test_a_problem_quoting_a_huge_constraint_is_cut(compiler):
    """A status message travels in HTTP/2 trailers: 16 KiB at most."""
    schema = '{"type": "number", "description": "' + "d" * 100_000 + '", "minimum": NaN}'
    with pytest.raises(GrammarError, match="not valid JSON: NaN is not a JSON number"):
        compiler.compile(Constraint("json_schema", schema))
    problem = "Failed to parse JSON. The JSON string is:" + schema      # as xgrammar words it
    assert len(GrammarError("json_schema", problem).problem) < 1100


def test_an_undeclared_required_property_takes_additional_properties_schema():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["a", "b"],
              "additionalProperties": {"type": "string"}, "$defs": {"d": {"type": "object", "required": ["c"]}}}
    assert enforceable_schema(schema) == {**schema, "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
                                          "$defs": {"d": {"type": "object", "required": ["c"],
                                                          "properties": {"c": {}}}}}


def test_a_schema_nested_past_the_python_stack_is_refused_by_name():
    schema: dict = {"type": "object"}
    for _ in range(5000):
        schema = {"anyOf": [{"items": schema}]}
    with pytest.raises(GrammarError, match="invalid json_schema: nested too deeply"):
        enforceable_schema(schema)


def test_length_bounded_strings_allow_escapes_but_no_raw_control_characters(compiler, tokenizer):
    # xgrammar 0.2.9 alone lets U+0000..U+001F into strings with minLength/maxLength.
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}, "required": ["s"]}
    matcher = compiler.matcher(Constraint("json_schema", json.dumps(schema)))
    assert matcher.accept_tokens(tokenizer.encode('{"s":"'))
    allowed = allowed_ids(GrammarBitmask(VOCAB_SIZE).fill([matcher])[0])
    texts = {tokenizer.decode([i]) for i in allowed}
    assert not any(ord(ch) < 0x20 for text in texts for ch in text)
    assert "\\" in texts and '"' in texts
    assert matcher.accept_tokens(tokenizer.encode('\\n\\u00e9x"}'))   # escapes count as one character
    assert matcher.is_completed


def test_padded_rows_and_special_tokens_are_never_allowed_and_stop_tokens_only_at_the_end(compiler, tokenizer, stop_ids):
    matcher = compiler.matcher(Constraint("regex", "(ab|cd)+"))
    bitmask = GrammarBitmask(VOCAB_SIZE)
    special = {tokenizer.control_tokens[t] for t in ("<|im_start|>", "<|endoftext|>", "<|im_end|>")}
    for text in ("", "ab", "abcd"):
        assert matcher.accept_tokens(tokenizer.encode(text)) if text else True
        allowed = allowed_ids(bitmask.fill([matcher])[0])
        assert not any(i >= len(tokenizer) for i in allowed), "a padded embedding row was allowed"
        assert (set(stop_ids) <= allowed) == (text != ""), "stop tokens exactly when the text is a full match"
        assert not (special - set(stop_ids)) & allowed
        matcher = compiler.matcher(Constraint("regex", "(ab|cd)+"))


def test_a_terminated_matcher_allows_only_stop_tokens(compiler, tokenizer, stop_ids):
    matcher = compiler.matcher(Constraint("regex", "ok"))
    assert matcher.accept_tokens(tokenizer.encode("ok") + [stop_ids[0]])
    assert matcher.is_terminated
    assert allowed_ids(GrammarBitmask(VOCAB_SIZE).fill([matcher])[0]) == set(stop_ids)
    assert matcher.accept_token(stop_ids[1]) and not matcher.accept_token(tokenizer.encode("x")[0])


def test_rebuilt_matcher_equals_the_live_one_and_rollback_undoes_tokens(compiler, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                     "minItems": 3, "maxItems": 3}}, "required": ["a"]}
    constraint = Constraint("json_schema", json.dumps(schema))
    (ids, _), = sample_batch(compiler, [constraint], seed=11, greedy=False)
    assert len(ids) >= 8
    half, bitmask = len(ids) // 2, GrammarBitmask(VOCAB_SIZE)
    live = compiler.matcher(constraint)
    assert live.accept_tokens(ids)
    rebuilt = compiler.matcher(constraint, ids)   # as after a preemption: replay the output tokens
    assert torch.equal(bitmask.fill([live]).clone(), bitmask.fill([rebuilt]))
    expected = bitmask.fill([compiler.matcher(constraint, ids[:half])]).clone()
    live.rollback(len(ids) - half)
    assert live.num_accepted == half and torch.equal(bitmask.fill([live]), expected)
    with pytest.raises(ValueError, match="cannot roll back"):
        live.rollback(half + 1)
    with pytest.raises(GrammarError, match="output token 0"):
        compiler.matcher(Constraint("regex", "a+"), tokenizer.encode("b"))


def test_each_constraint_is_compiled_once_and_the_cache_keeps_to_its_budget(tiny_model_dir, stop_ids):
    roomy = GrammarCompiler.from_model_dir(tiny_model_dir, VOCAB_SIZE, stop_ids)
    first = roomy.compile(Constraint("regex", "[a-z]+"))
    assert roomy.compile(Constraint("regex", "[a-z]+")) is first
    roomy.compile(Constraint("regex", "[0-9]+"))
    assert roomy.num_cached == 2 and roomy.compile(Constraint("regex", "[a-z]+")) is first
    tight = GrammarCompiler.from_model_dir(tiny_model_dir, VOCAB_SIZE, stop_ids, cache_bytes=1)
    first = tight.compile(Constraint("regex", "[a-z]+"))
    tight.compile(Constraint("regex", "[0-9]+"))   # over budget: the least recently used goes
    assert tight.num_cached == 1 and tight.compile(Constraint("regex", "[a-z]+")) is not first


def test_a_batch_without_constrained_rows_costs_nothing():
    # Nothing is touched: not even the logits object.
    apply_bitmask(object(), [], None)
    assert GrammarBitmask(VOCAB_SIZE).fill([]) is None


def test_apply_bitmask_masks_exactly_the_disallowed_tokens_of_the_named_rows():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 70, generator=generator)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 3), dtype=torch.int32, generator=generator)
    expected = logits.clone()
    for i, row in enumerate([3, 1]):
        for token in range(70):
            if not (int(bitmask[i, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    apply_bitmask(logits, [3, 1], bitmask)
    assert torch.equal(logits, expected)
    with pytest.raises(ValueError, match="bitmask has 2 rows for 1"):
        apply_bitmask(logits, [0], bitmask)


@requires_cuda
def test_apply_bitmask_on_cuda_equals_cpu():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 1000, generator=generator).to(torch.bfloat16)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 32), dtype=torch.int32, generator=generator)
    on_gpu = logits.cuda()
    apply_bitmask(logits, [0, 5, 7], bitmask)
    apply_bitmask(on_gpu, torch.tensor([0, 5, 7]), bitmask.pin_memory())
    assert torch.equal(on_gpu.cpu(), logits)


def test_the_frontend_can_check_a_constraint_without_a_tokenizer():
    to_grammar(Constraint("json_schema", '{"type": "integer"}'))
    with pytest.raises(GrammarError, match="invalid regex"):
        to_grammar(Constraint("regex", "[z-a]"))


def utf8_byte_tokens(compiler) -> dict[int, int]:
    """byte -> the id of the token that is exactly that byte (the tiny tokenizer has all 256)."""
    tokens: dict[int, int] = {}
    for token_id, raw in enumerate(compiler.tokenizer_info.decoded_vocab):
        if len(raw) == 1:
            tokens.setdefault(raw[0], token_id)
    return tokens


@pytest.mark.parametrize("constraint", [
    Constraint("json_schema", '{"type": "string"}'),
    Constraint("json_schema", '{"type": "string", "maxLength": 4}'),
    Constraint("json_object"),
    Constraint("regex", '"[^x]*"'),
    Constraint("regex", '".+"'),
    Constraint("grammar", 'root ::= "\\"" [^x]* "\\""'),
])
def test_the_utf8_encoding_of_a_surrogate_is_never_accepted(compiler, constraint):
    # xgrammar 0.2.9 alone accepts ED A0 80 (U+D800 encoded as if it were a character) here.
    byte_token = utf8_byte_tokens(compiler)
    quote = byte_token[ord('"')]
    for raw, accepted in ((b"\xed\xa0\x80", False), (b"\xed\x9f\xbf", True), ("é😀".encode(), True)):
        matcher = compiler.matcher(constraint)
        prefix = b'{"k":"' if constraint.kind == "json_object" else b'"'
        assert matcher.accept_tokens([byte_token[b] for b in prefix])
        assert matcher.accept_tokens([byte_token[b] for b in raw]) == accepted, (constraint, raw)
        if accepted:
            assert matcher.accept_token(quote)


@pytest.mark.parametrize("constraint", [
    Constraint("regex", r"\ud83d\ude00+"),
    Constraint("regex", r"[\ud83d\ude00-\ud83d\ude4f]+"),
    Constraint("grammar", r'root ::= "\ud83d\ude00"+'),
    Constraint("json_schema", json.dumps({"type": "string", "pattern": r"^\ud83d\ude00+$"})),
])
def test_a_surrogate_pair_escape_is_the_character_it_spells(compiler, constraint):
    # xgrammar 0.2.9 alone reads \ud83d\ude00 as two lone surrogates (six bytes that are no text).
    byte_token = utf8_byte_tokens(compiler)
    matcher = compiler.matcher(constraint)
    if constraint.kind == "json_schema":
        assert matcher.accept_token(byte_token[ord('"')])
    assert matcher.accept_tokens([byte_token[b] for b in "😀😀".encode()])
    assert not compiler.matcher(constraint).accept_tokens([byte_token[b] for b in b"\xed\xa0\xbd"])


@pytest.mark.parametrize("constraint, where", [
    (Constraint("regex", r"a\ud800"), "at character 1 is a lone"),
    (Constraint("regex", r"[\udc00-\udfff]"), "at character 1 is a lone"),
    (Constraint("regex", r"\ude00\ud83d"), "at character 0 is a lone"),   # low then high: no pair
    (Constraint("grammar", r'root ::= "\udbff"'), "at character 10 is a lone"),
    (Constraint("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "string",
                                                                               "pattern": r"x\ud800"}}})),
     "at character 1 in #/properties/a/pattern is a lone"),
])
def test_a_lone_surrogate_escape_is_refused_naming_where(constraint, where):
    with pytest.raises(GrammarError, match=f"invalid {constraint.kind}: .*{where}"):
        to_grammar(constraint)


def test_an_escaped_backslash_before_u_is_no_escape(compiler):
    byte_token = utf8_byte_tokens(compiler)
    matcher = compiler.matcher(Constraint("regex", r"\\ud800"))   # a backslash, then "ud800"
    assert matcher.accept_tokens([byte_token[b] for b in rb"\ud800"])


def test_a_threaded_fill_writes_the_same_rows_as_one_by_one(compiler, tokenizer, stop_ids):
    constraints = [Constraint("json_schema", json.dumps(s)) for s in random_schemas(seed=4, count=5)]
    constraints.append(Constraint("regex", "ok"))
    matchers = [compiler.matcher(c) for c in constraints]
    assert matchers[-1].accept_tokens(tokenizer.encode("ok") + [stop_ids[0]])   # terminated rows mix in
    for m in matchers[:-1]:
        assert m.accept_tokens(tokenizer.encode("{"))
    threaded = GrammarBitmask(VOCAB_SIZE, max_threads=2, initial_rows=2).fill(matchers).clone()
    assert torch.equal(threaded, GrammarBitmask(VOCAB_SIZE).fill(matchers))
