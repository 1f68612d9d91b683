"""Compiled for a real TPU topology (v5e:2x2, four compile-only devices) with no TPU at
hand: the train step of configs/lm.py with impl="auto" (Pallas splash through
shard_map) on a data axis and on data x model axes, and every variant the Pallas kernels
serve; those they do not serve are refused by name.

Marker `tpu`, excluded from the default run: it needs libtpu, the TPU compiler, which
lives in its own venv (docs/guide/testing.md):
  python -m venv --system-site-packages /tmp/venv-tpu
  /tmp/venv-tpu/bin/pip install "jax[tpu]==$(python -c 'import jax; print(jax.__version__)')"
  /tmp/venv-tpu/bin/python -m pytest -m tpu
"""

import os

# Several processes (xdist workers, other sessions) may load libtpu at once: without this
# all but the first fail on libtpu's lockfile. Set before JAX first initialises libtpu.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from builders import tiny  # noqa: E402
from mha_jax import attention, tasks  # noqa: E402
from mha_jax.kernels import dispatch  # noqa: E402
from mha_jax.train import loop, sharding  # noqa: E402

pytestmark = pytest.mark.tpu
pytest.importorskip("libtpu", reason="the TPU compiler (libtpu) is not installed")


@pytest.fixture(scope="module", autouse=True)
def real_precision():
  """The matmul precision of a real run (XLA's default), not the tests' 'highest'
  (conftest.py): Mosaic refuses fp32 contract precision on bfloat16 operands."""
  before = jax.config.jax_default_matmul_precision
  jax.config.update("jax_default_matmul_precision", None)
  yield
  jax.config.update("jax_default_matmul_precision", before)


@pytest.fixture(scope="module")
def v5e():
  """Four compile-only v5e devices. With libtpu installed a failure here is an error,
  not a skip."""
  from jax.experimental import topologies
  return topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices


def _structs(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def _mosaic_calls(compiled) -> int:
  return compiled.as_text().count("tpu_custom_call")


@pytest.fixture(scope="module")
def lm_task():
  cfg = tiny("configs/lm.py", [])
  assert cfg.model.impl == "auto" and cfg.model.max_len % 128 == 0
  return cfg, tasks.build(cfg, None)


@pytest.mark.parametrize("data,model", [(2, 2)])
def test_the_lm_train_step_with_auto_compiles_for_v5e_with_pallas(v5e, lm_task, data, model):
  """configs/lm.py's train step (forward, backward, AdamW) lowered for a v5e:2x2 mesh:
  auto picks Pallas in every layer and the program holds Mosaic kernels. On the data
  axis alone (data 4) the same step is compiled once for the plan's test
  (tests/plan/test_plan.py, the v5e_lm_train_plan fixture)."""
  cfg, task = lm_task
  mesh = sharding.make_mesh(data, model, devices=v5e)
  optimizer = loop.make_optimizer(cfg.train)

  def init(key):
    params = task.init_params(key)
    return params, optimizer.init(params)

  state = jax.eval_shape(init, jax.random.PRNGKey(0))
  state_shardings = sharding.shardings(state, mesh)
  rep = NamedSharding(mesh, P())
  b, t = cfg.train.batch_size, cfg.model.max_len
  batch = {"tokens": jax.ShapeDtypeStruct((b, t + 1), jnp.int32,
                                          sharding=NamedSharding(mesh, P("data")))}
  args = (*_structs(state, state_shardings), batch,
          jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
          jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep))
  step = jax.jit(loop.make_train_step(task, optimizer, cfg),
                 out_shardings=(*state_shardings, rep))
  with dispatch.compile_target(mesh) as chosen:
    compiled = step.lower(*args).compile()
  assert chosen == ["pallas"] * cfg.model.num_layers
  assert _mosaic_calls(compiled) >= 3 * cfg.model.num_layers   # forward, dq, dkv
  assert compiled.memory_analysis() is not None


# name: (kwargs of multi_head_attention, num_kv_heads, variant): what Pallas serves.
SERVED = {
    "causal_gqa_split": (dict(causal=True), 2, "softmax"),    # G = 2 over model = 2
    "mqa_repeated": (dict(causal=True), 1, "softmax"),        # G = 1: kv repeated to H
    "bias_flash": (dict(bias=True), 4, "softmax"),            # the flash kernel
    "softcap_splash": (dict(causal=True, softcap=30.0), 4, "softmax"),
    "gated": (dict(), 4, "gated"),
    "gated_head": (dict(), 4, "gated_head"),
    "qk_norm": (dict(causal=True), 4, "qk_norm"),
}


