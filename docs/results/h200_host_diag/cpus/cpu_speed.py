"""Scratch: each vCPU's speed alone (a fixed Python loop, pinned, one at a time), three rounds; prints the fastest and slowest five."""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from smt import run
n = os.cpu_count()
rounds = [{c: run([c])[c] for c in range(n)} for _ in range(3)]
for r in rounds:
    print("alone s:", " ".join(f"{c}:{r[c]:.3f}" for c in range(n)))
best = {c: min(r[c] for r in rounds) for c in range(n)}
order = sorted(range(n), key=best.get)
print("FAST=" + ",".join(map(str, order[:5])))
print("SLOW=" + ",".join(map(str, order[-5:])))
