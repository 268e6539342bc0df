"""How a request asks for its prefill: the OpenAI API's extra body fields
(``openai_protocol.parse_completion_request`` / ``parse_chat_request``) and the local API's
``prefill`` object (``http_api.parse_local_prefill``), both into a ``PrefillOptions``."""

from __future__ import annotations

import pytest

from infinite_llm.daemon.apb_plan import PrefillOptions
from infinite_llm.daemon.http_api import parse_local_prefill
from infinite_llm.daemon.openai_protocol import OpenAIError, parse_chat_request, parse_completion_request

MODEL = "tiny"
CHAT = [{"role": "system", "content": "Read the document."}, {"role": "user", "content": "What does it say?"}]


def completion(**fields):
    return parse_completion_request({"model": MODEL, "prompt": "a long document", **fields}, MODEL)


def chat(**fields):
    return parse_chat_request({"model": MODEL, "messages": CHAT, **fields}, MODEL)


# --- OpenAI API: accepted -------------------------------------------------------------------


@pytest.mark.parametrize("parse", [completion, chat])
def test_no_prefill_fields_is_exact(parse):
    req = parse()
    assert req.prefill == PrefillOptions()
    assert req.prefill.mode == "exact" and not req.prefill.apb


@pytest.mark.parametrize("parse", [completion, chat])
def test_null_prefill_is_exact(parse):
    assert parse(prefill=None).prefill == PrefillOptions()


@pytest.mark.parametrize("parse", [completion, chat])
def test_every_apb_field(parse):
    req = parse(prefill="apb", apb_hosts=3, apb_anchor_tokens=64, apb_passing_tokens=0, apb_scorer="random")
    assert req.prefill == PrefillOptions("apb", None, 3, 64, 0, "random")
    assert req.prefill.apb
    # the prefill fields leave the rest of the request as it was
    assert req.params == parse().params and req.model == MODEL


@pytest.mark.parametrize("parse", [completion, chat])
def test_apb_defaults(parse):
    options = parse(prefill="apb").prefill
    assert options == PrefillOptions(mode="apb")
    assert (options.hosts, options.anchor_tokens, options.passing_tokens, options.scorer) == (
        None, None, None, "attention")


def test_null_apb_numbers_are_their_defaults():
    options = completion(prefill="apb", apb_hosts=None, apb_anchor_tokens=None, apb_passing_tokens=None).prefill
    assert options == PrefillOptions(mode="apb")


def test_apb_settings_with_an_exact_prefill_are_kept_but_do_nothing():
    options = completion(prefill="exact", apb_hosts=2).prefill
    assert options.mode == "exact" and not options.apb and options.hosts == 2


@pytest.mark.parametrize("query, expected", [("What is it?", "What is it?"), ([5, 0, 17], (5, 0, 17)),
                                             (None, None)])
def test_completion_query(query, expected):
    req = completion(prefill="apb", query=query)
    assert req.prefill.query == expected
    assert req.prompt == "a long document"  # the query is not part of the prompt


def test_a_chat_takes_no_query_field():
    with pytest.raises(OpenAIError) as info:
        chat(prefill="apb", query="What is it?")
    assert info.value.status == 400 and info.value.param == "query"
    assert "Unrecognized request argument supplied: query" in str(info.value)


# --- OpenAI API: refused --------------------------------------------------------------------

BAD_FIELDS = [
    ({"prefill": "fast"}, "prefill", "prefill must be one of exact, apb"),
    ({"prefill": "APB"}, "prefill", "prefill must be one of exact, apb"),
    ({"prefill": 1}, "prefill", "prefill must be one of exact, apb"),
    ({"prefill": ["apb"]}, "prefill", "prefill must be one of exact, apb"),
    ({"prefill": True}, "prefill", "prefill must be one of exact, apb"),
    ({"apb_hosts": 0}, "apb_hosts", "apb_hosts must be an integer >= 1, got 0"),
    ({"apb_hosts": -1}, "apb_hosts", "apb_hosts must be an integer >= 1, got -1"),
    ({"apb_hosts": True}, "apb_hosts", "apb_hosts must be an integer >= 1, got True"),
    ({"apb_hosts": 2.0}, "apb_hosts", "apb_hosts must be an integer >= 1, got 2.0"),
    ({"apb_hosts": "2"}, "apb_hosts", "apb_hosts must be an integer >= 1, got '2'"),
    ({"apb_anchor_tokens": -1}, "apb_anchor_tokens", "apb_anchor_tokens must be an integer >= 0, got -1"),
    ({"apb_anchor_tokens": False}, "apb_anchor_tokens", "apb_anchor_tokens must be an integer >= 0, got False"),
    ({"apb_anchor_tokens": 1.5}, "apb_anchor_tokens", "apb_anchor_tokens must be an integer >= 0, got 1.5"),
    ({"apb_passing_tokens": -8}, "apb_passing_tokens", "apb_passing_tokens must be an integer >= 0, got -8"),
    ({"apb_passing_tokens": [8]}, "apb_passing_tokens", "apb_passing_tokens must be an integer >= 0"),
    ({"apb_scorer": "best"}, "apb_scorer", "apb_scorer must be one of attention, random"),
    ({"apb_scorer": 0}, "apb_scorer", "apb_scorer must be one of attention, random"),
    ({"apb_scorer": "Attention"}, "apb_scorer", "apb_scorer must be one of attention, random"),
]