def _layer(variant, g, d=256, h=4):
  p = attention.init_attention_params(jax.random.PRNGKey(0), d, h, num_kv_heads=g,
                                      variant=variant, dtype=jnp.bfloat16)
  return jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)


def _compile_layer(mesh, variant, g, kw, impl="pallas"):
  """Forward+backward of one attention layer (B 4, T 128, D 256, H 4) on the mesh."""
  kw = dict(kw)
  params = _layer(variant, g)
  h = 4
  bias = (jnp.zeros((1, h, 128, 128), jnp.bfloat16) if kw.pop("bias", False) else None)
  x = jax.ShapeDtypeStruct((4, 128, 256), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P("data")))
  pspec = sharding.shardings(params, mesh)
  loss = lambda p, x: jnp.sum(attention.multi_head_attention(
      p, x, impl=impl, variant=variant, bias=bias, **kw).astype(jnp.float32))
  with dispatch.compile_target(mesh) as chosen:
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(
        _structs(params, pspec), x).compile()
  return compiled, chosen


@pytest.mark.parametrize("name", list(SERVED))
def test_every_variant_the_pallas_kernels_serve_compiles_for_v5e(v5e, name):
  kw, g, variant = SERVED[name]
  compiled, chosen = _compile_layer(sharding.make_mesh(2, 2, devices=v5e), variant, g, kw)
  assert chosen == ["pallas"]
  assert _mosaic_calls(compiled) >= 3


@pytest.mark.parametrize("variant", [v for v, ks in dispatch.VARIANT_KERNELS.items()
                                     if "pallas" not in ks])
def test_variants_the_pallas_kernels_do_not_serve_are_refused_by_name(v5e, variant):
  mesh = sharding.make_mesh(2, 2, devices=v5e)
  with pytest.raises(ValueError, match=f"impl='pallas' does not serve variant='{variant}'"):
    _compile_layer(mesh, variant, 4, {})


@pytest.mark.parametrize("impl", ["blocked", "xla", "reference"])
def test_the_xla_kernels_partition_on_a_mesh_without_shard_map(v5e, impl):
  """The kernels made of XLA ops (the blocked kernel's custom VJP included) compile on a
  data x model mesh as they are: XLA partitions them."""
  compiled, chosen = _compile_layer(sharding.make_mesh(2, 2, devices=v5e), "softmax", 2,
                                    dict(causal=True), impl=impl)
  assert chosen == [impl]
  assert _mosaic_calls(compiled) == 0


def test_splash_keeps_a_narrow_head_dim_off_the_lanes(v5e, monkeypatch, tmp_path):
  """d_k = 8: a (heads, T, K) array has its minor K tiled to 128 lanes (16x its bytes);
  the wrapper hands q, k and v to splash as (heads, K, T) (pallas.splash_blocks), which
  saves at least the padding of the three residuals q, k and v, against the kernel's
  default layout, in the buffer assignment of forward+backward."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as splash)
  from mha_jax import plan
  from mha_jax.kernels import pallas
  mesh = jax.sharding.Mesh(v5e, ("data",))
  b, t, h, k = 8, 128, 32, 8
  x = jax.ShapeDtypeStruct((b, t, h, k), jnp.float32, sharding=NamedSharding(mesh, P("data")))
  loss = lambda q, kk, v: jnp.sum(pallas.pallas_attention(
      q, kk, v, causal=True, kernel="tpu_splash", platform="tpu", mesh=mesh) ** 2)

  def temps(name):
    with dispatch.compile_target(mesh):
      lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x)
    lowered.compile(compiler_options={"xla_dump_to": str(tmp_path / name)})
    return sum(plan.temp_bytes(str(tmp_path / name)).values())

  assert pallas.splash_blocks(k).k_layout == splash.QKVLayout.SEQ_MINOR
  assert pallas.splash_blocks(128).k_layout == splash.QKVLayout.HEAD_DIM_MINOR
  ours = temps("ours")
  monkeypatch.setattr(pallas, "splash_blocks", lambda k: splash.BlockSizes.get_default())
  lanes = temps("head_dim_minor")
  rows = b // 4 * h * t                                  # (heads, T) rows on one device
  assert lanes - ours >= 3 * rows * (128 - k) * 4, (lanes, ours)
