"""Sum the mutation fuzzer's example counts (FUZZ_REPORT JSON lines, one per pytest process).

    python scripts/fuzz_counts.py fuzz-counts.jsonl
"""

import collections
import json
import sys

totals: collections.Counter = collections.Counter()
with open(sys.argv[1]) as f:
    for line in f:
        totals.update(json.loads(line))
per_backend: collections.Counter = collections.Counter()
for key, n in sorted(totals.items()):
    print(f"{n:6d}  {key}")  # device backend path outcome
    per_backend[" ".join(key.split()[:2])] += n
print("examples per device and backend:", dict(per_backend))
