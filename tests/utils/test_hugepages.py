"""Huge pages for weights and KV caches (utils/hugepages.py): the mappings fault in or
collapse to 2 MB pages where Linux allows, their contents never change, and the engine's
output is the same with and without them."""
import ctypes
import mmap

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig
from tokenmill.layers.attention.kv_quant import QuantizedKV, cache_zeros
from tokenmill.utils import hugepages

pytestmark = pytest.mark.huge_pages
MB = 1 << 20


def _huge_kb(address: int) -> int:
    """AnonHugePages of the mapping holding ``address`` (kB)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def _resident_pages(address: int, nbytes: int) -> int:
    """Resident pages of [address, address + nbytes) (mincore: page by page, whatever
    mapping they belong to; a huge page makes all 512 of its pages resident)."""
    vec = ctypes.create_string_buffer(nbytes // mmap.PAGESIZE)
    assert hugepages._libc().mincore(address, nbytes, vec) == 0
    return sum(b & 1 for b in vec.raw)


@pytest.fixture
def thp():
    if not hugepages.supported():
        pytest.skip("no transparent huge pages on this system")


def test_advised_mapping_faults_in_huge_pages(thp):
    pages = hugepages.anonymous_map(8 * MB, huge=True)
    t = torch.frombuffer(pages, dtype=torch.uint8)
    assert not t.any()                         # zero pages until written
    t.fill_(7)
    if _huge_kb(t.data_ptr()) == 0:
        pytest.skip("the kernel gave no huge page (memory too fragmented)")
    assert _huge_kb(t.data_ptr()) >= 2048
    plain = torch.frombuffer(hugepages.anonymous_map(8 * MB, huge=False), dtype=torch.uint8)
    plain.fill_(7)
    assert _huge_kb(plain.data_ptr()) == 0     # THP "always" would give it some: not here
    assert bool((t == 7).all())


def test_collapse_keeps_contents_and_skips_sparse_memory(thp):
    dense = torch.frombuffer(hugepages.anonymous_map(12 * MB, huge=False), dtype=torch.int32)
    dense.copy_(torch.arange(dense.numel(), dtype=torch.int32))
    sparse = torch.frombuffer(hugepages.anonymous_map(12 * MB, huge=False), dtype=torch.uint8)
    sparse[::1 * MB] = 1                        # one page a megabyte resident
    if _huge_kb(dense.data_ptr()) or _resident_pages(sparse.data_ptr(), 12 * MB) > 12:
        pytest.skip("THP gives anonymous memory huge pages unasked here")
    collapsed = hugepages.collapse_dense_memory()
    if collapsed == 0:
        pytest.skip("no MADV_COLLAPSE on this kernel")
    assert _huge_kb(dense.data_ptr()) >= 8 * 1024   # 12 MB holds five whole aligned 2 MB
    assert _resident_pages(sparse.data_ptr(), 12 * MB) == 12   # not filled in to huge pages
    assert torch.equal(dense, torch.arange(dense.numel(), dtype=torch.int32))


def test_huge_page_caches_start_aligned_and_read_zero():
    k = cache_zeros((64, 16, 4, 128), torch.float16, "cpu", huge_pages=True)   # 1 MB: too small
    assert k.shape == (64, 16, 4, 128) and not k.any()
    big = cache_zeros((512, 16, 4, 64), torch.float32, "cpu", huge_pages=True)  # 8 MB
    assert big.data_ptr() % hugepages.HUGE_PAGE == 0 and big.is_contiguous() and not big.any()
    big[3, 5] = 1.5
    assert big.sum().item() == 1.5 * 4 * 64
    q = QuantizedKV.zeros((512, 16, 4, 64), torch.int8, "cpu", huge_pages=True)
    assert q.values.data_ptr() % hugepages.HUGE_PAGE == 0 and not q.values.any() and not q.scale.any()


def test_collapse_without_the_system_call_is_a_no_op(monkeypatch):
    monkeypatch.setattr(hugepages, "_libc", lambda: None)
    assert hugepages.collapse_dense_memory() == 0


def test_huge_pages_setting_is_validated():
    with pytest.raises(ValueError, match="huge_pages"):
        ModelConfig(model="m", huge_pages="yes")


def test_engine_output_is_the_same_on_huge_pages(tiny_llama_dir):
    prompts = [{"prompt_token_ids": [5 + i * 7 % 370 for i in range(n)]} for n in (3, 40, 400)]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    runs = []
    for huge in (False, True):
        llm = LLM(model=tiny_llama_dir, huge_pages=huge, num_threads=2, skip_tokenizer_init=True,
                  max_model_len=512, num_kv_blocks=2048)   # 4 MB a layer's K: huge-page sized
        caches = [c for pair in llm.engine.runner.kv_caches for c in pair]
        if huge:   # each starts a 2 MB page
            assert all(c.data_ptr() % hugepages.HUGE_PAGE == 0 for c in caches)
        runs.append([(c.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs])
                     for out in llm.generate(prompts, params) for c in out.outputs])
        del llm
    assert runs[0] == runs[1]


def test_cli_turns_huge_pages_off():
    from tokenmill.entrypoints.cli import build_parser
    assert build_parser().parse_args(["serve", "--no-huge-pages"]).huge_pages is False
    assert build_parser().parse_args(["serve"]).huge_pages is True

