"""oneDNN-prepacked float32 linears equal F.linear, are taken only for many-row matmuls,
step aside when stale or switched off, and the engine option reaches the model."""
import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers import cpu_ops, native, prepacked
from tokenmill.layers.linear import Linear

pytestmark = pytest.mark.skipif(not prepacked.available(), reason="torch built without oneDNN")


def _layer(n=300, k=96, bias=True, seed=0):
    torch.manual_seed(seed)
    layer = Linear(k, n, bias=bias)
    layer.weight.data.normal_()
    if bias:
        layer.bias.data.normal_()
    return layer


@pytest.mark.parametrize("rows", [1, 17, 64, 301])
@pytest.mark.parametrize("bias", [True, False])
def test_prepacked_linear_matches_f_linear(rows, bias):
    layer = _layer(bias=bias)
    assert prepacked.prepack_linears(layer) == layer.weight.numel() * 4
    x = torch.randn(rows, 2 * 96)[:, ::2]          # strided input is fine
    got = prepacked.linear(layer, x, layer.bias)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)


def test_layer_takes_prepacked_path_for_many_rows_only(monkeypatch):
    layer = _layer()
    prepacked.prepack_linears(layer)
    calls = []
    real = prepacked.linear
    monkeypatch.setattr(prepacked, "linear", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    layer(torch.randn(cpu_ops.LINEAR_MAX_ROWS, 96))       # decode rows: the streaming kernel
    x = torch.randn(cpu_ops.LINEAR_MAX_ROWS + 1, 96)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)
    assert calls == [cpu_ops.LINEAR_MAX_ROWS + 1] or (not cpu_ops.available() and len(calls) == 2)


def test_stale_or_switched_off_falls_back(monkeypatch):
    layer = _layer()
    prepacked.prepack_linears(layer)
    x = torch.randn(40, 96)
    layer.weight = torch.nn.Parameter(torch.randn(300, 96), requires_grad=False)   # replaced
    assert prepacked.linear(layer, x, layer.bias) is None
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)
    prepacked.prepack_linears(layer)
    assert prepacked.linear(layer, x, layer.bias) is not None
    assert prepacked.linear(layer, x.double(), None) is None
    cpu_ops.set_cpu_kernels(layer, False)   # the model's setting: plain F.linear, no copy read
    calls = []
    monkeypatch.setattr(prepacked, "linear", lambda *a: calls.append(1))
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)
    assert not calls


def test_only_float32_unquantized_linears_are_packed():
    from tokenmill.layers.quant.methods import Int8Method
    plain, quant = _layer(), _layer()
    quant.set_quant_method(Int8Method())
    quant.weight.data.normal_()
    quant.quant_method.process_weights_after_loading(quant)
    model = torch.nn.ModuleList([plain, quant, _layer().double()])
    assert prepacked.prepack_linears(model) == plain.weight.numel() * 4
    assert hasattr(plain, "prepacked") and not hasattr(quant, "prepacked")


def test_engine_option_packs_and_keeps_outputs(tiny_llama_dir):
    from tokenmill import LLM, SamplingParams
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 7 * i))} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    results = {}
    for flag in (True, False):
        llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, cpu_weight_prepack=flag)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[flag] = ([list(o.outputs[0].token_ids) for o in outs],
                         [o.outputs[0].cumulative_logprob for o in outs])
        packed_bytes = llm.get_memory_stats()["prepacked_weights"]
        assert (packed_bytes > 0) == flag
        assert hasattr(llm.engine.model.model.layers[0].mlp.down_proj, "prepacked") == flag
    assert results[True][0] == results[False][0]
    assert results[True][1] == pytest.approx(results[False][1], abs=1e-3)


def test_gradients_flow_through_a_prepacked_layer():
    """oneDNN's op has no backward: when autograd records the call the layer takes a
    differentiable path, so training through a frozen serving layer gets its gradients."""
    layer = _layer(bias=False)
    prepacked.prepack_linears(layer)
    x = torch.randn(cpu_ops.LINEAR_MAX_ROWS + 5, 96, requires_grad=True)
    layer(x).square().sum().backward()
    ref = x.detach().clone().requires_grad_(True)
    F.linear(ref, layer.weight.detach()).square().sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=1e-5, atol=1e-4)
    with torch.no_grad():   # no autograd: the prepacked path again
        assert prepacked.linear(layer, x, None) is not None


