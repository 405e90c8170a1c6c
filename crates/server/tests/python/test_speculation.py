"""Speculative decoding through `kiln serve --prompt-lookup` and `--draft-model`: greedy
replies equal the plain server's, streamed and not, and `/metrics` counts the drafts it
proposed and accepted."""

from openai import OpenAI

from conftest import KilnServer

TEXT = (
    "The committee met on Tuesday to discuss the new budget. After a long debate, the "
    "members agreed to increase funding for the library and to reduce spending on office "
    "supplies."
)
MESSAGES = [
    {"role": "user", "content": "Repeat this text exactly, word for word:\n\n" + TEXT},
]


def replies(client):
    """A greedy completion, and the chat reply streamed."""
    whole = client.completions.create(
        model="kiln", prompt=TEXT + "\n\nThe same text again:\n\n", max_tokens=32,
        temperature=0,
    )
    stream = client.chat.completions.create(
        model="kiln", messages=MESSAGES, max_tokens=48, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    return whole.choices[0].text, streamed


def speculative_replies_equal_plain(client, server, flags, banner):
    """Replies of a server started with `flags` equal `server`'s; returns its metrics."""
    plain = replies(client)
    fast_server = KilnServer(*flags)
    try:
        assert any(banner in line for line in fast_server.log), "".join(fast_server.log)
        fast_client = OpenAI(
            base_url=fast_server.url + "/v1", api_key="none", max_retries=0, timeout=120,
            _strict_response_validation=True,
        )
        fast = replies(fast_client)
        metrics = fast_server.wait_idle()
    finally:
        assert fast_server.stop() == 0
    assert fast == plain
    assert server.metrics()["kiln_spec_decode_draft_tokens_total"] == 0
    return metrics


def test_prompt_lookup_changes_no_greedy_reply(client, server):
    metrics = speculative_replies_equal_plain(
        client, server, ["--prompt-lookup", "3", "--draft-tokens", "4"],
        "speculative decoding prompt lookup",
    )
    drafted = metrics["kiln_spec_decode_draft_tokens_total"]
    accepted = metrics["kiln_spec_decode_accepted_tokens_total"]
    assert 0 < accepted <= drafted, metrics
    assert metrics["kiln_spec_decode_tokens_per_forward"] > 1.2, metrics


def test_draft_model_changes_no_greedy_reply(client, server):
    """The default model drafting for itself: its drafts are its own greedy tokens."""
    metrics = speculative_replies_equal_plain(
        client, server, ["--draft-model", "default", "--draft-tokens", "4"],
        "speculative decoding draft model",
    )
    drafted = metrics["kiln_spec_decode_draft_tokens_total"]
    accepted = metrics["kiln_spec_decode_accepted_tokens_total"]
    assert 0.9 * drafted <= accepted <= drafted and drafted > 0, metrics
    assert metrics["kiln_spec_decode_tokens_per_forward"] > 2.5, metrics
