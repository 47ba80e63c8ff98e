"""The fused CPU kernels equal their PyTorch references (or the reference attention)."""
import pytest
import torch

from tokenmill.layers import cpu_ops, native
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.layers.attention.reference import ReferenceAttention
from tokenmill.layers.rotary import RotaryEmbedding, _apply
from tests.layers.block_tables import shuffled_block_tables

# Skipped only where the kernels cannot exist; where they should, a failed build fails here.
pytestmark = pytest.mark.skipif(not native.buildable(), reason="no C compiler, or a CPU without AVX2")


@pytest.mark.parametrize("t,h", [(1, 576), (3, 64), (17, 100), (40, 13)])
def test_rms_norm_matches_reference(t, h):
    g = torch.Generator().manual_seed(t * h)
    x = torch.randn(t, h, generator=g) * 3
    w = torch.randn(h, generator=g)
    got = cpu_ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, cpu_ops.rms_norm_reference(x, w, 1e-5), rtol=2e-6, atol=2e-6)


def test_fused_add_rms_norm_updates_residual_in_place():
    g = torch.Generator().manual_seed(0)
    x, res, w = torch.randn(5, 96, generator=g), torch.randn(5, 96, generator=g), torch.randn(96, generator=g)
    expected_res = x + res
    got = cpu_ops.rms_norm(x, w, 1e-6, residual=res)
    torch.testing.assert_close(res, expected_res, rtol=0, atol=0)
    torch.testing.assert_close(got, cpu_ops.rms_norm_reference(expected_res, w, 1e-6), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("t", [1, 7])
def test_rope_in_place_matches_reference_on_strided_views(t):
    g = torch.Generator().manual_seed(t)
    hq, hkv, d = 6, 2, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
    rot = RotaryEmbedding(d, 256, 10000.0)
    pos = torch.randint(0, 256, (t,), generator=g)
    cos, sin = rot.cos[pos].unsqueeze(1), rot.sin[pos].unsqueeze(1)
    want_q, want_k = _apply(q.clone(), cos, sin), _apply(k.clone(), cos, sin)
    v_before = qkv[:, (hq + hkv) * d:].clone()
    assert cpu_ops.rope_(q, k, rot.cos, rot.sin, pos)
    torch.testing.assert_close(q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before)   # v untouched


@pytest.mark.parametrize("t,i", [(1, 1536), (4, 13), (20, 64)])
def test_silu_mul_matches_reference(t, i):
    x = torch.randn(t, 2 * i, generator=torch.Generator().manual_seed(i)) * 6
    x[0, 0], x[-1, 1] = -120.0, 95.0   # saturating inputs: no NaN/inf
    torch.testing.assert_close(cpu_ops.silu_mul(x), SiluAndMul()(x), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("t,h", [(1, 640), (3, 64), (17, 100), (5, 13)])
def test_gemma_rms_norm_matches_reference(t, h):
    """GemmaRMSNorm's (1 + w) weights, in float32 as the reference multiplies them."""
    g = torch.Generator().manual_seed(t * h)
    x, w = torch.randn(t, h, generator=g) * 3, torch.randn(h, generator=g)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-6, gemma=True),
                               cpu_ops.rms_norm_reference(x, w, 1e-6, gemma=True), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("gemma,heads", [(False, 6), (True, 6), (True, 1)])
def test_rms_norm_of_per_head_views(gemma, heads):
    """q / k norms take [T, heads, D] views of a qkv row: each head is a row of its own,
    the same bits as the contiguous rows. One head (Gemma3-270m's k): the view reshapes to
    [T, D] without a copy, its rows a qkv row apart."""
    from tokenmill.layers.norm import GemmaRMSNorm, RMSNorm
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(3, 10 * 32, generator=g)
    q = qkv[:, 32: (1 + heads) * 32].view(3, heads, 32)
    norm = (GemmaRMSNorm if gemma else RMSNorm)(32, 1e-6)
    norm.weight.data = torch.randn(32, generator=g)
    got = norm(q)
    assert got.shape == q.shape
    assert torch.equal(got, cpu_ops.rms_norm(q.contiguous().view(-1, 32), norm.weight, 1e-6,
                                             gemma=gemma).view(3, heads, 32))
    torch.testing.assert_close(got, cpu_ops.rms_norm_reference(q, norm.weight, 1e-6, gemma=gemma),
                               rtol=2e-6, atol=2e-6)


def test_gelu_tanh_mul_matches_torch():
    """Against torch's gelu(approximate="tanh") (the reference) on a dense sweep of gates:
    within 1e-6 relative, or 2e-7 absolute where torch loses digits in 1 + tanh (x < -1);
    and as close to float64 as torch is (closer there)."""
    gate = torch.linspace(-12, 12, 48001)
    x = torch.cat([gate[None], torch.ones(1, gate.numel())], 1)
    got = cpu_ops.gelu_tanh_mul(x)[0]
    torch.testing.assert_close(got, cpu_ops.gelu_tanh_mul_reference(x)[0], rtol=1e-6, atol=2e-7)
    g64 = gate.double()
    exact = 0.5 * g64 * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g64 + 0.044715 * g64 ** 3)))
    upper = gate > -5   # below, the values underflow toward 0 in both
    assert ((got.double() - exact).abs() / exact.abs())[upper].max() < 3e-6
    assert (got.double() - exact).abs().max() < 6e-7   # half an ulp of 12 is 4.8e-7