needs_bf16 = pytest.mark.skipif(not native.has_avx512_bf16(), reason="CPU without AVX-512 BF16")


@needs_bf16
@pytest.mark.parametrize("rows", [17, 64, 301])
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_copy_computes_the_bf16_rounded_product(rows, bias):
    """cpu_gemm_dtype bfloat16 on a weight the tiles do not take (300 outputs: N % 16):
    oneDNN's bf16 copy. Weights and activations rounded to bf16, products summed in fp32,
    the result rounded to bf16 (oneDNN's output has the input's dtype), bias added in fp32.
    The reference multiplies the rounded values in float64: within one bf16 step."""
    layer = _layer(bias=bias)
    assert prepacked.prepack_linears(layer, torch.bfloat16) == layer.weight.numel() * 2
    assert layer.prepacked[0] is not None and prepacked.bf16_tiles(layer) is None
    x = torch.randn(rows, 96)
    got = prepacked.linear(layer, x, layer.bias)
    assert got.dtype is torch.float32
    w16, x16 = layer.weight.bfloat16().double(), x.bfloat16().double()
    exact = (x16 @ w16.T).float()
    want = exact + (layer.bias if bias else 0.0)
    assert ((got - want).abs() <= 2 ** -8 * exact.abs() + 1e-4).all()   # half a bf16 step
    # and it is not the float32 product: the rounding is really there
    assert (got - F.linear(x, layer.weight, layer.bias)).abs().max() > 1e-4


def test_bf16_copy_is_refused_without_native_bf16(monkeypatch):
    monkeypatch.setattr(native, "has_avx512_bf16", lambda: False)
    with pytest.raises(ValueError, match="AVX-512 BF16"):
        prepacked.prepack_linears(_layer(), torch.bfloat16)


def test_unknown_gemm_dtype_is_a_clear_error():
    from tokenmill.config import ModelConfig
    with pytest.raises(ValueError, match="cpu_gemm_dtype"):
        ModelConfig(model="x", cpu_gemm_dtype="float16")


_BF16_CASES = [(rows, n, k) for rows in (1, 7, 8, 9, 15, 16, 17, 33, 40, 64, 65, 137)
               for n, k in ((16, 2), (48, 96), (80, 34))] \
    + [(rows, 16, 4096) for rows in (1, 17, 65, 137)]


@needs_bf16
@pytest.mark.parametrize("rows,n,k", _BF16_CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_tile_kernel_equals_its_reference(rows, n, k, bias, bf16_kernel):
    """tm_linear_bf16: x and W rounded to bf16 and float32 sums in the kernel's order, bit for
    bit: vdpbf16ps's one chain per output over the k pairs (odd product, then even), AMX's
    even and odd chains per 16 pairs (K % 32 == 0; K = 2 and 34 take vdpbf16ps there too).
    One and two 16-output tiles per block; rows in partial tiles, one panel and several (the
    AMX panel is 64 rows at K = 4096)."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = cpu_ops.linear_bf16(x, cpu_ops.bf16_tiles(w), b)
    assert torch.equal(got, cpu_ops.linear_bf16_reference(x, w, b, kernel=bf16_kernel))
    # the rounding of x and W is really there, and the sums are float32, not bf16
    assert (got - F.linear(x, w, b)).abs().max() > 1e-4
    assert not torch.equal(got, got.bfloat16().float())


@needs_bf16
def test_the_two_bf16_kernels_sum_in_different_orders(bf16_kernel):
    """The reference's two orders are not the same numbers (so the test above tells them
    apart), and the kernel that runs matches its own order only."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(64, 576, generator=g), torch.randn(32, 576, generator=g)
    got = cpu_ops.linear_bf16(x, cpu_ops.bf16_tiles(w))
    other = "amx" if bf16_kernel == "avx512" else "avx512"
    assert torch.equal(got, cpu_ops.linear_bf16_reference(x, w, kernel=bf16_kernel))
    assert not torch.equal(got, cpu_ops.linear_bf16_reference(x, w, kernel=other))


