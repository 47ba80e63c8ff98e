"""Closed batch of B requests x N tokens, rounds like bench spec (round 0 warm-up); controller persists.
Step time: 22 + ROW ms per verified row + drafter (mode 0: 3 ms + 0.3 ms x B per draft step).
usage: sim_b8.py [path of an adaptive.py; default the checkout's] (run it on two versions to compare)"""
import os, random, sys, importlib.util
HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("adaptive", sys.argv[1] if len(sys.argv) > 1 else
                                              os.path.join(HERE, "../../../../tokenmill/spec/adaptive.py"))
ad = importlib.util.module_from_spec(spec); sys.modules["adaptive"] = ad; spec.loader.exec_module(ad)

ROW = 2.4
LA = 0.8
def run_round(ctl, B, N, alphas, lookup_p, rng, fixed=None):
    left = [N] * B
    t = tokens = 0.0
    hist = {}
    while any(left):
        active = [i for i in range(B) if left[i] > 0]
        b = len(active)
        k, mode = ctl.choose(b) if fixed is None else fixed
        hist[(b, mode, k)] = hist.get((b, mode, k), 0) + 1
        rows = 0; verdicts = []
        for i in active:
            if k == 0:
                drafts = 0
            elif mode == 1:
                drafts = k if rng.random() < lookup_p else 0
            else:
                drafts = k
            acc = 0
            a = alphas[i] if mode == 0 else LA
            while acc < drafts and rng.random() < a:
                acc += 1
            rows += 1 + drafts
            verdicts.append((drafts, acc))
            got = min(left[i], acc + 1)
            left[i] -= got; tokens += got
        dt = 22 + ROW * rows + (k * (3 + 0.3 * b) if (k and mode == 0) else 0)
        t += dt
        if fixed is None:
            ctl.record(b, k, dt / 1000, verdicts if k else [], mode)
    return tokens / t, hist

def bench(B=8, N=96, rounds=3, alphas=None, lookup_p=0.3, seed=0, verbose=False):
    rng = random.Random(seed)
    ctl = ad.AdaptiveK(3, 2)
    plain = run_round(None, B, N, alphas, lookup_p, rng, fixed=(0, 0))[0]
    ratios = []
    hists = {}
    for r in range(rounds):
        rate, hist = run_round(ctl, B, N, alphas, lookup_p, rng)
        if r:
            ratios.append(rate / plain)
            for key, n in hist.items(): hists[key] = hists.get(key, 0) + n
    if verbose:
        print(sorted(hists.items()))
    return ratios

def main():
    global ROW, LA
    for row, la, lp, name, al in ((2.4, 0.8, 0.3, "chat-pays", [0.5] * 8), (4.0, 0.5, 0.2, "chat-loses", [0.4] * 8),
                                  (4.0, 0.8, 0.3, "mixed-loses", [0.2, 0.9, 0.5, 0.3, 0.8, 0.4, 0.6, 0.7])):
        ROW, LA = row, la
        for B in (1, 8):
            rs = []
            for seed in range(10):
                rs += bench(B=B, alphas=al[:B], lookup_p=lp, seed=seed, verbose=(seed == 0 and B == 8))
            print(name, B, "min %.3f mean %.3f" % (min(rs), sum(rs) / len(rs)))
if __name__ == "__main__":
    main()
