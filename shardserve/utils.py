def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many size-`b` pieces hold `a` items."""
    return -(-a // b)
