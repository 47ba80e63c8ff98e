"""tokenmill: an LLM inference and serving engine."""
from tokenmill.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name):
    # LLM pulls in torch and the model stack; import it lazily so `import tokenmill` is cheap.
    if name == "LLM":
        from tokenmill.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "PoolingParams", "RequestOutput", "CompletionOutput",
           "EmbeddingRequestOutput", "__version__"]
