"""Seeded random JSON schemas of the shapes users send (nested objects, enums, bounded
arrays, required fields, string patterns, anyOf), for timing grammar compilation."""
from __future__ import annotations

import random
import string

_PATTERNS = [r"^[a-z]{1,8}$", r"^\d{3}-\d{4}$", r"^[A-Z][a-z]+ [A-Z][a-z]+$",
             r"^(https?)://[a-z]+\.(com|org)$", r"^[A-F0-9]{8}$"]


def _name(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_lowercase + "_", k=rng.randint(2, 10)))


def _leaf(rng: random.Random) -> dict:
    kind = rng.randrange(7)
    if kind == 0:
        return {"type": "string", "maxLength": rng.randint(1, 40)}
    if kind == 1:
        return {"type": "string", "pattern": rng.choice(_PATTERNS)}
    if kind == 2:
        return {"enum": [_name(rng) for _ in range(rng.randint(2, 6))]}
    if kind == 3:
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 10**6)}
    if kind == 4:
        return {"type": "number"}
    if kind == 5:
        return {"type": "boolean"}
    return {"type": "string", "format": rng.choice(["date", "email", "uuid", "date-time"])}


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema; nested objects, arrays and anyOf down to depth 3."""
    props = {}
    for _ in range(rng.randint(1, 6)):
        roll = rng.random() if depth < 3 else 1.0
        if roll < 0.15:
            value = random_schema(rng, depth + 1)
        elif roll < 0.3:
            items = random_schema(rng, depth + 1) if rng.random() < 0.5 else _leaf(rng)
            value = {"type": "array", "items": items, "minItems": rng.randint(0, 2),
                     "maxItems": rng.randint(2, 8)}
        elif roll < 0.38:
            value = {"anyOf": [_leaf(rng), _leaf(rng)]}
        else:
            value = _leaf(rng)
        props[_name(rng)] = value
    required = [k for k in props if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}