@pytest.mark.parametrize("t,i", [(1, 2048), (4, 13), (20, 64)])
def test_gelu_tanh_mul_module_takes_the_kernel(t, i, monkeypatch):
    """GeluTanhAndMul calls the kernel (any width: the tail goes through the same vector
    code), and without cpu kernels computes torch's reference."""
    from tokenmill.layers.activation import GeluTanhAndMul
    x = torch.randn(t, 2 * i, generator=torch.Generator().manual_seed(i)) * 3
    lib, calls = native.require(), []
    real = lib.tm_gelu_tanh_mul
    monkeypatch.setattr(lib, "tm_gelu_tanh_mul", lambda *a: (calls.append(1), real(*a))[1])
    act = GeluTanhAndMul()
    got = act(x)
    assert calls and torch.equal(got, cpu_ops.gelu_tanh_mul(x))
    up_max = x[:, i:].abs().max().item()   # the sweep's bounds, scaled by the up factors
    torch.testing.assert_close(got, cpu_ops.gelu_tanh_mul_reference(x), rtol=1e-6, atol=2e-7 * up_max)
    act.cpu_kernels = False
    assert torch.equal(act(x), cpu_ops.gelu_tanh_mul_reference(x)) and len(calls) == 2


def test_exp_extremes_through_silu():
    x = torch.tensor([[-1e30, -90.0, -87.0, 0.0, 30.0, 88.0, 1e30, 5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    got = cpu_ops.silu_mul(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, SiluAndMul()(x), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5, 100])   # 100: one-long / two-long rows split their window
@pytest.mark.parametrize("d", [64, 48])   # 48: not a multiple of 32, the generic loops
@pytest.mark.parametrize("requests", ["few", "many", "one-long-2", "one-long-3", "two-long-2"])
def test_paged_attention_matches_reference(window, d, requests, kv_dtype):
    """many: GQA heads grouped per task; one-long-N / two-long-N: requests whose keys are
    split across N threads (their window's keys, if long enough), each part merged by max rescaling. Half-precision
    caches are widened in registers: same numbers as the reference reading them as fp32."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, bs, nblocks = 6, 2, 4, 120
    k_cache = torch.randn(nblocks, bs, hkv, d, generator=g).to(kv_dtype)
    v_cache = torch.randn(nblocks, bs, hkv, d, generator=g).to(kv_dtype)
    # decode at ctx 1, a 3-token speculative run, decode at ctx 23 (and more of the kind)
    q_lens, seq_lens = [1, 3, 1], [1, 9, 23]
    if requests == "many":
        q_lens, seq_lens = q_lens * 4 + [2], seq_lens * 4 + [38]
    threads = torch.get_num_threads()
    if requests.startswith("one-long"):
        q_lens, seq_lens = [3], [301]
        torch.set_num_threads(int(requests[-1]))
    if requests.startswith("two-long"):   # fewer requests than 2 x threads: split too
        q_lens, seq_lens = [1, 2], [150, 203]
        torch.set_num_threads(int(requests[-1]))
    tables = shuffled_block_tables(seq_lens, bs, nblocks, g)
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, bs, "cpu")
    t = sum(q_lens)
    q = torch.randn(t, hq, d, generator=g)
    # the reference writes K/V first; give it the values already in the cache at those slots
    k_new = k_cache.flatten(0, 1)[meta.slot_mapping].clone()
    v_new = v_cache.flatten(0, 1)[meta.slot_mapping].clone()
    want = ReferenceAttention().forward(q, k_new, v_new, k_cache.clone(), v_cache.clone(), meta,
                                        0.125, sliding_window=window)
    out = torch.full_like(q, float("nan"))
    try:
        ok = cpu_ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc[:-1],
                                     torch.tensor(q_lens), meta.seq_lens, 0.125, window, out)
    finally:
        torch.set_num_threads(threads)
    assert ok
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seq_len", [40, 301, 1030])   # rows of < 64, >= 64 and >> 64 keys per thread
def test_paged_attention_finds_the_top_score_anywhere(seq_len, kv_dtype):
    """One key scores thousands above the rest, at positions covering every lane and loop of
    the row-maximum search: the output must be that key's value row exactly, where a missed
    maximum gives exp overflow (inf / NaN) and small scores would hide it in the
    normalization."""
    g = torch.Generator().manual_seed(seq_len)
    hq, hkv, d, bs = 9, 3, 64, 16
    nblocks = -(-seq_len // bs) + 4
    k_cache = torch.randn(nblocks, bs, hkv, d, generator=g).to(kv_dtype)
    v_cache = torch.randn(nblocks, bs, hkv, d, generator=g).to(kv_dtype)
    table = shuffled_block_tables([seq_len], bs, nblocks, g)[0]
    q = 1000.0 * torch.randn(1, hq, d, generator=g)
    top = (q[0].reshape(hkv, hq // hkv, d).sum(1) / 1000.0).to(kv_dtype)   # scores ~8000 vs ~3000
    for pos in sorted({*range(0, seq_len, 7), seq_len // 2 - 1, seq_len // 2, seq_len - 1}):
        slot = (table[pos // bs], pos % bs)
        kept = k_cache[slot].clone()
        k_cache[slot] = top
        got = _attend(q, k_cache, v_cache, [1], [seq_len], [table], bs, None)
        k_cache[slot] = kept
        want = v_cache[slot].float().repeat_interleave(hq // hkv, dim=0)[None]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"top key at {pos}")


def _attend(rows, k_cache, v_cache, lens, seqs, tabs, bs, window):
    """cpu_ops.paged_attention of query rows [T, Hq, D] for requests (q lens, seq lens,
    block tables); every row must be written."""
    meta = AttentionMetadata.build(lens, seqs, tabs, bs, "cpu")
    out = torch.full_like(rows, float("nan"))
    assert cpu_ops.paged_attention(rows, k_cache, v_cache, meta.block_tables,
                                   meta.query_start_loc[:-1], torch.tensor(lens),
                                   meta.seq_lens, 0.125, window, out)
    return out


@pytest.mark.skipif(not (native.has_vnni() and native.buildable()), reason="one build only here")
@pytest.mark.parametrize("hq,hkv,dtype", [(9, 3, torch.float32), (8, 2, torch.float16), (6, 6, torch.bfloat16)])
def test_paged_attention_both_builds_are_bit_identical(hq, hkv, dtype, both_builds, monkeypatch):
    """The AVX-512 build shares each K / V load among up to 4 query heads of a KV head and
    updates 16 output values at a time, the AVX2 build 2 heads and 8 values: the same
    arithmetic per head and element, so the same bits (many requests, and a lone long one
    split across the threads)."""
    g = torch.Generator().manual_seed(hq + hkv)
    d, bs = 64, 4
    k_cache = torch.randn(90, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(90, bs, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(90, generator=g).tolist()
    for q_lens, seq_lens in (([1, 2, 1, 1, 3, 1, 1, 2], [5, 17, 30, 1, 12, 25, 9, 40]), ([1], [150])):
        tables, used = [], 0
        for n in seq_lens:
            tables.append(perm[used:used + -(-n // bs)])
            used += len(tables[-1])
        q = torch.randn(sum(q_lens), hq, d, generator=g)
        outs = []
        for lib in both_builds:
            monkeypatch.setattr(native, "library", lambda lib=lib: lib)
            outs.append(_attend(q, k_cache, v_cache, q_lens, seq_lens, tables, bs, None))
        assert not outs[0].isnan().any()
        assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("window", [None, 6])
def test_paged_attention_batched_equals_each_request_alone(window):
    """Many requests run one task per request over all heads (sequential cache reads); a
    lone short request runs per KV head. Same arithmetic, so bit-identical outputs."""
    g = torch.Generator().manual_seed(5)
    hq, hkv, d, bs = 9, 3, 64, 4
    k_cache, v_cache = torch.randn(60, bs, hkv, d, generator=g), torch.randn(60, bs, hkv, d, generator=g)
    q_lens, seq_lens = [1, 2, 1, 1, 3, 1], [5, 17, 30, 1, 12, 25]
    perm = torch.randperm(60, generator=g).tolist()
    tables, used = [], 0
    for s in seq_lens:
        tables.append(perm[used:used + -(-s // bs)])
        used += len(tables[-1])
    q = torch.randn(sum(q_lens), hq, d, generator=g)

    def run(rows, lens, seqs, tabs):
        return _attend(rows, k_cache, v_cache, lens, seqs, tabs, bs, window)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batched = run(q, q_lens, seq_lens, tables)
        start, alone = 0, []
        for n, s, t in zip(q_lens, seq_lens, tables):
            alone.append(run(q[start:start + n], [n], [s], [t]))
            start += n
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batched, torch.cat(alone))


def test_modules_switched_off_call_no_kernel(monkeypatch):
    """``cpu_kernels=False`` (set_cpu_kernels on a model) keeps a module on its PyTorch
    code: same values, no kernel call."""
    from tokenmill.layers.norm import RMSNorm
    lib, calls = native.require(), []
    for name in ("tm_rms_norm", "tm_silu_mul"):
        real = getattr(lib, name)
        monkeypatch.setattr(lib, name, lambda *a, real=real: (calls.append(1), real(*a))[1])
    model = torch.nn.Sequential(RMSNorm(64, 1e-5), SiluAndMul())
    x = torch.randn(3, 64)
    on = model(x)
    assert len(calls) == 2
    cpu_ops.set_cpu_kernels(model, False)
    off = model(x)
    assert len(calls) == 2 and not model[0].cpu_kernels and not model[1].cpu_kernels
    torch.testing.assert_close(off, on, rtol=2e-6, atol=2e-6)


def test_not_applicable_inputs_fall_back():
    assert cpu_ops.rms_norm(torch.ones(1, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-6) is None
    assert cpu_ops.silu_mul(torch.ones(3, 8)[:, :6].t()) is None   # non-contiguous


def test_rmsnorm_module_takes_the_fused_path(monkeypatch):
    """The module's weight is an nn.Parameter: the fast path must accept it."""
    from tokenmill.layers.norm import RMSNorm
    norm = RMSNorm(64, 1e-5)
    calls = []
    real = native.require().tm_rms_norm
    monkeypatch.setattr(native.require(), "tm_rms_norm", lambda *a: (calls.append(1), real(*a))[1])
    x = torch.randn(3, 64)
    torch.testing.assert_close(norm(x), cpu_ops.rms_norm_reference(x, norm.weight, 1e-5), rtol=2e-6, atol=2e-6)
    assert calls


@pytest.mark.parametrize("window", [None, 6, 70])
def test_paged_attention_reads_int8_cache_like_its_dequantized_values(window):
    from tokenmill.layers.attention.kv_quant import QuantizedKV
    g = torch.Generator().manual_seed(4)
    hq, hkv, d, bs, nblocks = 6, 2, 64, 4, 30
    shape = (nblocks, bs, hkv, d)
    k_q, v_q = QuantizedKV.zeros(shape, torch.int8, "cpu"), QuantizedKV.zeros(shape, torch.int8, "cpu")
    slots = torch.arange(nblocks * bs)
    k_q.write(torch.randn(nblocks * bs, hkv, d, generator=g), slots)
    v_q.write(torch.randn(nblocks * bs, hkv, d, generator=g), slots)
    all_blocks = torch.arange(nblocks)
    k_f, v_f = k_q.index_select(0, all_blocks), v_q.index_select(0, all_blocks)   # dequantized
    q_lens, seq_lens, tables = [1, 4], [13, 30], [[5, 1, 7, 2], list(range(10, 18))]
    if window != 6:   # one request: its keys (the last 70 with the window) split across the threads
        q_lens, seq_lens, tables = [2], [101], [list(range(30))[::-1][:26]]
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, bs, "cpu")
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    args = (meta.block_tables, meta.query_start_loc[:-1], torch.tensor(q_lens), meta.seq_lens, 0.125, window)
    want, got = torch.empty_like(q), torch.empty_like(q)
    assert cpu_ops.paged_attention(q, k_f, v_f, *args, want)
    assert cpu_ops.paged_attention(q, k_q, v_q, *args, got)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _kv_caches(kv_dtype, shape, g):
    """Random K and V caches of a float dtype, or int8 QuantizedKV ones."""
    if kv_dtype is not torch.int8:
        return [torch.randn(*shape, generator=g).to(kv_dtype) for _ in range(2)]
    from tokenmill.layers.attention.kv_quant import QuantizedKV
    caches = []
    for _ in range(2):
        c = QuantizedKV.zeros(shape, torch.int8, "cpu")
        c.write(torch.randn(shape[0] * shape[1], *shape[2:], generator=g), torch.arange(shape[0] * shape[1]))
        caches.append(c)
    return caches


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("d", [64, 48])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("window", [None, 70])
def test_a_rows_attention_depends_on_that_row_alone(kv_dtype, d, threads, window):
    """Speculative decoding is exact only if a verify row equals the decode row at the same
    position: a row's bits must not depend on its run's length (the first row's context
    decided whether rows split their keys across threads), nor on the requests beside it.
    Runs straddle the split threshold (ATT_SPLIT_MIN x threads keys); every row equals that
    row decoded alone, for runs alone (few requests: split runs in parallel) and batched
    (many requests: split rows in one task)."""
    if kv_dtype is torch.int8 and d % 32:
        pytest.skip("int8 caches need D % 32 == 0")
    g = torch.Generator().manual_seed(11)
    hq, hkv, bs, nblocks = 6, 2, 4, 400
    k_cache, v_cache = _kv_caches(kv_dtype, (nblocks, bs, hkv, d), g)
    edge = 32 * threads   # keys at which a row splits
    q_lens = [4, 4, 3, 1, 4, 2, 1]
    seq_lens = [edge + 2, edge + 1, edge, edge, edge + 40, 20, 3 * edge]
    tables = shuffled_block_tables(seq_lens, bs, nblocks, g)
    q = torch.randn(sum(q_lens), hq, d, generator=g)

    def run(rows, lens, seqs, tabs):
        return _attend(rows, k_cache, v_cache, lens, seqs, tabs, bs, window)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batched = run(q, q_lens, seq_lens, tables)
        runs, singles, start = [], [], 0
        for n, s, t in zip(q_lens, seq_lens, tables):
            runs.append(run(q[start:start + n], [n], [s], [t]))
            for i in range(n):   # the row decoded alone: its position s - n + i, s - n + i + 1 keys
                singles.append(run(q[start + i:start + i + 1], [1], [s - n + i + 1], [t]))
            start += n
    finally:
        torch.set_num_threads(saved)
    singles = torch.cat(singles)
    assert not singles.isnan().any()
    assert torch.equal(torch.cat(runs), singles)
    assert torch.equal(batched, singles)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 9, 16, 17, 32, 63, 64])   # > 8: blocked kernel
