"""Closed batch makespan: plain vs k for all vs k only for the requests that decide the end."""
import random
import sys
SLACK = int(sys.argv[1])
def run(alphas, N, k, policy, row, rng, base=22.0):
    left = [N] * len(alphas); t = 0.0
    while any(left):
        act = [i for i in range(len(alphas)) if left[i] > 0]
        crit = max(left[i] for i in act)
        rows = 0
        for i in act:
            kk = k if (policy == "all" or (policy == "critical" and left[i] >= crit - SLACK)) else 0
            acc = 0
            while acc < kk and rng.random() < alphas[i]:
                acc += 1
            rows += 1 + kk
            left[i] -= min(left[i], acc + 1)
        t += base + row * rows
    return t
for name, al in (("grounded", [0.2, 0.9, 0.5, 0.3, 0.8, 0.4, 0.6, 0.7]), ("chat", [0.5] * 8), ("hard", [0.3] * 8)):
    for row in (1.0, 2.4, 4.0):
        rng = random.Random(0)
        plain = run(al, 96, 0, "all", row, rng)
        res = {p: sum(run(al, 96, 3, p, row, rng) for _ in range(20)) / 20 for p in ("all", "critical")}
        print(name, row, {p: round(plain / v, 3) for p, v in res.items()})
