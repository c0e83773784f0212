def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of b hold a items."""
    return -(-a // b)