@pytest.mark.parametrize("n,k", [(4, 8), (37, 576), (1728, 576), (5, 13), (129, 1536)])
def test_small_m_linear_matches_f_linear(m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    expected = torch.nn.functional.linear(x.double(), w.double(), b.double()).float()
    torch.testing.assert_close(cpu_ops.linear(x, w, b), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cpu_ops.linear(x, w), expected - b, rtol=1e-5, atol=1e-4)


def test_small_m_linear_kernel_takes_any_row_count():
    # the Python wrapper passes at most LINEAR_MAX_ROWS; the C entry point takes more
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(101, 40, generator=g), torch.randn(19, 40, generator=g)
    y = torch.empty(101, 19)
    native.require().tm_linear_small_m(x.data_ptr(), 101, 40, w.data_ptr(), 19, None, y.data_ptr(), 2)
    torch.testing.assert_close(y, torch.nn.functional.linear(x.double(), w.double()).float(),
                               rtol=1e-5, atol=1e-4)


# rows sliced from a 64-row batch: one-pass rows, the blocked kernel's full blocks of 6 rows,
# its part-filled blocks and an odd last row; N % 8 != 0 exercises its per-output sums, K % 8
# != 0 the scalar tail
ROW_SLICES = [(0, 1), (5, 7), (2, 5), (3, 7), (0, 8), (3, 12), (0, 16), (0, 9), (5, 22),
              (3, 40), (1, 64), (0, 64)]


@pytest.mark.parametrize("n,k", [(963, 100), (3072, 576), (577, 1536), (5, 3), (64, 640)])
def test_small_m_linear_rows_do_not_depend_on_the_row_count(n, k):
    """Every row count, streaming W once (<= 8 rows) or register-blocked, runs the same FMA
    chains per output, so a request's decode bits never depend on how many others share its
    step, nor on whether its verify rows come one or k + 1 at a time."""
    g = torch.Generator().manual_seed(n + k)
    x, w, b = torch.randn(64, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    whole = cpu_ops.linear(x, w, b)
    for lo, hi in ROW_SLICES:
        assert torch.equal(cpu_ops.linear(x[lo:hi].contiguous(), w, b), whole[lo:hi]), (lo, hi)
    for i in (0, 13, 63):
        assert torch.equal(cpu_ops.linear(x[i:i + 1], w, b), whole[i:i + 1])
    torch.testing.assert_close(whole, torch.nn.functional.linear(x.double(), w.double(), b.double()).float(),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not (native.has_vnni() and native.buildable()), reason="one build only here")
@pytest.mark.parametrize("m,n,k", [(37, 963, 100), (64, 3072, 576), (23, 577, 1536)])
def test_small_m_linear_both_builds_are_bit_identical(m, n, k, both_builds):
    """The AVX2 build's 256-bit blocks and the AVX-512 build's paired rows run the same
    chains and the same sum of the 8 lanes: identical bits, with and without a bias."""
    g = torch.Generator().manual_seed(m + n)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    for bias in (None, b):
        outs = []
        for lib in both_builds:
            y = torch.empty(m, n)
            lib.tm_linear_small_m(x.data_ptr(), m, k, w.data_ptr(), n,
                                  None if bias is None else bias.data_ptr(), y.data_ptr(), 2)
            outs.append(y)
        assert all(torch.equal(outs[0], y) for y in outs[1:])


def test_small_m_linear_declines_what_it_does_not_cover():
    w = torch.randn(16, 32)
    assert cpu_ops.linear(torch.randn(cpu_ops.LINEAR_MAX_ROWS + 1, 32), w) is None   # a GEMM
    assert cpu_ops.linear(torch.randn(2, 64)[:, ::2], w) is None                     # strided x
    assert cpu_ops.linear(torch.randn(1, 32, dtype=torch.float64), w.double()) is None
    assert cpu_ops.linear(torch.randn(0, 32), w) is None


def test_unquantized_linear_layer_uses_the_kernel_for_decode_rows(monkeypatch):
    from tokenmill.layers.linear import Linear
    layer = Linear(32, 24, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    calls = []
    real = cpu_ops.linear
    monkeypatch.setattr(cpu_ops, "linear", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(2, 32)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias),
                               rtol=1e-5, atol=1e-5)
    assert calls
    layer(torch.randn(cpu_ops.LINEAR_MAX_ROWS + 1, 32))   # prefill-sized: BLAS, not the kernel
    assert len(calls) == 1


@pytest.mark.parametrize("r,d", [(1, 1), (1, 15), (1, 576), (3, 49152), (2, 262147), (512, 576)])
def test_nonfinite_rows_flags_what_isfinite_does(r, d):
    """Every placement of a NaN / +inf / -inf (vector body, tail, both sides of a 16384-value
    span, first and last value), huge finite values and signed zeros, one row and many
    (large inputs are split over the threads)."""
    g = torch.Generator().manual_seed(r * 7 + d)
    x = torch.randn(r, d, generator=g) * 1e30
    assert cpu_ops.nonfinite_rows(x) is None
    spots = sorted({0, d - 1, d // 2, min(d - 1, 16383), min(d - 1, 16384), max(0, d - 9)})
    for row in range(r):
        if row % 3 == 1:
            continue                                       # some rows stay finite
        col = spots[row % len(spots)]
        x[row, col] = (float("nan"), float("inf"), float("-inf"))[(row // 2) % 3]
    x[-1, 0] = -0.0
    want = (~torch.isfinite(x).all(dim=-1)).tolist()
    got = cpu_ops.nonfinite_rows(x)
    assert (got or [False] * r) == want
    assert cpu_ops.nonfinite_rows(x[:1].contiguous()) == (want[:1] if want[0] else None)


@pytest.mark.parametrize("v", [1, 7, 8, 13, 4096, 262147])
def test_argmax_rows_answers_as_torch_argmax(v):
    """First maximum on ties, the first NaN where a row has one, -inf-only rows, signed zeros,
    and a tail past the last full vector."""
    g = torch.Generator().manual_seed(v)
    x = torch.randn(9, v, generator=g)
    x[1] = x[1].round()                                   # many ties
    x[2] = float("-inf")
    x[3, v // 2] = float("nan")
    x[3, -1] = float("nan")
    x[4] = 0.0
    x[4, v // 3] = -0.0
    x[5, -1] = 100.0                                      # the maximum in the tail
    x[6, :] = x[6, 0]                                      # every value equal
    x[7, v // 2:] = float("inf")
    if v > 1:
        x[8, 1] = float("nan")
        x[8, 0] = 1e30
    got = cpu_ops.argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))
    assert torch.equal(cpu_ops.argmax_rows(x[:1]), x[:1].argmax(dim=-1))
