"""The native CPU backend (moejax.backends.native, csrc/): every weight format x activation against a numpy oracle on
the dequantized weights, family samples through `moe_forward`, bit-identity of a row across batches, positions,
neighbours and thread counts, input errors raised in Python, the portable C++ variant, and the fallback when the
extension is absent."""

import functools
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native_inputs import ACTIVATIONS
from native_inputs import dense as _dense
from native_inputs import rows as _x
from native_inputs import slots as _slots
from oracles import assert_close, routed_sum

import moejax
from moejax import backends
from moejax import quantized as Q
from moejax.backends import native
from moejax.slots import Slots
from moejax.weights import ExpertWeights, FusedExpertWeights, PerExpert, to_layout

built = pytest.mark.skipif(not native.available(), reason="moejax._native_cpu is not built")

# (name, quantize options); H, I multiples of 32 for the group-wise formats, 160 = 128 + 32 (a partial FP8 block).
QUANTIZED = {
    "int8_g16": ("int8", {"group_size": 16}),
    "int8_channel_asym": ("int8", {"group_size": None, "symmetric": False}),
    "int4_g32": ("int4", {"group_size": 32}),
    "int4_g16_asym": ("int4", {"group_size": 16, "symmetric": False}),
    "fp8_block": ("fp8_block", {}),
    "mxfp4": ("mxfp4", {}),
    "nvfp4": ("nvfp4", {}),
}
DENSE = ("float32", "bfloat16", "float16")


# -- inputs -------------------------------------------------------------------------------------------------------


def _fused_per_expert(dense: ExpertWeights) -> PerExpert:
    """`to_layout(dense, "per_expert")` built on the host (the per-expert layout's FusedExpertWeights parts)."""
    a = {k: None if v is None else np.asarray(v) for k, v in dense.fields().items()}
    dtype = dense.gate.dtype
    parts = []
    for e in range(dense.num_experts):
        bias = None if "gate_bias" not in a else np.concatenate([a["gate_bias"][e], a["up_bias"][e]])
        parts.append(
            FusedExpertWeights(
                jnp.asarray(np.concatenate([a["gate"][e].T, a["up"][e].T]), dtype),
                jnp.asarray(a["down"][e].T, dtype),
                None if bias is None else jnp.asarray(bias, dtype),
                None if bias is None else jnp.asarray(a["down_bias"][e], dtype),
            )
        )
    return PerExpert(tuple(parts), ExpertWeights)


@functools.cache
def _quantized(key: str, E=6, H=160, I=96, bias=False):
    name, options = QUANTIZED[key]
    return Q.quantize_experts(_dense(E, H, I, bias=bias), Q.format_by_name(name, **options))


# -- formats x activations ----------------------------------------------------------------------------------------


@built
@pytest.mark.parametrize("dtype", DENSE)
def test_dense_formats_and_layouts_matchrouted_sum(dtype):
    E, H, I, T, K = 7, 45, 27, 6, 3  # odd H and I: vector tails on both axes
    dense = _dense(E, H, I, dtype, bias=True)
    x = _x(T, H)
    slots = _slots(T, K, E, 0, in_scale=True)
    layouts = {"stacked": dense, "per_expert": _fused_per_expert(dense)}
    for act_name, act in ACTIVATIONS.items():
        want = routed_sum(dense, x, slots, act)
        for layout, experts in layouts.items():
            got = native.routed_experts(experts, x, slots, act)
            assert_close(got, want, what=f"{dtype} {layout} {act_name}")


@built
@pytest.mark.parametrize("key", QUANTIZED)
def test_quantized_formats_match_dequantize_then_reference(key):
    T, K = 5, 3
    q = _quantized(key, bias=True)
    x = _x(T, 160)
    slots = _slots(T, K, 6, 1, in_scale=key == "fp8_block")
    per_expert = to_layout(q, "per_expert")
    for act_name, act in ACTIVATIONS.items():
        want = routed_sum(q, x, slots, act)
        assert_close(native.routed_experts(q, x, slots, act), want, what=f"{key} stacked {act_name}")
        if act_name == "gpt_oss":  # the per-expert layout reads the same arrays, one buffer per expert
            assert_close(native.routed_experts(per_expert, x, slots, act), want, what=f"{key} per-expert")