@needs_bf16
@pytest.mark.parametrize("k", [96, 4096])
def test_bf16_tile_rows_do_not_depend_on_the_batch(bf16_kernel, k):
    """A row's output is the same alone and among 63 others (the C stack's batches) or 199
    (a prefill chunk: rows in several panels: 64-row ones for vdpbf16ps, and for AMX at
    K = 4096)."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(200, k, generator=g), torch.randn(320, k, generator=g)
    tiles = cpu_ops.bf16_tiles(w)
    batch, prefill = cpu_ops.linear_bf16(x[:64], tiles), cpu_ops.linear_bf16(x, tiles)
    for i in (0, 9, 31, 63):
        assert torch.equal(cpu_ops.linear_bf16(x[i:i + 1], tiles), batch[i:i + 1])
        assert torch.equal(prefill[i:i + 1], batch[i:i + 1])
    for i in (64, 127, 128, 199):
        assert torch.equal(cpu_ops.linear_bf16(x[i:i + 1], tiles), prefill[i:i + 1])
    assert cpu_ops.bf16_tiles(torch.randn(300, k)) is None   # N % 16: no tiles


@needs_bf16
def test_bf16_mode_takes_the_tiles_at_every_row_count():
    """A layer whose outputs tile (N % 16 == 0): every row count (decode, batched decode and
    prefill alike) gives tm_linear_bf16's float32 sums; the tiles are its only bf16 copy (no
    oneDNN one)."""
    layer = _layer(n=320)
    assert prepacked.prepack_linears(layer, torch.bfloat16) == layer.weight.numel() * 2
    tiles = prepacked.bf16_tiles(layer)
    assert tiles is not None and prepacked.c_kernel_rows(layer) == cpu_ops.LINEAR_MAX_ROWS
    assert layer.prepacked[0] is None and prepacked.float_kernel_rows(layer) == 0
    for rows in (1, 16, 17, 64, 65, 301):
        x = torch.randn(rows, 96)
        assert torch.equal(layer(x), cpu_ops.linear_bf16(x, tiles, layer.bias))
        if rows == 65:
            assert torch.equal(layer(x), cpu_ops.linear_bf16_reference(x, layer.weight, layer.bias))
    x = torch.randn(1, 96)   # not the float32 kernel's bits
    assert not torch.equal(layer(x), cpu_ops.linear(x, layer.weight, layer.bias))
    layer.weight.data = layer.weight.data.clone()   # replaced after packing: no stale tiles
    assert prepacked.bf16_tiles(layer) is None


@needs_bf16
def test_decode_read_bytes_counts_bf16_tiles_once():
    """A decode step in bf16 mode streams tiles (2 bytes a value) instead of the float32
    weight: the floor's bytes take the tiles, once for a weight two layers share, and the
    float32 weight of a layer without tiles."""
    from tokenmill.engine.stats import decode_read_bytes
    tiled, shared, untiled = _layer(n=320), _layer(n=320, seed=1), _layer(n=300)
    model = torch.nn.ModuleList([tiled, shared, untiled])
    prepacked.prepack_linears(model, torch.bfloat16)
    assert prepacked.bf16_tiles(untiled) is None
    model.append(Linear(96, 320, bias=False))
    model[3].weight = shared.weight   # tied: the same tensor
    model[3].prepacked = shared.prepacked
    biases = (320 + 320 + 300) * 4
    assert decode_read_bytes(model) == 2 * (320 * 96 * 2) + 300 * 96 * 4 + biases
    assert decode_read_bytes(_layer()) == 300 * 96 * 4 + 300 * 4


@needs_bf16
def test_engine_bf16_gemms_stay_close_to_float32(tiny_llama_dir):
    """Prefill and decode take the bf16 tiles: logprobs of the same greedy tokens stay
    within bf16's rounding (measured up to 0.12 nats on this random tiny model, whose
    logits are flat; a broken GEMM is off by nats)."""
    from tokenmill import LLM, SamplingParams
    prompts = [{"prompt_token_ids": list(range(3 + i, 60 + 7 * i))} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, cpu_gemm_dtype=dtype)
        down = llm.engine.model.model.layers[0].mlp.down_proj
        assert down.prepacked[2] is getattr(torch, dtype)
        runs[dtype] = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(runs["float32"], runs["bfloat16"]):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        token = a.outputs[0].token_ids[0]
        assert token in first_b or b.outputs[0].token_ids[0] != token
        if token == b.outputs[0].token_ids[0]:
            assert first_b[token].logprob == pytest.approx(first_a[token].logprob, abs=0.25)


@needs_bf16
def test_bf16_copy_takes_batched_steps_past_sixteen_rows(monkeypatch, tiny_llama_dir):
    """With oneDNN's bf16 copy (a weight the tiles do not take: 300 outputs), up to 16 rows
    stay on the float32 kernel and more take the copy (the float kernel alone would take up
    to LINEAR_MAX_ROWS)."""
    from tokenmill import LLM
    from tokenmill.runner import fused_stack
    layer = _layer()
    prepacked.prepack_linears(layer, torch.bfloat16)
    assert prepacked.float_kernel_rows(layer) == prepacked.BF16_FLOAT_ROWS < cpu_ops.LINEAR_MAX_ROWS
    calls = []
    real = prepacked.linear
    monkeypatch.setattr(prepacked, "linear", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    layer(torch.randn(prepacked.BF16_FLOAT_ROWS, 96))
    layer(torch.randn(prepacked.BF16_FLOAT_ROWS + 1, 96))
    assert calls == [prepacked.BF16_FLOAT_ROWS + 1] or not cpu_ops.available()
    # the tiny model's outputs tile (N % 16 == 0): bf16 mode's steps of up to 64 rows stay in the C stack
    for dtype, rows in (("bfloat16", cpu_ops.LINEAR_MAX_ROWS), ("float32", cpu_ops.LINEAR_MAX_ROWS)):
        model = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, cpu_gemm_dtype=dtype).engine.model
        if cpu_ops.available():
            assert fused_stack.stack_plan(model).max_rows("fp32") == rows


@needs_bf16
def test_bf16_mode_frees_the_float_weight_and_reads_its_tiles_back():
    """free_float: a tiled layer keeps only its tiles; every path still computes: 2-D rows
    take the tiles, other shapes, switched-off kernels and autograd take the weight read
    back from them (the bf16-rounded values, exactly). A weight another module shares is
    kept; a weight set after the freeing is the layer's again (no stale tiles)."""
    from tokenmill.layers.cpu_ops import set_cpu_kernels
    layer = _layer(n=320)
    rounded = layer.weight.detach().bfloat16().float()
    prepacked.prepack_linears(layer, torch.bfloat16, free_float=True)
    assert "weight" not in layer._parameters and prepacked.tiles_only(layer)
    tiles = prepacked.bf16_tiles(layer)
    assert torch.equal(prepacked.dense_weight(layer), rounded)
    assert prepacked.tiles_only_bytes(layer) == tiles.nbytes == 320 * 96 * 2
    x = torch.randn(5, 96)
    assert torch.equal(layer(x), cpu_ops.linear_bf16(x, tiles, layer.bias))
    x3 = torch.randn(2, 3, 96)
    torch.testing.assert_close(layer(x3), F.linear(x3, rounded, layer.bias))
    set_cpu_kernels(layer, False)
    torch.testing.assert_close(layer(x), F.linear(x, rounded, layer.bias))
    set_cpu_kernels(layer, True)
    xg = torch.randn(4, 96, requires_grad=True)
    layer(xg).sum().backward()
    torch.testing.assert_close(xg.grad, rounded.sum(0).expand(4, 96))
    layer.weight = torch.nn.Parameter(torch.randn(320, 96), requires_grad=False)
    assert prepacked.bf16_tiles(layer) is None and not prepacked.tiles_only(layer)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)
    a, b = _layer(n=320), Linear(96, 320, bias=False)
    b.weight = a.weight   # tied: the other module reads the same tensor
    model = torch.nn.ModuleList([a, b])
    prepacked.prepack_linears(model, torch.bfloat16, free_float=True)
    assert a.weight is b.weight and prepacked.bf16_tiles(a) is not None
    assert not prepacked.tiles_only(a) and prepacked.tiles_only_bytes(model) == 0


