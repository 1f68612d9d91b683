"""The kernel choice reads the target (the devices a program is compiled for), never the
process's default backend: a TPU's choice made on this CPU is the TPU process's."""

import inspect
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, Mesh

from mha_jax import attention
from mha_jax.kernels import dispatch, pallas, target, xla

V5E = dispatch.Target("tpu", "TPU v5 lite", 4)
BF16 = jnp.bfloat16


def _q(b=8, t=128, h=12, k=64, dtype=BF16):
  return jax.ShapeDtypeStruct((b, t, h, k), dtype)


# (call's keywords, what a v5e chooses): splash without a bias, flash with one, and what
# the Pallas kernels cannot serve falls back to the XLA paths.
TPU_CASES = [
    (dict(), "pallas"),
    (dict(has_bias=True), "pallas"),
    (dict(has_softcap=True), "pallas"),
    (dict(has_bias=True, has_softcap=True), "reference"),   # flash takes no cap
    (dict(has_mask=True), "reference"),
    (dict(q=_q(t=100)), "reference"),                        # T not a multiple of 128
    (dict(variant="sigmoid"), "reference"),
    (dict(variant="gated"), "pallas"),
    (dict(return_weights=True), "reference"),
    (dict(q=_q(b=64, t=2048, h=32), has_mask=True), "blocked"),   # scores past 8 GiB
]


def _resolve(target_=None, q=None, return_weights=False, **kw):
  return dispatch.resolve_impl("auto", _q() if q is None else q, return_weights,
                               target=target_, **kw)


@pytest.mark.parametrize("kw,want", TPU_CASES)
def test_a_tpu_choice_made_on_cpu_is_the_tpu_process_choice(kw, want):
  """The same call resolved for Target(tpu, 'TPU v5 lite') here, and as a TPU process
  resolves it while tracing its training step (the mesh in context names a TPU device),
  choose the same kernel: the one function reads the target only."""
  assert _resolve(V5E, **kw) == want
  tpu_mesh = AbstractMesh((4,), ("data",), abstract_device=AbstractDevice(
      device_kind="TPU v5 lite", num_cores=1, platform="tpu"))
  with jax.sharding.use_abstract_mesh(tpu_mesh):
    assert dispatch.current_target() == V5E
    assert _resolve(None, **kw) == want
  # This CPU process, asked for its own devices, never picks a TPU kernel.
  assert _resolve(None, **kw) in ("reference", "blocked")


def test_targets_of_meshes_devices_and_abstract_meshes():
  cpu = jax.devices()[0]
  mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
  assert dispatch.target_of(mesh) == dispatch.Target("cpu", cpu.device_kind, 1)
  assert dispatch.target_of([cpu]) == dispatch.target_of(mesh)
  assert dispatch.target_of(mesh.abstract_mesh) == dispatch.target_of(mesh)
  fake = types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
  assert dispatch.target_of([fake] * 4) == V5E
  assert dispatch.target_of([types.SimpleNamespace(platform="cuda", device_kind="NVIDIA H100 "
                                                  "80GB HBM3")]).platform == "gpu"
  assert dispatch.current_target() == dispatch.Target("cpu", cpu.device_kind, 1)
  with pytest.raises(ValueError, match="devices_or_mesh must be"):
    dispatch.target_of([])
  with pytest.raises(ValueError, match="names no device"):
    dispatch.target_of(AbstractMesh((2,), ("data",)))
  with pytest.raises(ValueError, match="platform must be one of"):
    dispatch.Target("npu", "x", 1)
  with pytest.raises(ValueError, match="num_devices"):
    dispatch.Target("tpu", "TPU v4", 0)


def test_compile_target_records_the_choices_of_a_trace_for_a_tpu():
  """A program traced on this CPU for four (fake) v5e devices chooses the Pallas splash
  kernel and says so; outside, the same trace chooses for this CPU."""
  fake = types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
  p = attention.init_attention_params(jax.random.PRNGKey(0), 64, 4, num_kv_heads=2)
  p = jax.tree.map(lambda a: a.astype(BF16), p)
  x = jax.ShapeDtypeStruct((4, 128, 64), BF16)
  f = lambda x: attention.multi_head_attention(p, x, causal=True, impl="auto")
  with dispatch.compile_target([fake] * 4) as chosen:
    assert jax.eval_shape(f, x).shape == (4, 128, 64)
    assert dispatch.current_target() == V5E
  assert chosen == ["pallas"]
  with dispatch.compile_target(jax.devices()[:1]) as here:
    jax.eval_shape(f, x)
  assert here == ["reference"]
  assert dispatch.current_target().platform == "cpu"


def test_memory_and_score_checks_read_the_target():
  assert dispatch.memory_limit(V5E) == (16 * 2**30, "the memory of one TPU v5 lite device")
  assert dispatch.memory_limit(dispatch.Target("tpu", "TPU v5", 4))[0] == 95 * 2**30
  # the driver's figure for a kind in mha_jax.chips; the name's for another
  assert dispatch.memory_limit(dispatch.Target("gpu", "NVIDIA A100-SXM4-80GB", 1))[0] == \
      85_100_068_864
  assert dispatch.memory_limit(dispatch.Target("gpu", "NVIDIA A100-PCIE-80GB", 1))[0] == 80e9
  assert dispatch.score_memory_budget(V5E) == 8 * 2**30
  assert "host" in dispatch.memory_limit(dispatch.current_target())[1] or "RLIMIT" in \
      dispatch.memory_limit(dispatch.current_target())[1]
  # 2 float32 copies of (1, 9, 16384, 16384) scores: 18 GiB, more than a v5e holds.
  with pytest.raises(ValueError, match="more than the memory of one TPU v5 lite"):
    dispatch.check_scores_fit("reference", 1, 9, 16384, 16384, V5E)
  dispatch.check_scores_fit("xla", 1, 8, 16384, 16384, V5E)     # fused on a TPU
  with pytest.raises(ValueError, match="needs an NVIDIA GPU; the target's platform is 'tpu'"):
    dispatch.resolve_impl("cudnn", _q(), False, target=V5E)
  assert dispatch.resolve_impl("auto", _q(), False,
                               target=dispatch.Target("gpu", "NVIDIA H100", 1)) == "cudnn"


def test_gpu_pallas_only_where_triton_lowers_its_blocks():
  """Triton lowers arrays whose sizes are powers of 2 only: on a GPU, auto picks the
  Pallas kernel for float32 at T 64 or 256 and K 64, not at T 48 or K 48 (planning
  configs/induction.py for an H100 failed to compile before)."""
  h100 = dispatch.Target("gpu", "NVIDIA H100 80GB HBM3", 1)
  f32 = np.float32
  pick = lambda **kw: dispatch.resolve_impl("auto", _q(dtype=f32, **kw), False, target=h100)
  assert pick(t=64) == pick(t=256) == "pallas"
  assert pick(t=48) != "pallas" and pick(t=192) != "pallas" and pick(k=48) != "pallas"


def test_no_kernel_module_reads_the_default_backend():
  for mod in (dispatch, pallas, target, xla):
    assert "default_backend" not in inspect.getsource(mod), mod.__name__
