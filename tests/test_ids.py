"""`moejax.ids.clip_host_ids`: the one clip of host ids behind eager calls, adapter ids and token ids."""

import jax.numpy as jnp
import numpy as np
import pytest

import moejax
from moejax.eager import host_ids
from moejax.ids import clip_host_ids
from moejax.lora import as_adapter_ids
from moejax.routing import as_token_ids

I32 = np.iinfo(np.int32)
HOSTILE = {
    "python": [2**64, -(2**70), 3, 2**31],
    "int64": np.array([2**40, -(2**40), 3, 2**31], np.int64),
    "uint64": np.array([2**64 - 1, 0, 3, 2**31], np.uint64),
    "uint8": np.array([255, 0, 3, 7], np.uint8),
    "int8": np.array([127, -128, 3, 7], np.int8),
}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_values_are_clipped_in_their_own_type_never_wrapped(kind):
    ids = HOSTILE[kind]
    exact = np.array([min(max(int(v), -1), 5) for v in np.asarray(ids, dtype=object)])
    got = clip_host_ids("ids", ids, -1, 5)
    assert got.dtype == np.int32 and got.shape == (4,)
    np.testing.assert_array_equal(got, exact)
    wide = clip_host_ids("ids", ids, int(I32.min), int(I32.max))
    np.testing.assert_array_equal(wide, [min(max(int(v), I32.min), I32.max) for v in np.asarray(ids, dtype=object)])


def test_the_three_callers_share_it():
    """Eager calls clip to int32's range (a uint8 array raised OverflowError there before), adapter ids to
    [-1, n], token ids to [-1, vocab_size] with hash routing; shapes kept, device arrays passed through."""
    ids = np.array([[255, 0], [3, 7]], np.uint8)
    np.testing.assert_array_equal(host_ids(ids), ids.astype(np.int32))
    np.testing.assert_array_equal(as_adapter_ids(ids, 4), [[4, 0], [3, 4]])
    cfg = moejax.MoEConfig.preset("deepseek_v4", hash_routing=True, vocab_size=50)
    np.testing.assert_array_equal(as_token_ids([[2**40, -9], [3, 7]], cfg), [[50, -1], [3, 7]])
    device = jnp.array([1, 2], jnp.uint32)
    assert host_ids(device) is device and as_adapter_ids(device, 4) is device and as_token_ids(device, cfg) is device
    assert host_ids(None) is None and as_adapter_ids(None, 4) is None and as_token_ids(None, cfg) is None
    assert clip_host_ids("ids", [], -1, 4).dtype == np.int32


@pytest.mark.parametrize(
    "bad,error",
    [([0.5, 1], TypeError), ([True, 1], TypeError), (np.array([1.0]), TypeError), ([[1, 2], [3]], ValueError)],
)
def test_bad_ids_name_the_argument(bad, error):
    with pytest.raises(error, match="adapter_ids"):
        clip_host_ids("adapter_ids", bad, -1, 4)
    assert host_ids(bad) is bad  # eager calls leave them to the entry point's own check