@built
@settings(max_examples=8)
@given(
    T=st.integers(1, 9),
    K=st.integers(1, 4),
    E=st.sampled_from([1, 3, 16, 256]),
    H=st.integers(1, 21),
    I=st.integers(1, 19),
    in_scale=st.booleans(),
    per_expert=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_dense_any_shape_matchesrouted_sum(T, K, E, H, I, in_scale, per_expert, seed):
    dense = _dense(E, H, I, seed=seed)
    experts = _fused_per_expert(dense) if per_expert else dense
    slots = _slots(T, K, E, seed, in_scale=in_scale)
    x = _x(T, H, seed)
    act = ACTIVATIONS["silu"]
    assert_close(native.routed_experts(experts, x, slots, act), routed_sum(dense, x, slots, act), what="hypothesis")


@built
def test_prefill_many_rows_matchesrouted_sum():
    E, H, I, T, K = 16, 33, 24, 300, 4
    dense = _dense(E, H, I, "bfloat16")
    x = _x(T, H)
    slots = _slots(T, K, E, 2)
    act = ACTIVATIONS["gelu_tanh"]
    got = jax.jit(lambda e, x, s: native.routed_experts(e, x, s, act))(_fused_per_expert(dense), x, slots)
    assert_close(got, routed_sum(dense, x, slots, act), what="prefill")


@built
def test_long_inputs_and_partial_strips_matchrouted_sum():
    """Segments split at kBlockIn (per-channel int8 over 288 inputs), 75 = 64 + 11 output columns (a partial strip
    and vector) and the prefill kernel's K blocks (556 inputs: 512 + 40 or 256 + 256 + 40, a tail of 4) against the
    oracle; rows alone (few-row kernel) bit-identical to the same rows in a batch (K-blocked kernel)."""
    T, K, E = 24, 2, 3
    act = ACTIVATIONS["silu"]
    int8 = Q.format_by_name("int8", group_size=None, symmetric=False)
    cases = {
        "int8_channel_asym": (Q.quantize_experts(_dense(E, 288, 75, bias=True), int8), 288),
        "float32_per_expert": (_fused_per_expert(_dense(E, 556, 21)), 556),
        "bfloat16_per_expert": (_fused_per_expert(_dense(E, 556, 21, "bfloat16")), 556),
    }
    run = jax.jit(lambda e, x, s: native.routed_experts(e, x, s, act))
    for name, (experts, H) in cases.items():
        x, slots = _x(T, H, 5), _slots(T, K, E, 5, skipped=False)
        got = np.asarray(run(experts, x, slots))
        stacked = _unfuse(experts) if isinstance(experts, PerExpert) else experts
        assert_close(got, routed_sum(stacked, x, slots, act), what=name)
        for t in (0, T - 1):
            alone = run(experts, x[t : t + 1], Slots(slots.indices[t : t + 1], slots.out_weight[t : t + 1]))
            np.testing.assert_array_equal(np.asarray(alone)[0], got[t], err_msg=f"{name} row {t}")


@built
@pytest.mark.parametrize("isa", ["best", "avx2"])
@pytest.mark.parametrize("dtype", DENSE)
@pytest.mark.parametrize("H, I", [(556, 40), (520, 41)])
def test_prefill_row_blocks_and_tiles_match_rows_alone_bit_for_bit(dtype, H, I, isa):
    """The many-row [out, in] kernel (packed tiles, register blocks of 6 rows, items of several tiles on one
    thread): expert e holds 7 + e rows (row blocks 6 + 1..5 and 6 + 6). Its AVX-512 form (K blocks of 512, tiles of
    8 outputs) and its 8-lane form (K blocks of 256, tiles of 16; `isa="avx2"`, the portable one where the CPU has
    no AVX2). H=556: K blocks 512 + 40 (256 + 256 + 40) and a tail of 4 (the chains end after the last block),
    I=40: tiles 8 x 5 (16 + 16 + 8), ending in the last block's tile calls; H=520: K blocks 512 + 8 (256 + 256 + 8),
    no tail, I=41: gate and up tiles 8 x 5 + 1 (16 + 16 + 9): an odd tile, a half pair on AVX-512; down's inputs a
    tail of 1, its last tile of 556 outputs 4. Every row equals the row alone (the few-row kernel) bit for bit, on
    one thread (wide items) and on all, and the oracle."""
    E = 6
    dense = _dense(E, H, I, dtype)
    experts = _fused_per_expert(dense)
    act = ACTIVATIONS["silu"]
    ids = np.repeat(np.arange(E, dtype=np.int32), 7 + np.arange(E))[np.random.default_rng(3).permutation(57)]
    slots = Slots(jnp.asarray(ids[:, None]), jnp.ones((ids.size, 1), jnp.float32))
    x = _x(ids.size, H, 13)
    run = jax.jit(lambda x, s, n: native.routed_experts(experts, x, s, act, max_threads=n), static_argnums=2)
    module = native._module()
    try:
        module.set_isa(isa)
        got = {n: np.asarray(run(x, slots, n)) for n in (1, 0)}
        alone = [
            np.asarray(run(x[t : t + 1], Slots(slots.indices[t : t + 1], slots.out_weight[t : t + 1]), 1))[0]
            for t in range(ids.size)
        ]
    finally:
        module.set_isa("best")
    assert_close(got[0], routed_sum(dense, x, slots, act), what=dtype)
    for t in range(ids.size):
        for n in (1, 0):
            np.testing.assert_array_equal(
                got[n][t], alone[t], err_msg=f"{dtype}: row {t} (expert {ids[t]}), {n} threads"
            )


@built
def test_special_codes_match_dequantize_then_reference():
    """Every e4m3 byte (subnormals exact, 0x7f/0xff NaN) as FP8 codes, and an e8m0 scale of 255 (NaN) in MXFP4: NaN
    where the dequantized reference has NaN, the oracle's values elsewhere."""
    T, K, E = 4, 2, 6
    act = ACTIVATIONS["silu"]
    x, slots = _x(T, 160, 7), _slots(T, K, E, 7, skipped=False)
    fp8 = _quantized("fp8_block")
    codes = np.random.default_rng(0).permutation(np.resize(np.arange(256, dtype=np.uint8), fp8.up_q.shape))
    e = int(slots.indices[0, 0])  # NaN codes only in an expert of row 0
    codes = np.where((codes & 0x7F == 0x7F) & (np.arange(E) != e)[:, None, None], 0x01, codes).astype(np.uint8)
    fp8 = type(fp8)(**{**fp8.fields(), "up_q": jnp.asarray(codes).view(jnp.float8_e4m3fn)})
    mx = _quantized("mxfp4")
    mx = type(mx)(**{**mx.fields(), "gate_scale": mx.gate_scale.at[e, 0, 3].set(255)})
    for name, experts in (("fp8", fp8), ("mxfp4", mx)):
        want = routed_sum(experts, x, slots, act)
        assert np.isnan(want).any() and not np.isnan(want).all(), name
        got = np.asarray(native.routed_experts(experts, x, slots, act))
        scale = float(np.nanmax(np.abs(want)))
        np.testing.assert_allclose(got, want, rtol=0, atol=3e-5 * max(1.0, scale), equal_nan=True, err_msg=name)


def _unfuse(per_expert: PerExpert) -> ExpertWeights:
    """The stacked `[in, out]` experts of `_fused_per_expert`'s parts (the oracle's form)."""
    parts = per_expert.parts
    I = parts[0].down_weight.shape[-1]
    gu = np.stack([np.asarray(p.gate_up_weight, np.float32) for p in parts])
    down = np.stack([np.asarray(p.down_weight, np.float32) for p in parts])
    f = lambda a: jnp.asarray(np.swapaxes(a, 1, 2))
    return ExpertWeights(f(gu[:, :I]), f(gu[:, I:]), f(down))


# -- families through moe_forward ---------------------------------------------------------------------------------


@built
@pytest.mark.parametrize(
    ("family", "fmt"),
    [("gpt_oss", "mxfp4"), ("llama4", "int4")],
)
def test_family_forward_matches_reference(family, fmt):
    cfg = moejax.MoEConfig.preset(family, hidden_size=64, intermediate_size=32)
    params = moejax.init_params(cfg, jax.random.key(3), layout="stacked")
    if fmt is not None:
        params = moejax.quantize(params, cfg, fmt, **({"group_size": 32} if fmt == "int4" else {}))
    params = moejax.params.with_experts_layout(params, "per_expert")
    x = _x(7, 64)
    assert moejax.chosen_impl(params, x, cfg) == "native"
    forward = jax.jit(moejax.moe_forward, static_argnames=("cfg", "impl"))
    got = forward(params, x, cfg, impl="native")
    want = forward(params, x, cfg, impl="reference")
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=1e-5)


