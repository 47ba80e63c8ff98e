import sys, collections
from tokenmill import LLM
from tokenmill.models.hub import resolve_model
from tokenmill.engine.stats import module_bytes
from tokenmill.layers.quant.qgemm import tiled_only_bytes
prec = sys.argv[2]
llm = LLM(model=resolve_model(sys.argv[1]), quantization="gguf" if prec == "gguf-q8" else None,
          quant_activations="q8" if prec == "gguf-q8" else "fp32", num_threads=1, skip_tokenizer_init=True, max_model_len=int(sys.argv[3]) if len(sys.argv) > 3 else 512)
m = llm.engine.executor.worker.runner.model
print("weight_bytes", llm.engine.weight_bytes/1e6, "module", module_bytes(m)/1e6, "tiled_only", tiled_only_bytes(m)/1e6)
seen = {}
for mn, mod in m.named_modules():
    for n, t in list(mod._parameters.items()) + list(mod._buffers.items()):
        if t is None or id(t) in seen: continue
        seen[id(t)] = (type(mod).__name__ + "." + n, t.numel() * t.element_size(), t.dtype)
c = collections.Counter()
for k, b, dt in seen.values(): c[(k, str(dt))] += b
for k, v in c.most_common(20): print(f"{v/1e6:9.3f} MB  {k}")
