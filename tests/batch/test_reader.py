"""Input parsing: every kind of bad row becomes an error naming its line and problem."""

from __future__ import annotations

import pytest

from jaxserve.batch.reader import content_hash, detect_format, read_input, row_key
from jaxserve.batch.sharding import derived_seed

GOOD = b'{"id": "g", "prompt": "hello"}'

# (raw line, substrings the error must contain); the bad line is always line 2. Ids are unique
# across cases so the rows can also share one file (tests/batch/test_job.py).
BAD_ROWS = {
    "malformed_json": (b'{"id": "a", "prompt": "x"', ["line 2", "malformed JSON"]),
    "not_an_object": (b'["a", "b"]', ["line 2", "JSON object"]),
    "missing_id": (b'{"prompt": "hi"}', ["line 2", "missing 'id'"]),
    "bad_id_type": (b'{"id": [1], "prompt": "hi"}', ["line 2", "'id'"]),
    "missing_prompt": (b'{"id": "m"}', ["line 2", "missing 'prompt'"]),
    "two_prompts": (b'{"id": "m2", "prompt": "a", "messages": []}', ["line 2", "only one"]),
    "empty_prompt": (b'{"id": "e", "prompt": ""}', ["line 2", "empty prompt"]),
    "prompt_not_str": (b'{"id": "e2", "prompt": 5}', ["line 2", "'prompt' must be a string"]),
    "non_utf8": (b'{"id": "u", "prompt": "caf\xe9"}', ["line 2", "not valid UTF-8"]),
    "unknown_field": (b'{"id": "f", "prompt": "x", "colour": 1}', ["line 2", "unknown", "colour"]),
    "negative_max_tokens": (
        b'{"id": "n", "prompt": "x", "max_tokens": -3}',
        ["line 2", "max_tokens"],
    ),
    "negative_temperature": (
        b'{"id": "t", "prompt": "x", "temperature": -0.5}',
        ["line 2", "temperature"],
    ),
    "top_p_zero": (b'{"id": "p", "prompt": "x", "top_p": 0}', ["line 2", "top_p"]),
    "top_p_above_one": (b'{"id": "p2", "prompt": "x", "top_p": 1.5}', ["line 2", "top_p"]),
    "bad_messages": (b'{"id": "c", "messages": [{"role": "user"}]}', ["line 2", "content"]),
    "image_part": (
        b'{"id": "im", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, '
        b'{"type": "image_url", "image_url": {"url": "x"}}]}]}',
        ["line 2", "messages[0].content[1]", "'image_url'", "text only"],
    ),
    "bad_token_ids": (b'{"id": "c2", "prompt_token_ids": [1, -2]}', ["line 2", "prompt_token_ids"]),
    "two_constraints": (
        b'{"id": "so", "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}',
        ["line 2", "structured_outputs", "exactly one"],
    ),
}


def write(tmp_path, lines: list[bytes], name="in.jsonl"):
    path = tmp_path / name
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_row_names_line_and_problem(tmp_path, case):
    raw, expected = BAD_ROWS[case]
    rows = read_input(write(tmp_path, [GOOD, raw, b'{"id": "z", "prompt": "bye"}']))
    assert [r.line for r in rows] == [1, 2, 3]
    assert rows[0].error is None and rows[2].error is None
    assert rows[0].prompt == "hello" and rows[2].prompt == "bye"
    bad = rows[1]
    assert bad.error is not None and bad.sampling is None
    for s in expected:
        assert s in bad.error, (s, bad.error)


def test_duplicate_id_second_occurrence_errors(tmp_path):
    rows = read_input(
        write(tmp_path, [GOOD, b'{"id": "x", "prompt": "a"}', b'{"id": "g", "prompt": "again"}'])
    )
    assert rows[0].error is None and rows[0].key == '"g"'
    dup = rows[2]
    assert "line 3" in dup.error and "duplicate id 'g'" in dup.error and "line 1" in dup.error
    # The repeat cannot share the first row's key (that id is done once it ran): it is keyed by
    # its content, so inserting lines above it does not change its key.
    assert dup.id is None and dup.key == "raw:" + content_hash(b'{"id": "g", "prompt": "again"}')