@built
def test_grad_runs_through_the_reference_vjp():
    dense, act = _dense(4, 8, 6), ACTIVATIONS["silu"]
    x, slots = _x(2, 8), _slots(2, 2, 4, 0)
    loss = lambda x, impl: jnp.sum(backends.run_routed(impl, dense, x, slots, act) ** 2)
    np.testing.assert_allclose(jax.grad(loss)(x, "native"), jax.grad(loss)(x, "reference"), atol=1e-5, rtol=1e-5)


# -- batch invariance ---------------------------------------------------------------------------------------------


@built
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int4_g16_asym", "nvfp4"])
def test_row_bits_do_not_depend_on_batch_position_neighbours_or_threads(fmt):
    E, K = 16, 4
    if fmt in DENSE:
        H, I = 45, 27
        experts = _fused_per_expert(_dense(E, H, I, fmt))
    else:
        H, I = 160, 96
        experts = _quantized(fmt, E=E)
    act = ACTIVATIONS["silu"]
    run = jax.jit(lambda x, s, n: native.routed_experts(experts, x, s, act, max_threads=n), static_argnums=2)
    row = np.asarray(_x(1, H, 9))
    row_slots = _slots(1, K, E, 9, skipped=False)
    alone = np.asarray(run(row, row_slots, 0))[0]
    for T, pos, seed in ((2, 1, 0), (9, 4, 2), (130, 77, 4)):  # 130 rows: several row blocks per expert
        x = np.array(_x(T, H, 100 + seed))
        x[pos] = row[0]
        s = _slots(T, K, E, 100 + seed, skipped=False)
        idx, w = np.asarray(s.indices).copy(), np.asarray(s.out_weight).copy()
        idx[pos], w[pos] = row_slots.indices[0], row_slots.out_weight[0]
        for threads in (1, 0):
            got = np.asarray(run(x, Slots(jnp.asarray(idx), jnp.asarray(w)), threads))[pos]
            np.testing.assert_array_equal(got, alone, err_msg=f"T={T} pos={pos} threads={threads}")
    copies = Slots(jnp.repeat(row_slots.indices, 8, 0), jnp.repeat(row_slots.out_weight, 8, 0))
    got = np.asarray(run(np.repeat(row, 8, 0), copies, 0))  # 8 copies share one computed row per expert
    np.testing.assert_array_equal(got, np.broadcast_to(alone, got.shape), err_msg="8 copies")


