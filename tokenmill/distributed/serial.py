"""The wire format between engine, workers and replicas: msgpack with a closed set of types.

Never pickle: a message can only rebuild the dataclasses registered here (by name), plus
None / bool / int / float / str / bytes / list / tuple / set / frozenset / dict. Anything
else fails to encode with a TypeError naming it, and an unknown type name fails to decode.
Dataclasses are rebuilt through their constructor, so their own validation runs again.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

_DATACLASS, _TUPLE, _SET, _FROZENSET = 1, 2, 3, 4
_REGISTRY: dict[str, type] = {}


def register(cls: type) -> type:
    """Allow ``cls`` (a dataclass) on the wire; usable as a decorator."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass")
    name = f"{cls.__module__}.{cls.__qualname__}"
    _REGISTRY[name] = cls
    return cls


def _default(obj: Any) -> msgpack.ExtType:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        name = f"{type(obj).__module__}.{type(obj).__qualname__}"
        if _REGISTRY.get(name) is not type(obj):
            raise TypeError(f"{name} is not registered for the wire (tokenmill.distributed.serial)")
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
        return msgpack.ExtType(_DATACLASS, _pack([name, fields]))
    if isinstance(obj, tuple):
        return msgpack.ExtType(_TUPLE, _pack(list(obj)))
    if isinstance(obj, frozenset):
        return msgpack.ExtType(_FROZENSET, _pack(sorted(obj, key=repr)))
    if isinstance(obj, set):
        return msgpack.ExtType(_SET, _pack(sorted(obj, key=repr)))
    raise TypeError(f"cannot send a {type(obj).__name__} over the wire")


def _ext_hook(code: int, data: bytes) -> Any:
    value = _unpack(data)
    if code == _DATACLASS:
        name, fields = value
        cls = _REGISTRY.get(name)
        if cls is None:
            raise ValueError(f"unknown type {name!r} on the wire")
        return cls(**fields)
    if code == _TUPLE:
        return tuple(value)
    if code == _SET:
        return set(value)
    if code == _FROZENSET:
        return frozenset(value)
    raise ValueError(f"unknown msgpack extension {code}")


def _pack(obj: Any) -> bytes:
    # strict_types: tuples and sets reach _default instead of turning into lists silently
    return msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False,
                           use_list=True)


def encode(obj: Any) -> bytes:
    return _pack(obj)


def decode(data: bytes) -> Any:
    return _unpack(data)


def _register_engine_types() -> None:
    from tokenmill import outputs
    from tokenmill.config import FaultRule, SpeculativeConfig
    from tokenmill.kv.layout import KVGroup, KVLayout
    from tokenmill.pooling_params import PoolingParams
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.sched import output as sched_output
    from tokenmill.structured.params import StructuredOutputsParams
    for cls in (SamplingParams, StructuredOutputsParams, SpeculativeConfig, FaultRule,
                sched_output.NewRequestData, sched_output.CachedRequestData,
                sched_output.GrammarBitmask,
                sched_output.SchedulerOutput, outputs.Logprob, outputs.ModelRunnerOutput,
                outputs.EngineCoreOutput, outputs.CompletionOutput, outputs.RequestOutput,
                PoolingParams, outputs.EmbeddingOutput, outputs.EmbeddingRequestOutput,
                KVGroup, KVLayout):
        register(cls)


_register_engine_types()
