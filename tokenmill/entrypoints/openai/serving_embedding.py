"""POST /v1/embeddings: one vector per input, pooled from the model's final normed hidden
states by the engine itself (prompt-only requests, batched and chunked with generation).

Pooling is "mean" over the prompt positions or the "last" position's state: the request's
``pooling`` field, else the server's ``--pooling-type``. Vectors are L2-normalised unless
``normalize`` is false. ``dimensions`` must equal the model's hidden size (truncated,
Matryoshka-style embeddings are refused with a 400)."""
from __future__ import annotations

import base64
import struct
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.engine.async_engine import RequestHandle
from tokenmill.entrypoints.openai.errors import bad_request
from tokenmill.entrypoints.openai.protocol import EmbeddingRequest
from tokenmill.entrypoints.openai.serving_common import ClientDisconnected, ServingBase, new_id
from tokenmill.outputs import EmbeddingRequestOutput
from tokenmill.pooling_params import PoolingParams

_MAX_INPUTS = 2048   # OpenAI's limit per request


def normalize_inputs(inputs, max_inputs: int) -> list:
    """str | [str] | [int] | [[int]] -> engine prompts (str or token-id dict), none empty."""
    if isinstance(inputs, str):
        inputs = [inputs]
    elif inputs and all(isinstance(t, int) for t in inputs):
        inputs = [list(inputs)]
    if not inputs:
        raise bad_request("input must not be empty", "input")
    if len(inputs) > max_inputs:
        raise bad_request(f"at most {max_inputs} inputs per request, got {len(inputs)}", "input")
    if any(len(p) == 0 for p in inputs):
        raise bad_request("input must not contain empty strings or empty token lists", "input")
    return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in inputs]


def encode_embedding(vector: list[float], encoding_format: str):
    """The vector as a JSON list, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


class EmbeddingServing(ServingBase):
    def __init__(self, engine, model_name: str, metrics, pooling_type: str = "mean") -> None:
        super().__init__(engine, model_name, metrics)
        PoolingParams(pooling_type=pooling_type)   # a bad server default fails at start-up
        self.pooling_type = pooling_type

    async def create(self, req: EmbeddingRequest, request: Request) -> Response:
        self.check_model(req.model)
        max_inputs = min(_MAX_INPUTS, self.engine.max_pending or _MAX_INPUTS)
        prompts = normalize_inputs(req.input, max_inputs)
        params = self._pooling_params(req)
        request_id = new_id("embd")
        handles = await self.start(prompts, params, request_id, req, "input")
        try:
            finals = await self.collect(request, handles)
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(self._response(req, finals))

    def _pooling_params(self, req: EmbeddingRequest) -> PoolingParams:
        # the body's fields are validated already (pydantic): this cannot raise
        return PoolingParams(pooling_type=req.pooling or self.pooling_type,
                             normalize=req.normalize, dimensions=req.dimensions)

    def finish(self, handles: list[RequestHandle],
               finals: list[Optional[EmbeddingRequestOutput]]) -> None:
        for handle, out in zip(handles, finals):
            handle.close()
            self.metrics.on_request_done(handle, [out.finish_reason if out else "abort"])

    def _response(self, req: EmbeddingRequest, finals: list[EmbeddingRequestOutput]) -> dict:
        data = [{"object": "embedding", "index": i,
                 "embedding": encode_embedding(out.outputs.embedding, req.encoding_format)}
                for i, out in enumerate(finals)]
        num_tokens = sum(len(out.prompt_token_ids) for out in finals)
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
