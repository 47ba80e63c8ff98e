"""The "ray" backend on a real two-node Ray cluster (ray.cluster_utils, both nodes on this
machine, one CPU each): one replica per node, the outputs of a single engine.

The nodes listen on the machine's own address, not 127.0.0.1: ray.init() rewrites a
loopback address to that one, so a cluster bound to loopback could not be joined."""
import pytest

from tests.distributed.procs import (child_pids, run_to_completion, settle_children,
                                     start_resource_tracker, tiny_config)
from tests.distributed.test_data_parallel import mixed_requests
from tokenmill.engine.data_parallel import DataParallelEngine
from tokenmill.engine.llm_engine import LLMEngine

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.distributed

_NODE = dict(num_cpus=1, object_store_memory=80 * 1024**2)


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster
    start_resource_tracker()
    before = child_pids()
    cluster = Cluster(initialize_head=True, head_node_args=dict(_NODE, include_dashboard=False))
    cluster.add_node(**_NODE)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()
    assert settle_children(before, timeout=30) == set()


def ray_config(model_dir, cluster, dp):
    return tiny_config(model_dir, dp=dp, num_threads=None, distributed_executor_backend="ray",
                       ray_address=cluster.address)


def test_one_replica_per_node_gives_the_single_engine_outputs(tiny_llama_dir, two_nodes):
    reqs = mixed_requests(seed=5)
    want = run_to_completion(LLMEngine(tiny_config(tiny_llama_dir)), reqs)
    engine = DataParallelEngine(ray_config(tiny_llama_dir, two_nodes, dp=2))
    try:
        infos = engine.replica_infos
        assert len({i["node_id"] for i in infos}) == 2          # spread over both nodes
        assert [i["num_threads"] for i in infos] == [1, 1]      # the node's one CPU each
        got = run_to_completion(engine, reqs)
        for request_id in reqs:
            assert ([c.token_ids for c in got[request_id].outputs]
                    == [c.token_ids for c in want[request_id].outputs]), request_id
        stats = engine.get_stats()
        assert stats["num_requests"] == sum(r["num_requests"] for r in stats["replicas"]) \
            == sum(len(want[r].outputs) for r in reqs)
        assert all(r["num_requests"] > 0 for r in stats["replicas"])
    finally:
        engine.shutdown()
    assert not ray.is_initialized()        # the engine joined the cluster, so it leaves it


def test_a_cluster_too_small_is_refused(tiny_llama_dir, two_nodes):
    with pytest.raises(ValueError, match="2 CPUs but 3 data-parallel replicas"):
        DataParallelEngine(ray_config(tiny_llama_dir, two_nodes, dp=3))
    assert not ray.is_initialized()
