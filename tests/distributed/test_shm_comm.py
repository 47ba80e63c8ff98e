"""Shared-memory collectives between rank processes: sums, maxima and gathers equal to
gloo's within float rounding, bit-identical on every rank, across many calls (the two
banks alternate) and for messages too big for a slot (gloo serves them)."""
import multiprocessing

import pytest
import torch

from tokenmill.distributed.parallel_state import free_port
from tokenmill.layers import native

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not native.buildable(), reason="no C compiler, or no AVX2")]


def _rank_main(rank, world, port, out):
    import torch.distributed as dist
    from tokenmill.distributed.parallel_state import destroy_tp_group, init_tp_group
    torch.set_num_threads(1)
    native.build()
    tp = init_tp_group(rank, world, "127.0.0.1", port, torch.device("cpu"), 60.0)
    results = []
    try:
        assert tp.shm is not None
        for step in range(40):   # past many bank reuses
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(3, 7 + step, generator=g)
            ref = x.clone()
            dist.all_reduce(ref, group=tp.group)
            got = tp.all_reduce(x.clone())
            gathered = tp.all_gather(x, dim=-1)
            maxed = tp.all_reduce_max(x.clone())
            results.append((got, ref, gathered, maxed))
        big = torch.full((tp.shm.slot_bytes // 4 + 1,), float(rank + 1))
        results.append(tp.all_reduce(big)[:3].clone())
        out.put((rank, [tuple(t.tolist() for t in r) if isinstance(r, tuple) else r.tolist()
                        for r in results]))
    finally:
        destroy_tp_group(tp)


def test_shm_collectives_match_gloo_and_agree_across_ranks():
    world, port = 2, free_port("127.0.0.1")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for step, (a, b) in enumerate(zip(got[0][:-1], got[1][:-1])):
        assert a == b, f"ranks disagree at call {step}"            # bit-identical everywhere
        shm_sum, gloo_sum, gathered, maxed = (torch.tensor(v) for v in a)
        torch.testing.assert_close(shm_sum, gloo_sum, rtol=0, atol=1e-6)
        x0, x1 = gathered.chunk(2, dim=-1)
        torch.testing.assert_close(maxed, torch.maximum(x0, x1), rtol=0, atol=0)
        torch.testing.assert_close(shm_sum, x0 + x1, rtol=0, atol=0)   # rank order, one add
    assert got[0][-1] == got[1][-1] == [3.0, 3.0, 3.0]   # too big for a slot: gloo's sum
