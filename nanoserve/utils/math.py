def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of b hold a items."""
    return -(-a // b)


def token_slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The KV cache slots of positions start..end-1: position p goes to slot
    block_table[p // bs] * bs + p % bs, one range per block the positions touch."""
    slots = []
    for i in range(start // block_size, cdiv(end, block_size)):
        base = (block_table[i] - i) * block_size
        slots.extend(range(base + max(start, i * block_size),
                           base + min(end, (i + 1) * block_size)))
    return slots
