"""The numeric codes (`pallas_kernels.codecs`): every byte value of each code against ml_dtypes' own type, the host
(numpy) and traced (jnp) forms equal, and the formats and the kernels decoding through the same functions."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from moejax import quantized as Q
from pallas_kernels import codecs
from pallas_kernels import quantized_weights as K

BYTES = np.arange(256, dtype=np.uint8)
NIBBLES = np.arange(16, dtype=np.uint8)


def _both(decode, codes):
    """`decode` on the host and traced: the host result (numpy), after checking both are float32 and equal,
    NaN for NaN and signed zeros by sign."""
    host, traced = decode(codes), decode(jnp.asarray(codes))
    assert isinstance(host, np.ndarray) and host.dtype == np.float32 and traced.dtype == jnp.float32
    traced = np.asarray(traced)
    np.testing.assert_array_equal(traced, host)
    np.testing.assert_array_equal(np.signbit(traced[~np.isnan(traced)]), np.signbit(host[~np.isnan(host)]))
    return host


def _assert_same_values(got, want):
    np.testing.assert_array_equal(got, want)  # NaN where want has NaN
    np.testing.assert_array_equal(np.signbit(got[~np.isnan(want)]), np.signbit(want[~np.isnan(want)]))


@pytest.mark.parametrize("dtype", [np.uint8, np.int32])
def test_e2m1_every_code(dtype):
    want = NIBBLES.view(ml_dtypes.float4_e2m1fn).astype(np.float32)  # -0.0 at code 8
    _assert_same_values(_both(codecs.e2m1_to_f32, NIBBLES.astype(dtype)), want)
    _assert_same_values(codecs.E2M1_VALUES, want)


def test_e8m0_every_byte_and_255_is_nan_everywhere():
    """OCP MX: 0xFF is NaN. The kernels must decode it as NaN, as the formats do."""
    want = BYTES.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    assert np.isnan(want[255]) and want[0] == np.float32(2.0**-127)
    _assert_same_values(_both(codecs.e8m0_to_f32, BYTES), want)
    _assert_same_values(np.asarray(K.scale_to_f32("mxfp4", jnp.asarray(BYTES))), want)  # the kernels' path
    _assert_same_values(np.asarray(Q.e8m0_to_f32(jnp.asarray(BYTES))), want)  # the formats' path


def test_e4m3_every_byte_as_bytes_and_as_float8():
    fp8 = BYTES.view(ml_dtypes.float8_e4m3fn)
    want = fp8.astype(np.float32)  # NaN at 0x7F and 0xFF, -0.0 at 0x80
    assert np.isnan(want[[0x7F, 0xFF]]).all() and np.isnan(want).sum() == 2
    _assert_same_values(_both(codecs.e4m3_to_f32, BYTES), want)
    _assert_same_values(_both(codecs.e4m3_to_f32, fp8), want)
    _assert_same_values(np.asarray(K.scale_to_f32("nvfp4", jnp.asarray(fp8))), want)  # NVFP4 block scales
    _assert_same_values(np.asarray(K.decode_codes("fp8_block", jnp.asarray(fp8), None)[0]), want)  # FP8 weights


def test_the_formats_and_the_kernels_share_one_decoder_per_code():
    assert Q.e2m1_to_f32 is codecs.e2m1_to_f32 and Q.e8m0_to_f32 is codecs.e8m0_to_f32
    assert Q.pack_nibbles is codecs.pack_nibbles and Q.unpack_nibbles is codecs.unpack_nibbles
    assert K.e2m1_to_f32 is codecs.e2m1_to_f32 and K.e8m0_to_f32 is codecs.e8m0_to_f32
    assert K.e4m3_to_f32 is codecs.e4m3_to_f32
    # the kernels' 4-bit decode: the low nibble is the even element, values from the e2m1 table
    even, odd = K.decode_codes("mxfp4", jnp.asarray(BYTES), None)
    np.testing.assert_array_equal(even, codecs.E2M1_VALUES[BYTES & 15])
    np.testing.assert_array_equal(odd, codecs.E2M1_VALUES[BYTES >> 4])


def test_nibble_packing_round_trip_on_host_and_traced():
    codes = np.random.default_rng(0).integers(0, 16, (4, 6, 8), dtype=np.uint8)
    for axis in (0, 1, -1):
        packed = codecs.pack_nibbles(codes, axis=axis)
        n = codes.shape[axis]
        assert packed.dtype == np.uint8 and packed.shape[axis] == n // 2
        even, odd = np.take(codes, np.arange(0, n, 2), axis=axis), np.take(codes, np.arange(1, n, 2), axis=axis)
        np.testing.assert_array_equal(packed, even | (odd << 4))  # element 2j in the low nibble of byte j
        np.testing.assert_array_equal(codecs.unpack_nibbles(packed, axis=axis), codes)
        low, high = codecs.split_nibbles(packed)
        np.testing.assert_array_equal(low, even)
        np.testing.assert_array_equal(high, odd)
    # traced, along the axis the formats pack (`[E, in, out]`: in)
    np.testing.assert_array_equal(codecs.pack_nibbles(jnp.asarray(codes), axis=1), codecs.pack_nibbles(codes, axis=1))
    np.testing.assert_array_equal(codecs.unpack_nibbles(jnp.asarray(packed), axis=-1), codes)
