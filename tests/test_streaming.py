"""How device streaming cuts a leaf into pieces."""

import pytest

from jaxoffload.optim.streaming import num_chunks


@pytest.mark.parametrize("elements, bytes_per_element, chunk_bytes, expected", [
    (1024, 8, 8 * 1024, 1),      # Fits whole.
    (1024, 8, 8 * 256, 4),       # Exactly four pieces.
    (1000, 8, 8 * 300, 4),       # ceil(1000 / 300) = 4 divides 1000.
    (1001, 8, 8 * 300, 7),       # 4, 5, 6 do not divide 7 * 11 * 13; 7 does.
    (22 * 2048 * 5632, 8, 16 * 2**20, 121),  # A stacked Llama MLP kernel: exactly 16 MiB pieces.
])
def test_pieces_divide_the_leaf_and_respect_the_budget(elements, bytes_per_element, chunk_bytes,
                                                       expected):
  count = num_chunks(elements, bytes_per_element, chunk_bytes)
  assert count == expected
  assert elements % count == 0
  assert elements // count * bytes_per_element <= chunk_bytes


def test_leaf_without_a_nearby_divisor_streams_whole():
  # 1009 is prime: no piece count between 4 and 16 divides it.
  assert num_chunks(1009, 8, 8 * 300) == 1