@built
def test_copies_of_rows_are_found_in_linear_time():
    """The kernels compute bit-identical rows once per expert; they find a row's copies by a hash of its bytes, so
    the earlier rows examined grow linearly with T however many rows share an expert (a skewed prefill: every row
    on one expert)."""
    module = native._module()
    experts, act = _dense(2, 24, 8), ACTIVATIONS["silu"]
    run = jax.jit(lambda x, s: native.routed_experts(experts, x, s, act))
    for T in (64, 4096):
        slots = Slots(jnp.zeros((T, 1), jnp.int32), jnp.ones((T, 1), jnp.float32))
        before = module.rows_examined()
        run(_x(T, 24, T), slots).block_until_ready()
        assert module.rows_examined() - before <= 2 * T, f"T={T}"


@built
@settings(max_examples=12, deadline=None)
@given(T=st.integers(2, 40), K=st.integers(1, 4), distinct=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_copies_of_rows_with_any_routing_and_scale_give_the_row_alone(T, K, distinct, seed):
    """Rows drawn from a few distinct ones, with their own slots (an expert twice in a row, skipped ids, weight 0)
    and input scales from two values: each row's bits equal the row computed alone."""
    E, H = 5, 13
    experts, act = _dense(E, H, 7), ACTIVATIONS["gelu_tanh"]
    rng = np.random.default_rng(seed)
    x = np.asarray(_x(distinct, H, seed))[rng.integers(0, distinct, T)]
    s = _slots(T, K, E, seed, beyond=1)
    s = Slots(s.indices, s.out_weight, jnp.asarray(rng.choice(np.float32([0.5, 1.25]), (T, K))))
    run = jax.jit(lambda x, s: native.routed_experts(experts, x, s, act))
    got = np.asarray(run(x, s))
    for t in range(T):
        alone = run(x[t : t + 1], Slots(*(a[t : t + 1] for a in (s.indices, s.out_weight, s.in_scale))))
        np.testing.assert_array_equal(got[t], np.asarray(alone)[0], err_msg=f"row {t}")


@built
def test_a_prefills_call_buffers_are_freed_when_it_returns():
    """A call's h [P, I] and y [P, H] are kept for the next call while they hold at most the bound (decode, small
    batches), and freed when the call returns above it (a prefill's would stay resident for the process's life)."""
    module = native._module()
    bound = module.call_buffers()["retained_bound_bytes"]
    E, K, H, I = 4, 4, 256, 256
    experts, act = _dense(E, H, I), ACTIVATIONS["silu"]
    run = jax.jit(lambda x, s: native.routed_experts(experts, x, s, act))
    rng = np.random.default_rng(0)
    for T in (3, bound // (K * (H + I) * 4) + 64):  # the second: K distinct pairs a row, buffers above the bound
        idx = np.stack([rng.permutation(E) for _ in range(T)]).astype(np.int32)[:, :K]
        run(_x(T, H, T), Slots(jnp.asarray(idx), jnp.asarray(rng.uniform(0.1, 1, (T, K)), jnp.float32)))
        pool = module.call_buffers()
        assert native.retained_buffer_bytes() == pool["retained_bytes"] <= pool["idle_sets"] * bound
        if T == 3:
            kept = pool["retained_bytes"]
            assert kept >= T * K * (H + I) * 4  # the small call's set is kept
    assert pool["retained_bytes"] <= kept  # the large call's set is freed


# -- errors -------------------------------------------------------------------------------------------------------


@built
def test_bad_inputs_raise_in_python():
    experts = to_layout(_dense(4, 8, 6), "per_expert")
    x, slots, act = _x(2, 8), _slots(2, 2, 4, 0), ACTIVATIONS["silu"]
    with pytest.raises(ValueError, match="x must be"):
        native.routed_experts(experts, x[None], slots, act)
    with pytest.raises(ValueError, match="x must be float32"):
        native.routed_experts(experts, x.astype(jnp.int32), slots, act)
    with pytest.raises(ValueError, match="indices must be integer"):
        native.routed_experts(experts, x, Slots(slots.indices.astype(jnp.float32), slots.out_weight), act)
    with pytest.raises(ValueError, match="out_weight must be"):
        native.routed_experts(experts, x, Slots(slots.indices, slots.out_weight[:, :1]), act)
    with pytest.raises(ValueError, match="indices must be"):
        native.routed_experts(experts, x, Slots(slots.indices[:1], slots.out_weight[:1]), act)
    with pytest.raises(ValueError, match="gate_up_weight must be"):
        native.routed_experts(experts, _x(2, 9), slots, act)  # H of x is not the weights' H
    q = _quantized("int8_g16", E=4)
    bad = Q.quantize_experts(_dense(4, 160, 96), Q.format_by_name("int8", group_size=16))
    bad = type(bad)(**{**bad.fields(), "gate_q": bad.gate_q.astype(jnp.int8)})
    with pytest.raises(ValueError, match="gate_q must be uint8"):
        native.routed_experts(bad, _x(2, 160), slots, act)
    misaligned = PerExpert((*q.unstack().parts[:3], to_layout(_dense(1, 160, 96), "per_expert").parts[0]))
    with pytest.raises(ValueError, match="one format"):
        native.routed_experts(misaligned, _x(2, 160), slots, act)


@built
def test_unsupported_cases_raise_not_implemented():
    assert backends.candidates("auto", 3, 2)[0] == "native"
    # ragged_dot comes first for grouped calls but is chosen only in programs lowered for TPU/GPU
    assert next(name for name in backends.candidates("auto", 300, 2) if name != "ragged") == "native"


# -- the portable variant and the build without the extension ---------------------------------------------------


@pytest.fixture
def generic_isa():
    module = native._module()
    assert module.set_isa("generic") == "generic"
    yield
    module.set_isa("best")


@built
def test_portable_variant_matchesrouted_sum(generic_isa):
    act = ACTIVATIONS["gpt_oss"]
    for key in QUANTIZED:
        q = _quantized(key)
        x, s = _x(3, 160), _slots(3, 2, 6, 0, in_scale=True)
        assert_close(native.routed_experts(q, x, s, act), routed_sum(q, x, s, act), what=f"generic {key}")
    for dtype in DENSE:
        d = _dense(5, 19, 11, dtype)
        x, s = _x(4, 19), _slots(4, 2, 5, 0)
        for experts in (d, _fused_per_expert(d)):
            assert_close(native.routed_experts(experts, x, s, act), routed_sum(d, x, s, act), what=f"generic {dtype}")


def _has_avx512() -> bool:
    """Whether the AVX-512 variant can be chosen: the CPU has it and MOEJAX_NATIVE_ISA does not cap it below."""
    if os.environ.get("MOEJAX_NATIVE_ISA") in ("avx2", "generic"):
        return False
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.exists() else []
    return {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= set(flags)


@built
def test_set_isa_caps_the_variant_and_rejects_unknown_names():
    module = native._module()
    try:
        assert module.set_isa("generic") == "generic" == native.isa()
        assert module.set_isa("avx2") in ("avx2", "generic")
        assert module.set_isa("avx512") in ("avx512", "avx2", "generic")
        with pytest.raises(ValueError, match="set_isa: expected"):
            module.set_isa("avx1024")
    finally:
        module.set_isa("best")
    assert native.isa() == ("avx512" if _has_avx512() else native.isa())


def _every_code(experts, seed=0):
    """`experts` with uniformly random code bytes (every int8 / int4 / e2m1 code, a quantizer may never write
    some: symmetric int4's -8); FP8's NaN codes replaced by 0x01."""
    rng = np.random.default_rng(seed)
    fields = {}
    for name, v in experts.fields().items():
        if name.endswith("_q"):
            b = rng.integers(0, 256, v.shape, dtype=np.uint8)
            if v.dtype == jnp.float8_e4m3fn:
                b = np.where(b & 0x7F == 0x7F, 0x01, b).astype(np.uint8)
            v = jnp.asarray(b).view(v.dtype)
        fields[name] = v
    return type(experts)(**fields)


@built
@pytest.mark.skipif(not _has_avx512(), reason="this CPU has no AVX-512 (F, BW, DQ, VL)")
@pytest.mark.parametrize(
    "fmt", [*QUANTIZED, "int4_g32_asym_odd", "float32_in_out", "bfloat16_in_out", "fused", "fused_bfloat16"]
)
def test_avx512_variant_equals_the_avx2_variant_bit_for_bit(fmt):
    """The AVX-512 kernels take 16 lanes per instruction: in the [in, out] one-row kernel 16 columns (lanes are
    columns, each lane the AVX2 variant's chain), in the many-row [out, in] kernel two outputs' 8-lane chains side
    by side, in the few-row bfloat16 [out, in] kernel four outputs' chains split by parity. Every format, decode
    (one row), a small batch and a prefill (T=40: 16 rows per expert, the packed tiles, odd output counts 299 and
    601 in the dense ones), equal to the AVX2 variant's bits and close to the oracle. Sizes with odd vector counts
    where the format allows them (a last 8-column vector after the 16-column ones)."""
    E, K = 5, 2
    if fmt in ("float32_in_out", "bfloat16_in_out", "fused", "fused_bfloat16"):
        H, I = 601, 299
        experts = _dense(E, H, I, "bfloat16" if "bfloat16" in fmt else "float32")
        fused = fmt.startswith("fused")
        experts = _fused_per_expert(experts) if fused else experts
        reference = _unfuse(experts) if fused else experts
    else:
        H, I = (600, 328) if fmt in ("fp8_block", "int8_channel_asym") else (608, 352)
        if fmt == "int4_g32_asym_odd":
            experts = Q.quantize_experts(_dense(E, H, I), Q.format_by_name("int4", group_size=32, symmetric=False))
        else:
            experts = _quantized(fmt, E=E, H=H, I=I)
        experts = _every_code(experts)
        reference = experts
    act = ACTIVATIONS["silu"]
    module = native._module()
    run = jax.jit(lambda x, s: native.routed_experts(experts, x, s, act))
    for T, seed in ((1, 3), (1, 4), (6, 5), (40, 6)):
        x, slots = _x(T, H, seed), _slots(T, K, E, seed, skipped=False)
        got = {}
        try:
            for isa in ("avx2", "avx512"):
                assert module.set_isa(isa) == isa
                got[isa] = np.asarray(run(x, slots))
        finally:
            module.set_isa("best")
        np.testing.assert_array_equal(got["avx512"], got["avx2"], err_msg=f"{fmt} T={T}")
        assert_close(got["avx512"], routed_sum(reference, x, slots, act), what=f"{fmt} T={T}")


@built
@pytest.mark.skipif(native.isa() == "generic", reason="the portable variant is the only one this CPU runs")
@pytest.mark.parametrize("fmt", [*QUANTIZED, *DENSE, "fused"])
def test_the_portable_variant_on_x86_is_the_best_one_to_float32_rounding(fmt):
    """Built for x86-64 without FMA, the portable variant computes each multiply-add as a product then a sum (two
    roundings) where the AVX2 and AVX-512 variants fuse it (one): the same order of operations, so the results
    differ by float32 rounding only, in decode (one row), a small batch and a prefill (T=40, the packed tiles).
    (Where it is built with a fused multiply-add, aarch64, it uses it: tests/test_native_cross_compile.py.)"""
    E, K = 5, 2
    if fmt in (*DENSE, "fused"):
        H, I = 601, 299
        experts = _dense(E, H, I, "float32" if fmt == "fused" else fmt)
        experts = _fused_per_expert(experts) if fmt == "fused" else experts
    else:
        H, I = (600, 328) if fmt in ("fp8_block", "int8_channel_asym") else (608, 352)
        experts = _every_code(_quantized(fmt, E=E, H=H, I=I))
    act = ACTIVATIONS["gpt_oss"]
    module = native._module()
    run = jax.jit(lambda x, s: native.routed_experts(experts, x, s, act))
    for T, seed in ((1, 3), (6, 5), (40, 6)):
        x, slots = _x(T, H, seed), _slots(T, K, E, seed, in_scale=True, skipped=False)
        try:
            best = np.asarray(run(x, slots))
            assert module.set_isa("generic") == "generic"
            portable = np.asarray(run(x, slots))
        finally:
            module.set_isa("best")
        err = np.abs(portable - best).max() / np.abs(best).max()
        assert err <= 1e-5, f"{fmt} T={T}: {err}"


def test_without_the_extension_auto_runs_the_cpu_plans(monkeypatch):
    """As installed without a compiler (MOEJAX_NATIVE_BUILD=0): the import of moejax._native_cpu fails."""
    native._load.cache_clear()
    monkeypatch.setitem(sys.modules, "moejax._native_cpu", None)  # import raises ImportError
    try:
        assert not native.available() and native.isa() is None
        cfg = moejax.MoEConfig.preset("qwen3_moe", hidden_size=16, intermediate_size=8, num_experts=4, top_k=2)
        params = moejax.init_params(cfg, jax.random.key(0))
        x = _x(3, 16)
        assert "native" not in backends.candidates("auto", 3, cfg.top_k)
        assert moejax.chosen_impl(params, x, cfg) == "cpu_decode"
        with pytest.raises(NotImplementedError, match="not built"):
            native.routed_experts(params.experts, x, _slots(3, 2, 4, 0), ACTIVATIONS["silu"])
        monkeypatch.setenv("MOEJAX_NATIVE", "0")  # the run-time switch hides a built extension too
        monkeypatch.delitem(sys.modules, "moejax._native_cpu")
        native._load.cache_clear()
        assert not native.available()
    finally:
        native._load.cache_clear()


@built
def test_column_chunks_after_the_first_with_several_k_blocks_matchrouted_sum():
    """[in, out] kernels over several K blocks (544 inputs: 256 + 256 + 32) in column chunks after the first (down's
    544 outputs: chunks of 256 + 256 + 32; gate/up's 288: 256 + 32, a partial strip), where the next block's tile is
    prefetched and the totals of a chunk wait between K blocks; a row alone bit-identical to it in a batch."""
    E, K, T, H, I = 2, 2, 5, 544, 288
    act = ACTIVATIONS["silu"]
    run = jax.jit(lambda e, x, s: native.routed_experts(e, x, s, act))
    experts = _quantized("int4_g32", E=E, H=H, I=I)
    x, slots = _x(T, H, 7), _slots(T, K, E, 7, skipped=False)
    got = np.asarray(run(experts, x, slots))
    assert_close(got, routed_sum(experts, x, slots, act), what="int4_g32")
    alone = run(experts, x[2:3], Slots(slots.indices[2:3], slots.out_weight[2:3]))
    np.testing.assert_array_equal(np.asarray(alone)[0], got[2], err_msg="row 2 alone")


@built
@pytest.mark.parametrize("fmt", ["float32_in_out", "int8_channel_asym", "int8_g16", "int4_g32", "mxfp4"])
def test_one_row_experts_match_the_many_row_kernel_bit_for_bit(fmt):
    """An expert with one row runs the one-row [in, out] kernel (weight rows in address order, one or two per pass,
    the partial sums in memory, symmetric int offsets hoisted: int8's code - 128 by a sign flip), one with several
    rows the register-tile kernel: a row of a batch whose rows all share their experts equals the row alone bit for
    bit, and the oracle. H=544: K blocks 256 + 256 + 32; float32 [in, out] with H=45, I=27: odd segments and partial
    vectors at each row's end."""
    E, K, T = 3, 2, 5
    if fmt == "float32_in_out":
        H, I = 45, 27
        experts = _dense(E, H, I)
    else:
        H, I = 544, 96
        experts = _quantized(fmt, E=E, H=H, I=I)
    act = ACTIVATIONS["silu"]
    run = jax.jit(lambda x, s: native.routed_experts(experts, x, s, act))
    x = _x(T, H, 11)
    one = _slots(1, K, E, 11, skipped=False)
    slots = Slots(jnp.repeat(one.indices, T, 0), jnp.repeat(one.out_weight, T, 0))  # every row: the same experts
    got = np.asarray(run(x, slots))
    assert_close(got, routed_sum(experts, x, slots, act), what=fmt)
    for t in (0, 3):
        alone = np.asarray(run(x[t : t + 1], one))[0]
        np.testing.assert_array_equal(alone, got[t], err_msg=f"{fmt}: row {t} alone")


@built
@pytest.mark.parametrize(
    "fmt", ["float32_in_out", "int8_channel_asym", "int4_g16_asym", "int4_g32", "fp8_block", "nvfp4"]
)
def test_decode_whole_row_chunks_match_the_many_row_kernel_bit_for_bit(fmt):
    """Decode (every chosen expert one row) on one thread takes each projection's columns as one chunk (whole
    weight rows per item, moe_cpu.cc set_chunks); a batch whose rows share their experts takes 256-column chunks
    through the many-row kernel: the row alone equals its batch row bit for bit, and the oracle. Sizes past one
    256-column chunk and off every vector: float32 [in, out] H=601, I=299 (odd rows, partial vectors at each row's
    end); quantized H=544 (K blocks 256 + 256 + 32; down's 544 columns not a multiple of 64: the 4-bit formats' rows
    of 544 bytes one per pass, symmetric int4's offsets hoisted), I=352 (352-byte rows, two per pass); FP8 H=600,
    I=328 (odd vector counts: the one-row kernel decodes FP8 two vectors at a time, then one; partial blocks)."""
    E, K, T = 3, 2, 9  # 9 rows per expert: past kWideRowsPerExpert (8), the 256-column chunks
    if fmt == "float32_in_out":
        H, I = 601, 299
        experts = _dense(E, H, I)
    else:
        H, I = (600, 328) if fmt == "fp8_block" else (544, 352)
        experts = _quantized(fmt, E=E, H=H, I=I)
    act = ACTIVATIONS["silu"]
    x = _x(T, H, 5)
    one = _slots(1, K, E, 5, skipped=False)
    slots = Slots(jnp.repeat(one.indices, T, 0), jnp.repeat(one.out_weight, T, 0))
    got = np.asarray(jax.jit(lambda x, s: native.routed_experts(experts, x, s, act))(x, slots))
    assert_close(got, routed_sum(experts, x, slots, act), what=fmt)
    alone = jax.jit(lambda x, s: native.routed_experts(experts, x, s, act, max_threads=1))
    for t in (0, 8):
        np.testing.assert_array_equal(np.asarray(alone(x[t : t + 1], one))[0], got[t], err_msg=f"{fmt}: row {t}")