def test_ids_keys_and_prompt_kinds(tmp_path):
    lines = [
        b'{"id": 7, "prompt": "int id"}',
        b'{"id": "7", "prompt": "str id"}',
        b"",
        b'{"id": "chat", "messages": [{"role": "user", "content": "hi"}]}',
        b'{"id": "parts", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}',
        b'{"id": "tok", "prompt_token_ids": [5, 6, 7], "max_tokens": 3, "stop": ["x"]}',
        b'{"id": "bad"',
    ]
    rows = read_input(write(tmp_path, lines))
    assert [r.line for r in rows] == [1, 2, 4, 5, 6, 7]  # the blank line 3 is not a row
    keys = ["7", '"7"', '"chat"', '"parts"', '"tok"', "raw:" + content_hash(lines[6])]
    assert [r.key for r in rows] == keys
    assert rows[2].messages == [{"role": "user", "content": "hi"}]
    assert rows[3].error is None  # OpenAI content parts (rendered by inputs.chat.render_chat)
    assert rows[4].prompt_token_ids == [5, 6, 7]
    assert rows[4].sampling.max_tokens == 3 and rows[4].sampling.stop == ["x"]
    assert row_key(None, 6) == "line:6"  # the key of an older jaxserve's output row


def test_defaults_overrides_and_derived_seeds(tmp_path):
    lines = [
        b'{"id": "a", "prompt": "x"}',
        b'{"id": "b", "prompt": "x", "temperature": 0.7, "seed": 11}',
    ]
    path = write(tmp_path, lines)
    rows = read_input(path, sampling_defaults={"max_tokens": 9, "temperature": 0.0}, base_seed=3)
    a, b = rows
    assert a.sampling.max_tokens == 9 and a.sampling.temperature == 0.0
    assert b.sampling.max_tokens == 9 and b.sampling.temperature == 0.7
    assert b.sampling.seed == 11  # a row's own seed wins
    assert a.sampling.seed == derived_seed(3, '"a"')
    # Same seed whatever else is in the file (sharding / order do not matter).
    alone = read_input(write(tmp_path, [lines[0]], "one.jsonl"), base_seed=3)
    assert alone[0].sampling.seed == a.sampling.seed
    assert read_input(path)[0].sampling.seed is None  # no base seed: the engine picks one


def test_bad_default_fails_every_row_with_its_line(tmp_path):
    rows = read_input(write(tmp_path, [GOOD]), sampling_defaults={"top_p": 2.0})
    assert "line 1" in rows[0].error and "top_p" in rows[0].error


def test_plain_text_input(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"first prompt\r\n\nthird \xff line\nfourth\n")
    rows = read_input(str(path))
    h = content_hash
    assert [(r.line, r.id, r.prompt) for r in rows] == [
        (1, h(b"first prompt"), "first prompt"),
        (3, h(b"third \xff line"), None),
        (4, h(b"fourth"), "fourth"),
    ]
    assert "line 3" in rows[1].error and "UTF-8" in rows[1].error
    assert rows[0].key == f'"{h(b"first prompt")}"'


def test_format_detection_and_missing_file(tmp_path):
    sniff = tmp_path / "rows"
    sniff.write_text('\n{"id": 1, "prompt": "a"}\n')
    assert detect_format(str(sniff)) == "jsonl"
    text = tmp_path / "prompts"
    text.write_text("just words\n")
    assert detect_format(str(text)) == "text"
    assert detect_format(str(tmp_path / "x.jsonl")) == "jsonl"  # extension wins, no read
    with pytest.raises(ValueError, match="does not exist"):
        read_input(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="input_format"):
        read_input(str(sniff), input_format="csv")
    forced = read_input(str(text), input_format="jsonl")
    assert "malformed JSON" in forced[0].error


def test_structured_outputs_row(tmp_path):
    """A row's structured_outputs object becomes its StructuredOutputsParams, and the constraint
    is part of the fingerprint (a changed schema is redone on resume)."""
    from jaxserve import StructuredOutputsParams

    lines = [
        b'{"id": "a", "prompt": "x", "structured_outputs": {"json": {"type": "object"}}}',
        b'{"id": "b", "prompt": "x", "structured_outputs": {"json": {"type": "array"}}}',
        b'{"id": "c", "prompt": "x", "structured_outputs": {"choice": ["y", "n"]}}',
    ]
    a, b, c = read_input(write(tmp_path, lines))
    assert a.error is None and a.sampling.structured_outputs.json == {"type": "object"}
    assert c.sampling.structured_outputs == StructuredOutputsParams(choice=("y", "n"))
    assert len({a.fingerprint, b.fingerprint, c.fingerprint}) == 3
