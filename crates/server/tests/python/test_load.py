"""The small version of the load and fault test (the full one: `load_test.py --requests 1000`)."""

import asyncio

from conftest import KilnServer
from load_test import check, run


def test_mixed_load_with_drops_and_a_burst():
    server = KilnServer("--max-batch", "16", "--max-queue", "8")
    try:
        report = asyncio.run(run(server.url, requests=160, concurrency=16, drop=0.1, burst=40, rss=server.rss_bytes))
        metrics = server.wait_idle()
        problems = check(report, metrics, server.rss_bytes(), server.proc.poll() is None)
        assert not problems, (problems, report)
        assert report["dropped"] > 0 and report["refused"] > 0
    finally:
        assert server.stop() == 0
