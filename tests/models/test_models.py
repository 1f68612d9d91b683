"""Models: shapes, stable param paths, head gates wired everywhere, causality."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha_jax import attention
from mha_jax.models import common
from mha_jax.models import lm, seq2seq

SPEC = common.ModelSpec("seq2seq")


@pytest.fixture(scope="module")
def s2s():
  p = seq2seq.init(jax.random.PRNGKey(0), vocab_size=40, d_model=32, num_heads=4,
                   enc_layers=2, dec_layers=2, d_ff=64)
  src = jax.random.randint(jax.random.PRNGKey(1), (3, 7), 4, 40).at[0, 5:].set(0)
  tgt = jax.random.randint(jax.random.PRNGKey(2), (3, 6), 4, 40)
  return p, src, tgt


def test_param_paths_and_head_names(s2s):
  p, _, _ = s2s
  assert p["encoder"]["layer_1"]["self_attn"]["wq"].shape == (32, 4, 8)
  assert p["decoder"]["layer_0"]["cross_attn"]["wo"].shape == (4, 8, 32)
  names = common.head_names(p)
  assert len(names) == 3 * 2 * 4
  assert names[:2] == ["encoder.0.0", "encoder.0.1"] and "decoder_cross.1.3" in names
  assert common.head_counts(p) == {"encoder": [4, 4], "decoder_self": [4, 4],
                              "decoder_cross": [4, 4]}


@pytest.mark.parametrize("stack,layer", [pytest.param("encoder", 1, marks=pytest.mark.slow), ("decoder_self", 0),
                                         ("decoder_cross", 1)])
def test_gate_zero_equals_removing_the_head_in_every_block_type(s2s, stack, layer):
  p, src, tgt = s2s
  gates = common.ones_head_gates(p)
  gates[stack][layer] = jnp.array([1.0, 0.0, 1.0, 1.0])
  gated = seq2seq.apply(p, SPEC, src, tgt, gates=gates)
  top, attn = common.STACKS[stack]
  keep = np.array([0, 2, 3])
  blk = p[top][f"layer_{layer}"][attn]
  pruned_blk = {"wq": blk["wq"][:, keep], "wk": blk["wk"][:, keep], "wv": blk["wv"][:, keep],
                "wo": blk["wo"][keep]}
  pruned = jax.tree.map(lambda x: x, p)
  pruned[top][f"layer_{layer}"][attn] = pruned_blk
  np.testing.assert_allclose(seq2seq.apply(pruned, SPEC, src, tgt), gated, atol=1e-5)
  assert float(jnp.abs(gated - seq2seq.apply(p, SPEC, src, tgt)).max()) > 1e-4


def test_capture_returns_every_layers_weights(s2s):
  p, src, tgt = s2s
  logits, cap = seq2seq.apply(p, SPEC, src, tgt, capture=True)
  np.testing.assert_allclose(logits, seq2seq.apply(p, SPEC, src, tgt), atol=1e-5)
  assert [w.weights.shape for w in cap["decoder_cross"]] == [(3, 4, 6, 7)] * 2
  enc = cap["encoder"][0].weights
  np.testing.assert_array_equal(enc[0, :, :, 5:], 0.0)          # padding never attended
  np.testing.assert_allclose(enc.sum(-1), 1.0, atol=1e-5)


def test_decoder_is_causal_and_encoder_ignores_padding(s2s):
  p, src, tgt = s2s
  base = seq2seq.apply(p, SPEC, src, tgt)
  changed = seq2seq.apply(p, SPEC, src, tgt.at[:, 4].set(5))
  np.testing.assert_allclose(base[:, :4], changed[:, :4], atol=1e-6)
  assert float(jnp.abs(base[:, 4:] - changed[:, 4:]).max()) > 1e-4
  other_pad = seq2seq.apply(p, SPEC, src.at[0, 6].set(0), tgt)   # already padding there
  np.testing.assert_allclose(base[0], other_pad[0], atol=1e-6)


def test_attention_only_lm_without_layernorm_has_only_attention():
  p = lm.init(jax.random.PRNGKey(0), vocab_size=20, d_model=16, num_heads=2, num_layers=2,
              d_ff=0, max_len=12, attn_only=True, layer_norm=False)
  assert set(p["lm"]["layer_0"]) == {"attn"}
  assert set(p) == {"embed", "pos_embed", "lm", "unembed"}
  x = jnp.arange(10)[None] % 20
  spec = common.ModelSpec("lm", layer_norm=False, attn_only=True)
  logits, cap = lm.apply(p, spec, x, capture=True)
  # Attention-only, no LN: logits are exactly embed + sum of the heads' writes, unembedded.
  resid = p["embed"][x] + p["pos_embed"][:10]
  for layer_cap in cap["lm"]:
    resid = resid + layer_cap.out
  np.testing.assert_allclose(logits, resid @ p["unembed"], atol=1e-5)
  with pytest.raises(ValueError, match="sequence length 13 exceeds model.max_len=12"):
    lm.apply(p, spec, jnp.zeros((1, 13), jnp.int32))


def _rotate_half(x_HTK, base=10000.0):
  """Rotary embedding written out (pairs (j, j + K/2), angle t * base ** (-2j / K))."""
  k = x_HTK.shape[-1]
  ang = np.arange(x_HTK.shape[1])[:, None] * base ** (-np.arange(0, k, 2) / k)[None]
  cos, sin = np.cos(ang), np.sin(ang)
  a, b = x_HTK[..., : k // 2], x_HTK[..., k // 2:]
  return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


@pytest.mark.parametrize("pos", ["qk_sinusoidal", "relative", "rope"])
def test_lm_positions_that_reach_only_the_scores(pos):
  kw = dict(vocab_size=20, d_model=16, num_heads=2, num_layers=2, d_ff=0, max_len=12,
            attn_only=True, layer_norm=False, pos=pos, max_rel=3)
  p = lm.init(jax.random.PRNGKey(0), **kw)
  assert "pos_embed" not in p
  assert ("rel_bias" in p["lm"]["layer_1"]["attn"]) == (pos == "relative")
  spec = common.ModelSpec("lm", layer_norm=False, attn_only=True, pos=pos)
  x = (jnp.arange(10)[None] * 7) % 20
  logits, cap = lm.apply(p, spec, x, capture=True)
  resid = p["embed"][x]                  # no positions in the residual stream
  for layer_cap in cap["lm"]:
    resid = resid + layer_cap.out
  np.testing.assert_allclose(logits, resid @ p["unembed"], atol=1e-5)
  if pos in ("qk_sinusoidal", "rope"):   # the positions do move the attention patterns
    q = p["lm"]["layer_0"]["attn"]
    k_in = p["embed"][x][0] + (common.sinusoidal(10, 16) if pos == "qk_sinusoidal" else 0)
    qs = np.einsum("td,dhk->htk", np.asarray(k_in), np.asarray(q["wq"]).reshape(16, 2, 8))
    ks = np.einsum("td,dhk->htk", np.asarray(k_in), np.asarray(q["wk"]).reshape(16, 2, 8))
    if pos == "rope":
      qs, ks = _rotate_half(qs), _rotate_half(ks)
    sc = np.einsum("htk,hsk->hts", qs, ks) / np.sqrt(8)
    sc = np.where(np.tril(np.ones((10, 10), bool)), sc, -np.inf)
    want = np.exp(sc - sc.max(-1, keepdims=True))
    np.testing.assert_allclose(cap["lm"][0].weights[0], want / want.sum(-1, keepdims=True),
                               atol=1e-5)
  else:                                  # a bias on offset -1: head 0 attends to t-1
    blk = p["lm"]["layer_0"]["attn"]
    blk["rel_bias"] = blk["rel_bias"].at[0, 2].set(30.0)
    _, cap = lm.apply(p, spec, x, capture=True)
    w = np.asarray(cap["lm"][0].weights)[0, 0]
    np.testing.assert_array_equal(w[1:].argmax(-1), np.arange(9))


def test_model_with_a_layer_of_zero_heads_runs(s2s):
  p, src, tgt = s2s
  blk = p["encoder"]["layer_0"]["self_attn"]
  p0 = jax.tree.map(lambda x: x, p)
  p0["encoder"]["layer_0"]["self_attn"] = {"wq": blk["wq"][:, :0], "wk": blk["wk"][:, :0],
                                           "wv": blk["wv"][:, :0], "wo": blk["wo"][:0]}
  out = seq2seq.apply(p0, SPEC, src, tgt)
  gates = common.ones_head_gates(p)
  gates["encoder"][0] = jnp.zeros(4)
  np.testing.assert_allclose(out, seq2seq.apply(p, SPEC, src, tgt, gates=gates), atol=1e-5)
  assert common.head_counts(p0)["encoder"] == [0, 4]


@pytest.mark.slow  # default run: test_train.py::test_loss_falls_when_training
def test_dropout_only_with_a_key(s2s):
  p, src, tgt = s2s
  spec = common.ModelSpec("seq2seq", dropout=0.3)
  base = seq2seq.apply(p, SPEC, src, tgt)
  np.testing.assert_allclose(seq2seq.apply(p, spec, src, tgt), base, atol=1e-6)
  a = seq2seq.apply(p, spec, src, tgt, key=jax.random.PRNGKey(0))
  b = seq2seq.apply(p, spec, src, tgt, key=jax.random.PRNGKey(1))
  assert float(jnp.abs(a - base).max()) > 1e-3 and float(jnp.abs(a - b).max()) > 1e-3
  np.testing.assert_array_equal(a, seq2seq.apply(p, spec, src, tgt, key=jax.random.PRNGKey(0)))


def test_post_ln_is_a_different_residual_layout(s2s):
  _, src, tgt = s2s
  kw = dict(vocab_size=40, d_model=32, num_heads=4, enc_layers=2, dec_layers=2, d_ff=64)
  post = seq2seq.init(jax.random.PRNGKey(0), ln_position="post", **kw)
  pre = seq2seq.init(jax.random.PRNGKey(0), **kw)
  assert "ln_final" not in post["encoder"] and "ln_final" in pre["encoder"]
  spec = common.ModelSpec("seq2seq", ln_position="post")
  out = seq2seq.apply(post, spec, src, tgt)
  assert out.shape == (3, 6, 40) and np.all(np.isfinite(out))
  # Post-LN: every encoder output row is layer-normalised (mean 0 before the affine).
  enc = seq2seq.encode(post, spec, src)
  np.testing.assert_allclose(enc.mean(-1), 0.0, atol=1e-5)
  assert float(jnp.abs(out - seq2seq.apply(pre, SPEC, src, tgt)).max()) > 1e-3


@pytest.mark.slow  # default run: test_kernels.py's rel cases
def test_relative_positions_replace_sinusoids_with_a_per_head_offset_bias(s2s):
  _, src, tgt = s2s
  kw = dict(vocab_size=40, d_model=32, num_heads=4, enc_layers=2, dec_layers=2, d_ff=64)
  p = seq2seq.init(jax.random.PRNGKey(0), pos="relative", max_rel=3, **kw)
  assert p["encoder"]["layer_0"]["self_attn"]["rel_bias"].shape == (4, 7)
  assert "rel_bias" in p["decoder"]["layer_1"]["self_attn"]
  assert "rel_bias" not in p["decoder"]["layer_1"]["cross_attn"]
  table = jax.random.normal(jax.random.PRNGKey(3), (4, 7))
  b = np.asarray(attention.relative_bias(table, 5, 5))[0]
  for i in range(5):
    for j in range(5):
      np.testing.assert_array_equal(b[:, i, j], table[:, 3 + int(np.clip(j - i, -3, 3))])
  spec = common.ModelSpec("seq2seq", pos="relative")
  # No absolute positions: a sentence of one repeated word gets the same state everywhere,
  # with sinusoids it does not.
  same = jnp.full((1, 6), 7)
  enc = seq2seq.encode(p, spec, same)
  np.testing.assert_allclose(enc[0], jnp.broadcast_to(enc[0, :1], enc[0].shape), atol=1e-5)
  sin = seq2seq.encode(seq2seq.init(jax.random.PRNGKey(0), **kw), SPEC, same)
  assert float(jnp.abs(sin[0] - sin[0, :1]).max()) > 1e-2
  # A bias on offset +1 in layer 0 makes encoder head 0 attend to the next token.
  p1 = jax.tree.map(lambda x: x, p)
  blk = p1["encoder"]["layer_0"]["self_attn"]
  blk["rel_bias"] = blk["rel_bias"].at[0, 4].set(20.0)
  _, cap = seq2seq.apply(p1, spec, src, tgt, capture=True)
  w = np.asarray(cap["encoder"][0].weights)[1, 0]           # sentence 1: no padding
  np.testing.assert_array_equal(w[:-1].argmax(-1), np.arange(1, 7))
  assert float(jnp.abs(seq2seq.apply(p1, spec, src, tgt) - seq2seq.apply(p, spec, src, tgt)).max()) > 1e-3


def test_generation_compiles_prompt_and_step_once():
  """A new cache length compiles one prefill and one step program, whatever N is (a tiny
  LLaMA: the programs' count does not depend on the model's size)."""
  from mha_jax.models import llama
  params = llama.init(jax.random.PRNGKey(0), vocab_size=16, d_model=8, num_heads=2,
                      num_kv_heads=1, head_dim=4, num_layers=2, d_ff=16)
  spec = llama.llama_spec()
  prompt = jnp.asarray([[1, 2, 3]], jnp.int32)
  before = (llama.prefill_jit._cache_size(), llama.step_jit._cache_size())
  a = llama.generate(params, spec, prompt, 5)
  after = (llama.prefill_jit._cache_size(), llama.step_jit._cache_size())
  assert after == (before[0] + 1, before[1] + 1)
  assert np.asarray(a).shape == (1, 5)
  llama.generate(params, spec, prompt + 1, 5)       # the same shapes: nothing compiles
  assert (llama.prefill_jit._cache_size(), llama.step_jit._cache_size()) == after


@pytest.mark.slow
def test_resuming_at_a_layer_from_the_stream_equals_the_whole_forward():
  """decoder.apply(start=, stream=): layers before start skipped (a cond per layer),
  the result the whole forward's, with edits from start on and with a prefix cache."""
  from mha_jax import interventions
  from mha_jax.errors import UserError
  from mha_jax.models import llama
  params = llama.init(jax.random.PRNGKey(1), vocab_size=37, d_model=16, num_heads=4,
                      num_kv_heads=2, head_dim=4, num_layers=4, d_ff=24)
  spec = llama.llama_spec()
  tok = jnp.asarray(np.random.default_rng(0).integers(0, 37, (3, 7)), jnp.int32)
  names = [f"lm.{i}.resid_pre" for i in range(4)]
  edit = {"lm.2.attn.z": interventions.replace(0.0, heads=1)}

  def run(tokens, edits=None, read=(), **kw):
    return interventions.run_with_hook(
        lambda hook: llama.apply(params, spec, tokens, hook=hook, **kw), edits, read)

  @jax.jit
  def whole():
    full, vals = run(tok, read=names)
    return full, jnp.stack([vals[n] for n in names]), run(tok, edit)[0]

  full, stream, edited = whole()
  assert float(jnp.abs(edited - full).max()) > 1e-3

  @jax.jit
  def resumed(s):        # every start, without and with the edit, and a start the vmap
    #                      batches (a select, not a cond), in one program
    return (jnp.stack([run(tok, start=s[i], stream=stream)[0] for i in range(4)]),
            jnp.stack([run(tok, edit, start=s[i], stream=stream)[0] for i in (1, 2)]),
            jax.vmap(lambda i: run(tok, start=i, stream=stream)[0])(s))

  plain, with_edit, batched = resumed(jnp.arange(4, dtype=jnp.int32))
  np.testing.assert_allclose(plain, jnp.broadcast_to(full, plain.shape), atol=1e-6)
  np.testing.assert_allclose(with_edit, jnp.broadcast_to(edited, with_edit.shape), atol=1e-6)
  np.testing.assert_allclose(batched, jnp.broadcast_to(full, batched.shape), atol=1e-6)
  # one cond per layer in the program (what lets layers before start be skipped)
  jaxpr = jax.make_jaxpr(lambda s: run(tok, start=s, stream=stream)[0])(jnp.int32(1))
  assert sum(e.primitive.name == "cond" for e in jaxpr.jaxpr.eqns) == 4

  @jax.jit
  def cached():          # with a prefix cache: the stream of the continuation's positions
    cache = llama.apply(params, spec, tok[:, :3], cache=llama.init_cache(params, 3, 7),
                        last_only=True)[1]
    cont, vals = interventions.run_with_hook(lambda hook: llama.apply(
        params, spec, tok[:, 3:], cache=cache, hook=hook)[0], read=names)
    tail = jnp.stack([vals[n] for n in names])
    return cont, llama.apply(params, spec, tok[:, 3:], cache=cache, start=2, stream=tail)[0]

  cont, got = cached()
  np.testing.assert_allclose(cont, full[:, 3:], atol=1e-5)
  np.testing.assert_allclose(got, full[:, 3:], atol=1e-5)
  with pytest.raises(UserError, match="start and stream go together"):
    llama.apply(params, spec, tok, start=1)
  with pytest.raises(UserError, match="cannot be combined with reads"):
    run(tok, read=["lm.3.attn.z"], start=1, stream=stream)
  with pytest.raises(UserError, match=r"stream must be \(L, B, T, D\)"):
    llama.apply(params, spec, tok, start=1, stream=stream[:3])
