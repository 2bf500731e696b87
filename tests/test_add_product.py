"""``Parameter.add_product``: ``grad += a @ b``, written straight into the gradient only
while it is known to be zero, and always the same values as the ``+=``."""

import numpy as np
import pytest

from hpctrain.nn.module import Parameter


@pytest.fixture
def ab():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((5, 7)).astype(np.float32),
            rng.standard_normal((7, 3)).astype(np.float32))


def test_an_unallocated_gradient_becomes_the_product(ab):
    a, b = ab
    p = Parameter(np.ones((5, 3), np.float32))
    p.add_product(a, b)
    assert p.grad.dtype == np.float32 and np.array_equal(p.grad, a @ b)


def test_after_zero_grad_the_product_is_written_into_the_same_array(ab):
    a, b = ab
    p = Parameter(np.ones((5, 3), np.float32))
    buffer = p.grad  # allocated
    buffer += 5.0
    p.zero_grad()
    p.add_product(a, b)
    assert p.grad is buffer  # written in place: a view into a bucket stays one
    assert np.array_equal(buffer, np.zeros((5, 3), np.float32) + a @ b)


def test_a_second_product_adds(ab):
    a, b = ab
    p = Parameter(np.ones((5, 3), np.float32))
    p.zero_grad()
    p.add_product(a, b)
    p.add_product(a, b)
    want = np.zeros((5, 3), np.float32)
    want += a @ b
    want += a @ b
    assert np.array_equal(p.grad, want)


def test_anything_that_read_the_gradient_makes_the_product_add(ab):
    a, b = ab
    p = Parameter(np.ones((5, 3), np.float32))
    p.grad.fill(0)  # allocated
    p.zero_grad()
    p.grad += 2.0  # another writer (it reads grad first)
    p.add_product(a, b)
    assert np.array_equal(p.grad, np.full((5, 3), 2.0, np.float32) + a @ b)


def test_a_gradient_assigned_by_a_wrapper_is_added_to(ab):
    a, b = ab
    p = Parameter(np.ones((5, 3), np.float32))
    p.zero_grad()
    flat = np.full(15, 3.0, np.float32)
    p.grad = flat.reshape(5, 3)  # a view into a bucket, holding something
    p.add_product(a, b)
    assert np.array_equal(p.grad, np.full((5, 3), 3.0, np.float32) + a @ b)


def test_a_non_contiguous_gradient_adds_as_before(ab):
    a, b = ab
    p = Parameter(np.ones((5, 3), np.float32))
    p.grad = np.zeros((3, 5), np.float32).T  # zeros, but not C-contiguous
    p.zero_grad()
    p.add_product(a, b)
    assert np.array_equal(p.grad, a @ b)
