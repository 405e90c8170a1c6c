#!/usr/bin/env python3
"""Sums cubecl's per-launch profile (`| <duration> | <kernel>` lines, profiling level `basic`)
per kernel, largest first: where a decode step's device time goes."""

import collections
import re
import sys

UNITS = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}
LINE = re.compile(r"\|\s*([0-9.]+)(ns|µs|us|ms|s)\s*\|\s*(.*)")

total, count = collections.Counter(), collections.Counter()
with open(sys.argv[1], errors="replace") as f:
    for line in f:
        m = LINE.match(line)
        if m:
            name = m.group(3).strip()[:100]
            total[name] += float(m.group(1)) * UNITS[m.group(2)]
            count[name] += 1
all_time = sum(total.values()) or 1.0
print(f"{'kernel':<100} {'launches':>9} {'total ms':>10} {'share':>6}")
for name, t in total.most_common(40):
    print(f"{name:<100} {count[name]:>9} {t * 1e3:>10.3f} {t / all_time:>6.1%}")
print(f"all: {sum(count.values())} launches, {all_time * 1e3:.3f} ms")
