"""Small helpers shared across tokenmill (stdlib only)."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)
