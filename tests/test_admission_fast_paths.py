"""A long prompt's admission converts its tokens once, through numpy, with the same results as the item by
item code it replaced: prefix chain hashes (kv/prefix_hash.py `token_array`) and the request's token list
(request_table.py `_token_list`)."""
import random

import numpy as np
import pytest

from stratum_jax.config import PAGE_SIZE_CLASSES
from stratum_jax.kv.prefix_hash import iter_chain_hashes, prompt_chain_hashes, token_array
from stratum_jax.request_table import _token_list


def _tokens(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(0, 128256) for _ in range(n)]


def test_chain_hashes_over_the_array_equal_those_over_the_list():
    tokens = _tokens(1000)
    ids = token_array(tokens)
    assert ids.dtype == np.int32 and ids.tolist() == tokens
    assert token_array(ids) is ids                      # already converted: no copy
    for ps in PAGE_SIZE_CLASSES:
        pages = (len(tokens) - 1) // ps
        assert list(iter_chain_hashes(ids, ps, pages)) == list(iter_chain_hashes(tokens, ps, pages))
    by_list = {ps: list(iter_chain_hashes(tokens, ps, (len(tokens) - 1) // ps)) for ps in PAGE_SIZE_CLASSES}
    assert prompt_chain_hashes(tokens) == by_list
    # A different token changes every hash from its page on, in the array path too.
    other = list(tokens)
    other[300] += 1
    a, b = prompt_chain_hashes(tokens)[256], prompt_chain_hashes(other)[256]
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]


@pytest.mark.parametrize("given", [
    [5, 0, 7], (5, 0, 7), np.array([5, 0, 7], np.int64), np.array([5, 0, 7], np.uint16),
    [np.int32(5), 0, 7],                      # numpy scalars in a list
    [5.0, 0.9, 7.2],                          # floats truncate, as int() does
    [True, False],                            # bools are ints to int()
    iter([5, 0, 7]),                          # an iterator is read once
    [2**64 - 1], [-1, 2**70],                 # out of range: left for the range check
    [],
])
def test_token_list_matches_the_item_by_item_conversion(given):
    expect = [int(t) for t in (list(given) if not isinstance(given, type(iter([]))) else [5, 0, 7])]
    got = _token_list(given)
    assert got == expect and all(type(t) is int for t in got)


def test_token_list_refuses_what_int_refuses():
    with pytest.raises(ValueError):
        _token_list(["five"])
    with pytest.raises(TypeError):
        _token_list([[1, 2]])
