"""model.attention: every attention variant through the models' one attention call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha_jax import attention
from mha_jax import config as mc
from mha_jax import sweep
from mha_jax.errors import UserError
from mha_jax.models import common
from mha_jax.models import lm, seq2seq


@pytest.mark.parametrize("variant", attention.VARIANTS)
def test_lm_trains_a_step_with_every_variant(variant):
  """The LM's layers carry the variant's params; loss and gradients are finite and the
  gradient reaches every variant param."""
  p = lm.init(jax.random.PRNGKey(0), vocab_size=11, d_model=16, num_heads=2, num_layers=2,
              d_ff=0, max_len=8, attn_only=True, variant=variant)
  want = attention.variant_param_shapes(variant, 16, 2, 8)
  assert {n: p["lm"]["layer_1"]["attn"][n].shape for n in want} == want
  spec = common.ModelSpec(kind="lm", attn_only=True, attention=variant)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 11, (2, 8)))

  def loss(p):
    logits = lm.apply(p, spec, tokens)
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

  val, g = jax.jit(jax.value_and_grad(loss))(p)
  assert np.isfinite(float(val))
  for n in want:
    assert float(jnp.abs(g["lm"]["layer_0"]["attn"][n]).sum()) > 0, n


@pytest.mark.slow
def test_seq2seq_uses_the_variant_in_every_attention_and_lambda_init_by_layer():
  p = seq2seq.init(jax.random.PRNGKey(0), vocab_size=13, d_model=16, num_heads=2,
                   enc_layers=2, dec_layers=1, d_ff=16, variant="differential")
  for stack, name in (("encoder", "self_attn"), ("decoder", "self_attn"),
                      ("decoder", "cross_attn")):
    assert "lambda_q1" in p[stack]["layer_0"][name]
  spec = common.ModelSpec(kind="seq2seq", attention="differential")
  src = jnp.asarray(np.random.default_rng(1).integers(4, 13, (2, 5)))
  tgt = jnp.asarray(np.random.default_rng(2).integers(4, 13, (2, 4)))
  logits = seq2seq.apply(p, spec, src, tgt)
  assert logits.shape == (2, 4, 13) and np.all(np.isfinite(logits))
  assert attention.diff_lambda_init(0) == pytest.approx(0.2)
  assert attention.diff_lambda_init(1) == pytest.approx(0.8 - 0.6 * np.exp(-0.3))


def test_configs_take_model_attention_and_refuse_unknown_or_unserved():
  cfg = mc.load_config("configs/lm.py:attention=gated,layers=1")
  assert cfg.model.attention == "gated"
  mc.validate(cfg)
  cfg.model.attention = "nope"
  with pytest.raises(UserError, match="model.attention must be one of .*'nope'"):
    mc.validate(cfg)
  cfg = mc.load_config("configs/translation.py:quickstart,attention=sink")
  cfg.model.impl = "xla"
  with pytest.raises(UserError, match="model.impl='xla' does not serve model.attention='sink'"):
    mc.validate(cfg)
  cfg = mc.load_config("configs/attn_only_text.py:attention=sigmoid")
  assert cfg.model.attention == "sigmoid"


def test_sweep_variants_plans_h_times_variant(tmp_path):
  runs = sweep.plan("configs/sweep_variants.py:heads=1,16,variants=softmax+differential,"
                    "base=translation.py", str(tmp_path), [])
  assert [r["name"] for r in runs] == ["softmax_h1", "softmax_h16", "differential_h1",
                                       "differential_h16"]
  c = runs[-1]["config"]
  assert (c.model.num_heads, c.model.attention, c.model.d_model) == (16, "differential", 64)
  runs = mc.load_config("configs/sweep_variants.py").runs
  assert len(runs) == 5 * 7 and {r["overrides"]["model.attention"] for r in runs} == set(
      attention.VARIANTS)


@pytest.mark.parametrize("variant", [pytest.param("gated", marks=pytest.mark.slow),
                                     pytest.param("gated_head", marks=pytest.mark.slow),
                                     pytest.param("differential", marks=pytest.mark.slow), "sink"])
def test_export_pruned_slices_the_variant_params_with_their_heads(variant):
  from mha_jax.toolkit import head_masks
  p = lm.init(jax.random.PRNGKey(1), vocab_size=11, d_model=16, num_heads=4, num_layers=2,
              d_ff=0, max_len=8, attn_only=True, variant=variant)
  spec = common.ModelSpec(kind="lm", attn_only=True, attention=variant)
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, 11, (2, 8)))
  mask = {"lm": [jnp.array([1.0, 0.0, 1.0, 1.0]), jnp.array([0.0, 1.0, 0.0, 1.0])]}
  gated = lm.apply(p, spec, tokens, gates=mask)
  small = head_masks.export_pruned(p, mask)
  assert small["lm"]["layer_1"]["attn"]["wq"].shape[1] == 2
  np.testing.assert_allclose(lm.apply(small, spec, tokens), gated, atol=2e-5)
