"""The tiled q8 GEMM (AVX-512 VNNI or AVX2 build) against the plain-PyTorch q8 reference and
the streaming q8 kernel; both builds bit-identical; its load-time copies and where the
engine uses them."""
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers.quant import formats as F
from tokenmill.layers import native
from tokenmill.layers.quant import kernels, qgemm
from tokenmill.layers.quant.embedding import PackedEmbedding
from tokenmill.layers.quant.matmul import packed_linear, reference_linear

needs_kernel = pytest.mark.skipif(not native.buildable(), reason="no C compiler, or a CPU without AVX2")
needs_vnni = pytest.mark.skipif(not (native.has_vnni() and native.buildable()),
                                reason="the VNNI build needs AVX-512 VNNI")


def _packed(kind: str, n: int, k: int, seed: int) -> F.Packed:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if kind == "i8":          # per-channel: one group of K
        return F.quantize_int8(w)
    if kind in ("i8-g32", "i8-g16", "i8m-g32"):   # GGUF Q8_0 (float16 block scales) / Q6_K
        group = int(kind.split("-g")[1])          # (16 values) / Q5_K (with mins)
        q = F.quantize_int8(w)
        scales = torch.rand(n, k // group, generator=g) + 0.1
        mins = torch.randn(n, k // group, generator=g) if kind.startswith("i8m") else None
        return F.Packed("i8", q.qweight, scales.half() if kind == "i8-g32" else scales, mins, group, n, k)
    if kind in ("i5-g32", "i5m-g32"):   # GGUF Q5_0 (-16..15) / Q5_1, Q5_K (0..31 with mins)
        mins = torch.randn(n, k // 32, generator=g).half() if kind == "i5m-g32" else None
        lo = 0 if mins is not None else -16
        q = torch.randint(lo, lo + 32, (n, k), generator=g, dtype=torch.int8)
        return F.Packed("i8", q, (torch.rand(n, k // 32, generator=g) + 0.1).half(), mins, 32, n, k)
    group = int(kind.split("-g")[1])
    p = F.quantize_int4(w, group)
    if group == 32:           # GGUF Q4_1: float16 scales and mins
        p.scales, p.mins = p.scales.half(), p.mins.half()
    return p


def test_tile_layout_refuses_other_kinds():
    p = F.quantize_fp8(torch.randn(16, 64))
    assert not qgemm.applies(p)
    with pytest.raises(ValueError, match="int8 / int4"):
        qgemm.tile(p)


@needs_kernel
@pytest.mark.parametrize("kind", ["i8", "i8-g32", "i8-g16", "i8m-g32", "i5-g32", "i5m-g32", "i4-g32",
                                  "i4-g64", "i4-g128"])
@pytest.mark.parametrize("n,k", [(16, 128), (40, 256), (200, 384), (33, 1536)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 70])
def test_tiled_kernel_matches_q8_reference(kind, n, k, rows):
    """N not a multiple of 16 leaves the last tile part empty; rows past 8 take several passes."""
    p = _packed(kind, n, k, n + k + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    ref = reference_linear(x, p, activations="q8")
    got = qgemm.qgemm_q8(x, qgemm.tile(p))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-5 * ref.abs().max().item())


@pytest.mark.parametrize("kind", ["i8", "i8-g16", "i8m-g32", "i5-g32", "i5m-g32", "i4-g32", "i4-g64"])
@pytest.mark.parametrize("n", [16, 33, 200])
def test_tiles_give_back_the_stored_rows(kind, n):
    """The tiled copy can stand in for qweight: any rows (the last, partial tile included, in
    any order, repeated) read back bit for bit, and a part kept only tiled dequantizes the same."""
    p = _packed(kind, n, 128, n)
    tiled = qgemm.tile(p)
    rows = torch.tensor([n - 1, 0, 5, n - 1, n // 2, 15 % n], dtype=torch.int64)
    assert torch.equal(tiled.stored_rows(rows), p.qweight.index_select(0, rows))
    assert torch.equal(tiled.stored_rows(torch.arange(n)), p.qweight)
    only_tiled = F.Packed(p.kind, None, p.scales, p.mins, p.group_size, n, 128, tiled=tiled)
    assert torch.equal(F.dequantize_stored(only_tiled), F.dequantize_stored(p))
    assert torch.equal(only_tiled.stored(rows), p.qweight.index_select(0, rows))
    with pytest.raises(ValueError, match="neither qweight nor a tiled copy"):
        F.Packed(p.kind, None, p.scales, p.mins, p.group_size, n, 128).stored()


@needs_kernel
@pytest.mark.parametrize("kind", ["i8", "i8-g32", "i8-g16", "i8m-g32", "i5-g32", "i5m-g32", "i4-g32", "i4-g64"])
@pytest.mark.parametrize("n", [16, 33, 200])
def test_rows_read_from_the_tiles_equal_dequantize_stored(kind, n):
    """tm_tiled_rows (a tied embedding's rows): bit for bit what dequantize_stored makes of
    the stored values, float16 and float32 scales, with and without mins, any rows (the
    partial last tile, repeats); an id outside the vocabulary raises, nothing read."""
    p = _packed(kind, n, 128, 7 * n)
    p.tiled = qgemm.tile(p)
    rows = torch.tensor([n - 1, 0, 5, n - 1, n // 2, 15 % n], dtype=torch.int64)
    want = F.dequantize_stored(p).index_select(0, rows)
    assert torch.equal(qgemm.dequantized_rows(p, rows), want)
    only_tiled = F.Packed(p.kind, None, p.scales, p.mins, p.group_size, n, 128, tiled=p.tiled)
    assert torch.equal(PackedEmbedding(only_tiled)(rows.view(2, 3)), want.view(2, 3, 128))
    assert qgemm.dequantized_rows(p, rows[:0]).shape == (0, 128)
    for bad in (n, -1):
        with pytest.raises(IndexError):
            qgemm.dequantized_rows(p, torch.tensor([0, bad]))


@needs_kernel
@pytest.mark.parametrize("kind", ["i5-g32", "i5m-g32"])
def test_five_bit_tiles_compute_what_eight_bit_tiles_compute(kind):
    """int8 values of five bits take 5-bit tiles (5/8 of the values' bytes): the same integer
    block dots and float operations as their 8-bit tiles, so the same bits; one value out of
    range keeps a weight on 8-bit tiles."""
    p = _packed(kind, 40, 640, 2)
    five, eight = qgemm.tile(p), qgemm.tile(p, five_bit=False)
    assert five.kind & 7 == kernels.KIND_I5 and eight.kind & 7 == kernels.KIND_I8
    assert five.qw.numel() * 8 == eight.qw.numel() * 5
    x = torch.randn(11, 640) * 4
    for rows in (1, 4, 11):
        assert torch.equal(qgemm.qgemm_q8(x[:rows], five), qgemm.qgemm_q8(x[:rows], eight))
    wide = p.qweight.clone()
    wide[3, 17] = 31 if p.mins is None else 32        # one past the range
    assert qgemm.tile(F.Packed("i8", wide, p.scales, p.mins, 32, 40, 640)).kind & 7 == kernels.KIND_I8


@needs_kernel
@pytest.mark.parametrize("kind", ["i4-g32", "i5-g32", "i5m-g32"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_tiled_kernel_is_exact_at_the_largest_products(kind, sign):
    """Every weight at the top of its range and every activation rounding to +-127: the
    AVX2 build adds vpmaddubsw's int16 pair sums before widening them (8 of an i4 block, 4
    of an i5 one); at these values one more would overflow int16."""
    p = _packed(kind, 40, 256, 5)
    if kind == "i4-g32":
        p.qweight = F.pack_int4(torch.full((40, 256), 15, dtype=torch.uint8))
    else:
        p.qweight = torch.full((40, 256), 31 if p.mins is not None else 15, dtype=torch.int8)
    tiled = qgemm.tile(p)
    assert (tiled.kind & 7) == (kernels.KIND_I4 if kind == "i4-g32" else kernels.KIND_I5)
    for rows in (1, 3, 9, 16):   # one-pass tiles of one row, of several rows, half passes,
        x = torch.full((rows, 256), 2.5 * sign)   # then passes over an unpacked tile (AVX2)
        ref = reference_linear(x, p, activations="q8")
        torch.testing.assert_close(qgemm.qgemm_q8(x, tiled), ref, rtol=1e-5, atol=2e-5 * ref.abs().max().item())


@needs_kernel
def test_tiled_kernel_takes_zero_rows():
    t = qgemm.tile(_packed("i4-g32", 40, 64, 1))
    assert qgemm.qgemm_q8(torch.empty(0, 64), t).shape == (0, 40)


@needs_kernel
@pytest.mark.parametrize("kind", ["i8-g32", "i8-g16", "i8m-g32", "i5-g32", "i5m-g32", "i4-g32"])
def test_tiled_kernel_agrees_with_the_streaming_q8_kernel(kind):
    """Same integer block dots and scales: only the float summation order differs, and a row's
    result does not depend on the other rows of the call."""
    p = _packed(kind, 96, 576, 7)
    x = torch.randn(24, 576)
    stream = kernels.qmm_q8(x, kernels.KIND_I8 if p.kind == "i8" else kernels.KIND_I4, p.qweight,
                            p.scales, p.mins, p.group_size, p.out_features)
    tiled = qgemm.tile(p)
    got = qgemm.qgemm_q8(x, tiled)
    torch.testing.assert_close(got, stream, rtol=1e-5, atol=1e-5 * stream.abs().max().item())
    assert torch.equal(qgemm.qgemm_q8(x[5:6].contiguous(), tiled), got[5:6])   # batch invariant


@needs_kernel
@pytest.mark.parametrize("kind", ["i5-g32", "i5m-g32", "i4-g32", "i4-g64", "i4-g128"])
@pytest.mark.parametrize("rows", [12, 13, 16, 70])
def test_many_rows_give_each_row_the_bits_it_gets_alone(kind, rows):
    """From 13 rows on, the AVX2 build takes each int4 / int5 tile apart once and runs every
    pass over those bytes; 12 rows and fewer take the nibbles apart in each pass, one row
    streams the tile. Every row's output has the same bits either way."""
    p = _packed(kind, 41, 1536, rows)   # 41 rows: a part-filled last tile
    tiled = qgemm.tile(p)
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows)) * 4
    got = qgemm.qgemm_q8(x, tiled)
    for r in range(rows):
        assert torch.equal(qgemm.qgemm_q8(x[r:r + 1].contiguous(), tiled), got[r:r + 1]), r


@needs_kernel
def test_packed_linear_takes_the_tiles_only_with_q8_activations():
    p = _packed("i4-g32", 48, 256, 3)
    p.tiled = qgemm.tile(p)
    x = torch.randn(40, 256)
    q8 = packed_linear(x, p, activations="q8")
    assert torch.equal(q8, qgemm.qgemm_q8(x, p.tiled))
    fp32 = packed_linear(x, p, activations="fp32")          # float activations: no rounding
    torch.testing.assert_close(fp32, reference_linear(x, p), rtol=1e-4, atol=1e-4)
    assert not torch.equal(fp32, q8)


@needs_kernel
def test_engine_tiles_q8_linears_and_fuses_them(tiny_llama_dir):
    """quant_activations="q8" tiles every int8 linear at load (counted as prepacked weights)
    and the one-call decode stack reads the same tiles; without prepacking nothing is tiled,
    and the streaming q8 kernel taking every step (the 38-token prefill too) gives the same
    tokens and logprobs up to summation order."""
    from tokenmill.runner import fused_stack as llama_fused
    params = dict(temperature=0.0, max_tokens=8, logprobs=0)
    prompts = [{"prompt_token_ids": [1, 5, 9, 11, 3]}, {"prompt_token_ids": list(range(2, 40))}]
    q8 = LLM(model=tiny_llama_dir, quantization="int8", quant_activations="q8", skip_tokenizer_init=True)
    model = q8.engine.model
    parts = [p for m in model.modules() for p in getattr(m, "packed", [])]
    assert parts and all(p.tiled is not None for p in parts)
    # the tiles are the only copy: no qweight left, on the parts or as parameters
    assert all(p.qweight is None for p in parts)
    assert not [n for n, _ in model.named_parameters() if "qweight" in n]
    # what is held: the parameters and the tiles that replaced values
    from tokenmill.engine.stats import module_bytes
    assert q8.engine.weight_bytes == module_bytes(model) + sum(p.tiled.nbytes() for p in parts)
    # what a decode step streams (decode floors): the tiles and the norms, not the scales the
    # tiles hold again, the embedding table (a row a step) or the RoPE tables
    norms = sum(t.numel() * 4 for n, t in model.named_parameters() if n.endswith("norm.weight"))
    assert norms > 0
    assert q8.engine.decode_read_bytes == sum(p.tiled.nbytes() for p in parts) + norms
    assert q8.engine.decode_read_bytes < q8.engine.weight_bytes
    assert q8.get_memory_stats()["prepacked_weights"] >= sum(p.tiled.nbytes() for p in parts)
    plan = llama_fused.stack_plan(model)
    assert plan is not None
    fields = plan.linears.view(-1, llama_fused.DEC_FIELDS)
    assert (fields[fields[:, 0] != -2][:, 7] != 0).all()   # every part's tiled address passed
    plain = LLM(model=tiny_llama_dir, quantization="int8", quant_activations="q8",
                skip_tokenizer_init=True, cpu_weight_prepack=False)
    packed = [m for m in plain.engine.model.modules() if getattr(m, "packed", None)]
    assert all(p.tiled is None for m in packed for p in m.packed)
    for m in packed:   # the streaming q8 kernel at every row count: the same arithmetic
        m.quant_method.kernel_max_rows = 1 << 30
    a = q8.generate(prompts, SamplingParams(**params), use_tqdm=False)
    b = plain.generate(prompts, SamplingParams(**params), use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        lx = [next(iter(d.values())).logprob for d in x.outputs[0].logprobs]
        ly = [next(iter(d.values())).logprob for d in y.outputs[0].logprobs]
        assert abs(lx[0] - ly[0]) < 1e-4   # the prefill step: summation order only
        # later steps: a last-bit difference can move one activation across an int8
        # rounding boundary (seen: 0.025 nats at step 7 of 8)
        assert max(abs(u - v) for u, v in zip(lx, ly)) < 0.1
    # float activations over tiled-only weights: the modules read the values back from the
    # tiles (the C stack steps aside) and compute what the untiled model computes
    from tokenmill.layers.quant.methods import set_quant_activations
    set_quant_activations(model, "fp32")
    set_quant_activations(plain.engine.model, "fp32")
    assert plan.activations() is None
    c = q8.generate(prompts, SamplingParams(**params), use_tqdm=False)
    d = plain.generate(prompts, SamplingParams(**params), use_tqdm=False)
    assert [x.outputs[0].token_ids for x in c] == [y.outputs[0].token_ids for y in d]


@needs_vnni
@pytest.mark.parametrize("kind", ["i8", "i8-g32", "i8-g16", "i8m-g32", "i5-g32", "i5m-g32", "i4-g32", "i4-g64"])
def test_both_builds_are_bit_identical(kind, both_builds):
    """The VNNI build's one-instruction dot products sum the same exact integers in the same
    lanes as the AVX2 build's instruction pairs, then run the same float operations: the
    streaming kernel (qmm.c dot_u8s8) and the tiled one (qgemm.c) give identical bits. Rows
    1 and 3 take the AVX2 build's one-pass tiles (both halves of each block together), 13 its
    half-at-a-time passes."""
    p = _packed(kind, 41, 576, 11)   # 41 rows: a part-filled last half tile (AVX2)
    tiled = qgemm.tile(p)
    for m in (1, 3, 13):
        x = torch.randn(m, 576) * 5
        stream_outs, tiled_outs = [], []
        for lib in both_builds:
            y = torch.empty(m, 41)
            assert lib.tm_qmm_q8(x.data_ptr(), m, 576, p.qweight.data_ptr(), p.scales.data_ptr(),
                                 p.mins.data_ptr() if p.mins is not None else None, p.group_size, 41,
                                 kernels.kind_code(0 if p.kind == "i8" else 1, p.scales), y.data_ptr(), 2) == 0
            stream_outs.append(y)
            z = torch.empty(m, 41)
            assert lib.tm_qgemm_q8(x.data_ptr(), m, 576, tiled.kind, tiled.qw.data_ptr(), tiled.sc.data_ptr(),
                                   tiled.mn.data_ptr() if tiled.mn is not None else None,
                                   tiled.group_size, 41, z.data_ptr(), 2) == 0
            tiled_outs.append(z)
        assert all(torch.equal(stream_outs[0], y) for y in stream_outs[1:]), m
        assert all(torch.equal(tiled_outs[0], z) for z in tiled_outs[1:]), m
