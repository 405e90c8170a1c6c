"""Prefix caching through `kiln serve`: a chat of several turns gives the same replies with and
without it, later turns report the prompt tokens they found cached, `n` choices share their
prompt, and `/metrics` counts the hits."""

from openai import OpenAI

from conftest import API_KEY, KilnServer

SYSTEM = (
    "You are a concise geography tutor. Answer in one short sentence, name the country "
    "when you name a city, and never use lists. "
) * 4
QUESTIONS = [
    "What is the capital of France?",
    "And of Italy?",
    "Which of the two is further north?",
]


def converse(client):
    """Three turns, each resending the whole history (what chat clients do)."""
    messages = [{"role": "system", "content": SYSTEM}]
    replies, cached = [], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        reply = client.chat.completions.create(
            model="kiln", messages=messages, max_tokens=24, temperature=0
        )
        text = reply.choices[0].message.content
        messages.append({"role": "assistant", "content": text})
        replies.append(text)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        assert 0 <= cached[-1] < reply.usage.prompt_tokens
    return replies, cached


def test_a_multi_turn_chat_equals_it_without_prefix_caching(client, server):
    before = server.metrics()
    replies, cached = converse(client)
    after = server.wait_idle()

    plain = KilnServer("--no-prefix-cache")
    try:
        assert any("prefix caching off" in line for line in plain.log), "".join(plain.log)
        c = OpenAI(base_url=plain.url + "/v1", api_key="none", max_retries=0, timeout=120, _strict_response_validation=True)
        plain_replies, plain_cached = converse(c)
        plain_metrics = plain.wait_idle()
    finally:
        assert plain.stop() == 0

    assert replies == plain_replies
    assert plain_cached == [0, 0, 0]
    assert plain_metrics["kiln_prefix_cache_hits_total"] == 0
    # Each turn's prompt begins with the previous turn's whole conversation.
    assert cached[1] > 100 and cached[2] > cached[1], cached
    hits = after["kiln_prefix_cache_hits_total"] - before["kiln_prefix_cache_hits_total"]
    assert hits >= cached[1] + cached[2]
    assert after["kiln_kv_cache_blocks_cached"] > 0
    assert 0 < after["kiln_prefix_cache_hit_rate"] <= 1
    assert after["kiln_kv_cache_blocks_used"] == 0


def test_n_choices_share_their_prompt(client, server):
    before = server.metrics()
    prompt = "Write one line about the sea. " * 12
    done = client.completions.create(
        model="kiln", prompt=prompt, n=3, max_tokens=8, temperature=0.9, seed=5
    )
    after = server.wait_idle()
    assert len(done.choices) == 3
    # The prompt counts once; the first choice computed it, the other two shared its blocks.
    whole_blocks = (done.usage.prompt_tokens - 1) // 16 * 16
    hits = after["kiln_prefix_cache_hits_total"] - before["kiln_prefix_cache_hits_total"]
    assert hits >= 2 * whole_blocks, (hits, whole_blocks)
    queried = after["kiln_prefix_cache_queries_total"] - before["kiln_prefix_cache_queries_total"]
    assert queried == 3 * done.usage.prompt_tokens