@pytest.mark.parametrize("parse", [completion, chat])
@pytest.mark.parametrize("fields, param, message", BAD_FIELDS)
def test_bad_prefill_fields(parse, fields, param, message):
    with pytest.raises(OpenAIError) as info:
        parse(prefill="apb", **fields) if "prefill" not in fields else parse(**fields)
    assert info.value.status == 400
    assert info.value.param == param
    assert str(info.value).startswith(message)
    body = info.value.body()["error"]
    assert body["param"] == param and body["type"] == "invalid_request_error"


@pytest.mark.parametrize("query, message", [
    ("", "query must not be empty"),
    ([], "query must be a non-empty string or a list of token ids"),
    ([1, -2], "query must be a non-empty string or a list of token ids"),
    ([1, True], "query must be a non-empty string or a list of token ids"),
    ([1, 2.0], "query must be a non-empty string or a list of token ids"),
    (["a", "b"], "query must be a non-empty string or a list of token ids"),
    (7, "query must be a non-empty string or a list of token ids"),
    ({"text": "q"}, "query must be a non-empty string or a list of token ids"),
])
def test_bad_completion_query(query, message):
    with pytest.raises(OpenAIError) as info:
        completion(prefill="apb", query=query)
    assert info.value.status == 400 and info.value.param == "query"
    assert str(info.value) == message


def test_other_unknown_fields_are_still_refused():
    with pytest.raises(OpenAIError) as info:
        completion(prefill="apb", apb_host=2)
    assert info.value.param == "apb_host" and info.value.status == 400


def test_null_apb_scorer_is_the_default():
    assert completion(prefill="apb", apb_scorer=None).prefill.scorer == "attention"


# --- the local API's prefill object ---------------------------------------------------------


def test_local_prefill_absent_is_exact():
    assert parse_local_prefill(None, chat=False) == PrefillOptions()
    assert parse_local_prefill(None, chat=True) == PrefillOptions()
    assert parse_local_prefill({}, chat=False) == PrefillOptions()


def test_local_prefill_every_key():
    options = parse_local_prefill({"mode": "apb", "query": [3, 4], "hosts": 2, "anchor_tokens": 16,
                                   "passing_tokens": 0, "scorer": "random"}, chat=False)
    assert options == PrefillOptions("apb", (3, 4), 2, 16, 0, "random")
    assert parse_local_prefill({"mode": "apb", "query": "Why?"}, chat=False).query == "Why?"


def test_local_prefill_for_a_chat():
    options = parse_local_prefill({"mode": "apb", "hosts": 4}, chat=True)
    assert options == PrefillOptions(mode="apb", hosts=4)
    assert parse_local_prefill({"mode": "apb", "query": None}, chat=True).query is None


def test_local_chat_with_a_query_is_refused():
    with pytest.raises(OpenAIError) as info:
        parse_local_prefill({"mode": "apb", "query": "Why?"}, chat=True)
    assert info.value.status == 400
    assert str(info.value) == "prefill.query is for a prompt: a chat's query is its last user turn"


@pytest.mark.parametrize("prefill", ["apb", ["apb"], 3, True])
def test_local_prefill_must_be_an_object(prefill):
    with pytest.raises(OpenAIError, match=r"prefill must be an object") as info:
        parse_local_prefill(prefill, chat=False)
    assert info.value.status == 400


@pytest.mark.parametrize("key", ["prefill", "apb_hosts", "host", "Mode", "apb_scorer"])
def test_local_prefill_unknown_key_is_refused(key):
    # the OpenAI API's names are not the local API's
    with pytest.raises(OpenAIError) as info:
        parse_local_prefill({"mode": "apb", key: 2}, chat=False)
    assert info.value.status == 400 and str(info.value) == f"unknown prefill field: {key}"


@pytest.mark.parametrize("prefill, message", [
    ({"mode": "fast"}, "prefill.mode must be one of exact, apb"),
    ({"mode": "apb", "query": ""}, "prefill.query must not be empty"),
    ({"mode": "apb", "query": [1, -1]}, "prefill.query must be a non-empty string or a list of token ids"),
    ({"mode": "apb", "hosts": 0}, "prefill.hosts must be an integer >= 1, got 0"),
    ({"mode": "apb", "hosts": True}, "prefill.hosts must be an integer >= 1, got True"),
    ({"mode": "apb", "anchor_tokens": -1}, "prefill.anchor_tokens must be an integer >= 0, got -1"),
    ({"mode": "apb", "passing_tokens": "4"}, "prefill.passing_tokens must be an integer >= 0, got '4'"),
    ({"mode": "apb", "scorer": "best"}, "prefill.scorer must be one of attention, random"),
])
def test_local_prefill_errors_name_the_local_key(prefill, message):
    with pytest.raises(OpenAIError) as info:
        parse_local_prefill(prefill, chat=False)
    assert info.value.status == 400
    assert str(info.value) == message
    # the OpenAI API's field name is not left in the message
    assert "apb_" not in str(info.value)
