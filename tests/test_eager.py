"""Eager (non-jit) calls of the public entry points compile once, do not leak, and cost about what the jitted
call costs: the plans' loops trace bodies that close over the call's arrays, so an eager call that traced anew
would compile new programs every time (~0.2-0.4 s on one device, 5-20 s for `moe_forward_ep` on 8) and grow RSS
by several MB per call.

Compiles are counted with jax's monitoring event for backend compiles (every XLA program compiled, the eager
op-by-op ones included); `test_compile_counter_sees_compiles` checks that the counter does see them.
"""

import contextlib
import functools
import gc

import jax
import jax.numpy as jnp
import numpy as np
import psutil
import pytest
from flax import nnx

import moejax
from moejax import dispatch, parallel, sharding
from moejax.lora import ExpertLoRA, LoRAPair

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"  # every jaxpr traced for a jit, eager ops' included
CALLS = 100
MAX_PROGRAMS = 2  # over CALLS eager calls on one shape, the first included
MAX_RSS_GROWTH = 20 * 2**20  # bytes, over CALLS eager calls after a warm-up call
TIMED = 20

SMALL = {"hidden_size": 32, "intermediate_size": 16}


@contextlib.contextmanager
def counted_compiles():
    """Yields a list that collects the name of every program XLA compiles inside the block."""
    with counted_events(BACKEND_COMPILE_EVENT) as names:
        yield names


@contextlib.contextmanager
def counted_events(*events: str):
    """Yields a list that collects the function name of every monitoring event of `events` inside the block."""
    names: list[str] = []

    def listen(event: str, _duration: float, **kwargs) -> None:
        if event in events:
            names.append(kwargs.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def assert_eager_calls_are_cached(call) -> None:
    """CALLS calls of `call()` compile at most MAX_PROGRAMS programs and grow RSS by less than MAX_RSS_GROWTH
    after the first call. Fails at the first call past the compile budget."""
    with counted_compiles() as compiles:
        jax.block_until_ready(call())
        rss = _rss()
        for i in range(1, CALLS):
            jax.block_until_ready(call())
            assert len(compiles) <= MAX_PROGRAMS, f"after {i + 1} eager calls: {len(compiles)} compiles {compiles[:8]}"
        growth = _rss() - rss
    assert growth < MAX_RSS_GROWTH, f"RSS grew by {growth / 2**20:.1f} MB over {CALLS - 1} eager calls"


def assert_eager_about_as_fast(eager, jitted) -> None:
    """After a warm-up call each, TIMED calls of `eager()` trace and compile nothing, as TIMED calls of `jitted()`:
    an eager call costs the cached jit's dispatch and no more. Counted by jax's monitoring events, not timed: a
    bound of 5x the jitted call's min time failed under the suite's load (eager 0.57 ms vs jitted 0.09 ms in a
    clean CI run; 0.2-0.4 s per eager call where every call traces and compiles)."""
    jax.block_until_ready((eager(), jitted()))
    with counted_events(TRACE_EVENT, BACKEND_COMPILE_EVENT) as work:
        for _ in range(TIMED):
            jax.block_until_ready((eager(), jitted()))
    assert not work, f"{len(work)} traces / compiles over {TIMED} warmed-up calls: {work[:8]}"


@functools.cache
def _config_params(**overrides):
    cfg = moejax.MoEConfig.preset("qwen3_moe", **SMALL, **overrides)
    return cfg, moejax.init_params(cfg, jax.random.key(0), jnp.float32, layout="stacked")


def _setup(T: int = 4, **overrides):
    """Config, stacked params (shared by the tests: their random init compiles programs too) and x `[T, H]`."""
    cfg, params = _config_params(**overrides)
    x = jnp.asarray(np.random.default_rng(T).standard_normal((T, cfg.hidden_size), np.float32))
    return cfg, params, x


def test_compile_counter_sees_compiles():
    """The counter is not vacuous: a new program is one compile, its second call none."""
    f, v = jax.jit(lambda v: v * 3.0 + 1.0), jnp.ones(3)
    with counted_compiles() as compiles:
        f(v).block_until_ready()
        f(v).block_until_ready()
    assert compiles == ["jit(<lambda>)"]


@pytest.mark.parametrize("impl,T", [("auto", 4), ("reference", 4), ("xla_grouped", 12)])
def test_eager_moe_forward_is_cached(impl, T):
    """The XLA plans' loops ("auto" runs the decode plan on stacked experts), the reference's scan, and
    statistics (on the grouped plan). The CPU plans: `test_eager_layer_call_is_cached`."""
    cfg, params, x = _setup(T)
    stats = impl == "xla_grouped"
    assert_eager_calls_are_cached(lambda: moejax.moe_forward(params, x, cfg, impl=impl, return_stats=stats))


def test_eager_moe_forward_with_host_ids_is_cached():
    """Host (numpy int64) token and adapter ids are converted before the cache: one program, and an id past int32
    still clamps (hash routing: the last row of the table; LoRA: no adapter) instead of wrapping."""
    cfg, params, x = _setup(T=3, hash_routing=True, vocab_size=50)
    E, H, I, r = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, 2
    rng = np.random.default_rng(2)
    a, b = (jnp.asarray(rng.standard_normal(shape, np.float32)) for shape in ((E, r, I), (E, H, r)))
    lora = moejax.lora.stack([moejax.lora.LoRAParams(experts=ExpertLoRA(down=LoRAPair(a, b, jnp.float32(0.5))))])
    tids = np.array([3, 2**32 + 1, 7], np.int64)
    ids = np.array([1, 2**32 + 1, 1], np.int64)
    call = lambda: moejax.moe_forward(params, x, cfg, tids, lora=lora, adapter_ids=ids)
    assert_eager_calls_are_cached(call)
    expected = moejax.moe_forward(params, x, cfg, jnp.array([3, 49, 7]), lora=lora, adapter_ids=jnp.array([1, 0, 1]))
    np.testing.assert_array_equal(call(), expected)


def test_eager_moe_forward_costs_about_the_jitted_call():
    cfg, params, x = _setup()
    jitted = jax.jit(moejax.moe_forward, static_argnames=("cfg",))
    assert_eager_about_as_fast(lambda: moejax.moe_forward(params, x, cfg), lambda: jitted(params, x, cfg))


def test_eager_route_is_cached():
    """T=7, a shape no other test here routes: an uncached first call would compile each of route's ops."""
    cfg, params, x = _setup(T=7)
    assert_eager_calls_are_cached(lambda: moejax.route(params, x, cfg))


def test_eager_checked_forward_is_cached():
    """`checked_moe_forward` is one jitted program: its eager calls are cached like the rest."""
    cfg, params, x = _setup()
    assert_eager_calls_are_cached(lambda: moejax.checked_moe_forward(params, x, cfg))


@pytest.mark.parametrize("mode", dispatch.EP_MODES)
def test_eager_moe_forward_ep_is_cached(mode):
    """Both EP modes on 8 devices: cached, as fast as the jitted call (within MAX_SLOWDOWN), same result."""
    cfg, params, x = _setup(T=16)
    mesh = jax.make_mesh((8,), ("expert",))
    sharded = sharding.shard_params(params, cfg, mesh)
    eager = lambda: parallel.moe_forward_ep(sharded, x, cfg, mesh=mesh, mode=mode)
    assert_eager_calls_are_cached(eager)
    jitted_ep = jax.jit(parallel.moe_forward_ep, static_argnames=("cfg", "mesh", "mode"))
    jitted = lambda: jitted_ep(sharded, x, cfg, mesh=mesh, mode=mode)
    assert_eager_about_as_fast(eager, jitted)
    np.testing.assert_allclose(eager(), jitted(), rtol=1e-6, atol=1e-6)


def test_eager_layer_call_is_cached():
    """`MoE.__call__` (per-expert layout, the CPU default) reuses the cached functional core; statistics collected
    eagerly still add up."""
    cfg = moejax.MoEConfig.preset("qwen3_moe", **SMALL)
    layer = moejax.MoE(cfg, rngs=nnx.Rngs(0), collect_stats=True)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((4, cfg.hidden_size), np.float32))
    assert_eager_calls_are_cached(lambda: layer(x))
    assert int(layer.stats.calls) == CALLS
    jitted = nnx.jit(lambda m, v: m(v))
    assert_eager_about_as_fast(lambda: layer(x), lambda: jitted(layer, x))


