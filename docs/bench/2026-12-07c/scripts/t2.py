"""Speculative steps and goodput of an adaptive.py (argument: its path) on the test suite's
simulator: batch 8, a k = 1 step ~1.9 plain steps, acceptance 0.3, 4 seeds. Run from the checkout."""
import sys, importlib.util
spec = importlib.util.spec_from_file_location("adaptive", sys.argv[1]); ad = importlib.util.module_from_spec(spec); sys.modules["adaptive"]=ad; spec.loader.exec_module(ad)
sys.path.insert(0, ".")
import tests.spec.test_adaptive as T  # noqa: E402
T.AdaptiveK = ad.AdaptiveK
for steps in (200, 600, 2000):
    res=[]
    for seed in range(4):
        r, ch = T.simulate(0.3, lambda b, k: 1.0 + 0.9 * k, 8, steps=steps, k_max=3, seed=seed)
        res.append((round(r,3), sum(n for k, n in ch.items() if k)))
    print(steps, res)