@needs_bf16
def test_engine_bf16_mode_without_float_weights_keeps_its_outputs(monkeypatch, tiny_llama_dir):
    """bf16 mode frees every tiled linear's float32 weight (the tiny model's head is untied:
    it goes too): greedy tokens and logprobs are bit-identical to the same mode with the
    weights kept, prefill, batched and fused C decode alike; the weight accounting moves by
    exactly the freed float32 bytes."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.runner import fused_stack
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 9 * i))} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    runs = {}
    for free in (True, False):
        if not free:
            monkeypatch.setattr(prepacked, "free_float_weight", lambda module, holders: None)
        llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, cpu_gemm_dtype="bfloat16")
        model = llm.engine.model
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert all(prepacked.tiles_only(m) is free for m in linears)
        if free and cpu_ops.available():
            assert fused_stack.stack_plan(model).max_rows("fp32") == cpu_ops.LINEAR_MAX_ROWS
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[free] = ([o.outputs[0].token_ids for o in outs],
                      [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs],
                      llm.engine.weight_bytes, llm.engine.get_memory_stats()["model_weights"],
                      sum(prepacked.bf16_tiles(m).nbytes for m in linears))
    assert runs[True][:2] == runs[False][:2]
    tiles = runs[True][4]
    assert runs[True][3] == runs[False][3] - 2 * tiles      # float32: twice the tiles' bytes
    assert runs[True][2] == runs[False][2] - 2 * tiles + tiles


@needs_bf16
def test_bf16_mode_tied_embedding_reads_the_head_tiles(monkeypatch, tmp_path):
    """A tied model in bf16 mode keeps no float32 table: the embedding's rows are the head's
    tiles read back (the table rounded to bf16), and greedy tokens and logprobs equal the
    same mode with the float32 table kept but rounded to bf16; the weights shrink by the
    table's float32 bytes."""
    from tests.conftest import save_tiny_llama
    from tokenmill import LLM, SamplingParams
    from tokenmill.layers.quant.embedding import TiledEmbedding
    from tokenmill.runner import model_loader
    save_tiny_llama(tmp_path, tie_word_embeddings=True)
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 9 * i))} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    runs, tables = {}, []
    real_share = model_loader.share_tiled_head_with_embedding

    def share_and_watch(model):          # keeps a handle on the table the two shared
        tables.append(model.model.embed_tokens.weight)
        return real_share(model)
    monkeypatch.setattr(model_loader, "share_tiled_head_with_embedding", share_and_watch)
    for share in (True, False):
        if not share:
            def round_table(model):      # the rows TiledEmbedding gives, from a float32 table
                table = model.model.embed_tokens.weight.data
                table.copy_(table.to(torch.bfloat16).float())
                return False
            monkeypatch.setattr(model_loader, "share_tiled_head_with_embedding", round_table)
        llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, cpu_gemm_dtype="bfloat16")
        model = llm.engine.model
        embed, head = model.model.embed_tokens, model.lm_head
        assert isinstance(embed, TiledEmbedding) is share and prepacked.tiles_only(head) is share
        if share:
            assert tables[0].numel() == 0        # the float32 table's memory is gone
            ids = torch.tensor([[0, 17, 383], [5, 5, 200]])
            assert torch.equal(embed(ids), prepacked.dense_weight(head)[ids])
            with pytest.raises(IndexError):
                embed(torch.tensor([384]))
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[share] = ([o.outputs[0].token_ids for o in outs],
                       [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs],
                       llm.engine.get_memory_stats()["model_weights"])
    assert runs[True][:2] == runs[False][:2]
    assert runs[True][2] == runs[False][2] - 384 * 64 * 4