@pytest.fixture
def max_programs():
    """Sets `moejax.eager`'s program budget for one test, then restores it."""
    kept = moejax.eager.max_programs()
    yield moejax.eager.set_max_programs
    moejax.eager.set_max_programs(kept)


def test_eager_programs_are_bounded_least_recently_called_first(max_programs):
    """Eager calls over many row counts keep at most `max_programs()` programs: the most recent ones are reused,
    a dropped one compiles again, and every call still gives the jitted call's bits. Unbounded, every row count's
    program would stay for the life of the process (~5 MB each)."""
    max_programs(3)
    forward = moejax.moe_forward
    forward.clear_cache()
    jitted = jax.jit(forward.uncached, static_argnames=("cfg",))
    sizes = (1, 2, 3, 5, 7, 11, 13)
    with counted_compiles() as compiles:
        for T in sizes:
            cfg, params, x = _setup(T)
            np.testing.assert_array_equal(forward(params, x, cfg), jitted(params, x, cfg))
            assert forward.cached_programs() <= 3
    assert compiles.count("jit(moe_forward)") == 2 * len(sizes)  # one eager, one jitted program per row count
    for T, recompiles in ((13, 0), (7, 0), (1, 1), (5, 1)):
        cfg, params, x = _setup(T)
        with counted_compiles() as compiles:
            forward(params, x, cfg).block_until_ready()
        assert len(compiles) == recompiles, (T, compiles)
    assert forward.cached_programs() == 3


def test_max_programs_is_a_positive_integer(max_programs):
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises(ValueError, match="max programs must be an integer >= 1"):
            max_programs(bad)
