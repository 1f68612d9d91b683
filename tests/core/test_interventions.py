"""interventions.py: named sites inside the one forward, against a float64 NumPy oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha_jax import attention
from mha_jax import interventions
from mha_jax.models import bert, llama
from mha_jax.models import common
from mha_jax.models import lm as lm_model
from mha_jax.models import seq2seq
from oracles import D, G, H, K, L, SPEC, numpy_llama

@pytest.fixture(scope="module")
def tiny():
  params = llama.init(jax.random.PRNGKey(0), vocab_size=37, d_model=D, num_heads=H,
                      num_kv_heads=G, head_dim=K, num_layers=L, d_ff=24)
  rng = np.random.default_rng(0)
  clean = jnp.asarray(rng.integers(0, 37, (3, 7)), jnp.int32)
  corrupt = jnp.asarray(rng.integers(0, 37, (3, 7)), jnp.int32)
  return params, clean, corrupt


def fwd(params, tokens, edits=None, read=()):
  return interventions.run_with_hook(lambda hook: llama.apply(params, SPEC, tokens, hook=hook), edits, read)


def test_sites_match_the_numpy_oracle_and_patching_a_head_matches_substitution(tiny):
  params, clean, corrupt = tiny
  ref, seen = numpy_llama(params, clean)
  logits, vals = fwd(params, clean, read=["lm.*.attn.z", "lm.*.attn.k", "lm.*.mlp_out"])
  np.testing.assert_allclose(logits, ref, atol=2e-5, rtol=1e-4)
  for i in range(L):
    np.testing.assert_allclose(vals[f"lm.{i}.attn.z"], seen[(i, "z")], atol=2e-5)
    np.testing.assert_allclose(vals[f"lm.{i}.attn.k"], seen[(i, "k")], atol=2e-5)
  # head 2 of layer 0: its clean z into the corrupt run, at position 4 only
  src = seen[(0, "z")]

  def sub(z):
    z = z.copy()
    z[:, 4, 2] = src[:, 4, 2]
    return z

  want, _ = numpy_llama(params, corrupt, {(0, "z"): sub})
  got, _ = fwd(params, corrupt, {"lm.0.attn.z": interventions.replace(vals["lm.0.attn.z"], heads=2,
                                                            positions=4)})
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
  # add and scale: z of every head halved on row 1, mlp_out of layer 1 plus a vector
  half = lambda z: np.where(np.arange(3)[:, None, None, None] == 1, z * 0.5, z)  # noqa
  vec = np.linspace(-1, 1, D)
  want, _ = numpy_llama(params, clean, {(1, "z"): half, (1, "mlp_out"): lambda m: m + vec})
  got, _ = fwd(params, clean, {"lm.1.attn.z": interventions.scale(0.5, rows=[1]),
                               "lm.1.mlp_out": interventions.add(jnp.asarray(vec, jnp.float32))})
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_patching_every_site_with_its_own_value_changes_nothing(tiny):
  params, clean, _ = tiny
  names = [n for n in interventions.site_names(params)]
  base, vals = fwd(params, clean, read=names)
  assert set(vals) == set(names)
  edits = {n: interventions.replace(v) for n, v in vals.items()}
  again, _ = fwd(params, clean, edits)
  np.testing.assert_array_equal(np.asarray(again), np.asarray(base))


def test_denoising_every_head_and_the_rest_of_the_stream_gives_the_clean_logits(tiny):
  params, clean, corrupt = tiny
  read = ["lm.0.resid_pre", "lm.*.attn.z", "lm.*.mlp_out"]
  want, vals = fwd(params, clean, read=read)
  got, _ = fwd(params, corrupt, {n: interventions.replace(v) for n, v in vals.items()})
  np.testing.assert_allclose(got, want, atol=1e-5)
  # every head and MLP without the embeddings (the stream's direct path) is not clean
  part, _ = fwd(params, corrupt, {n: interventions.replace(v) for n, v in vals.items()
                                  if "resid" not in n})
  assert np.abs(np.asarray(part) - np.asarray(want)).max() > 1e-3


def test_one_kv_head_patched_changes_exactly_the_query_heads_that_read_it(tiny):
  params, clean, corrupt = tiny
  _, src = fwd(params, clean, read=["lm.1.attn.k", "lm.1.attn.v"])
  _, base = fwd(params, corrupt, read=["lm.1.attn.z"])
  for j in range(G):
    for site in ("k", "v"):
      _, got = fwd(params, corrupt, {f"lm.1.attn.{site}": interventions.replace(src[f"lm.1.attn.{site}"],
                                                                     heads=j)},
                   read=["lm.1.attn.z"])
      diff = np.abs(np.asarray(got["lm.1.attn.z"]) - np.asarray(base["lm.1.attn.z"]))
      diff = diff[:, 1:].max(axis=(0, 1, 3))    # position 0 attends to itself only (v)
      readers = [h for h in range(H) if h // (H // G) == j]
      for h in range(H):
        if h in readers:
          assert diff[h] > 1e-4, (site, j, h)
        else:
          assert diff[h] == 0.0, (site, j, h)


def test_keys_per_query_head_change_only_that_head(tiny):
  params, clean, corrupt = tiny
  _, src = fwd(params, clean, read=["lm.0.attn.k_q"])
  _, base = fwd(params, corrupt, read=["lm.0.attn.z", "lm.0.attn.k_q", "lm.0.attn.k"])
  kq, k = np.asarray(base["lm.0.attn.k_q"]), np.asarray(base["lm.0.attn.k"])
  np.testing.assert_array_equal(kq, np.repeat(k, H // G, axis=2))   # repeat_kv order
  _, got = fwd(params, corrupt, {"lm.0.attn.k_q": interventions.replace(src["lm.0.attn.k_q"], heads=1)},
               read=["lm.0.attn.z"])
  diff = np.abs(np.asarray(got["lm.0.attn.z"]) - np.asarray(base["lm.0.attn.z"]))
  per_head = diff.max(axis=(0, 1, 3))
  assert per_head[1] > 1e-4 and all(per_head[h] == 0 for h in (0, 2, 3))


def test_pattern_and_result_sites(tiny):
  params, clean, _ = tiny
  base, vals = fwd(params, clean, read=["lm.0.attn.pattern", "lm.0.attn.result",
                                        "lm.0.attn_out", "lm.0.attn.v", "lm.0.attn.z"])
  np.testing.assert_allclose(vals["lm.0.attn.result"].sum(2), vals["lm.0.attn_out"], atol=1e-5)
  w = np.asarray(vals["lm.0.attn.pattern"])
  np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)
  # a uniform causal pattern for head 3: its z is the running mean of its values
  t = w.shape[-1]
  uni = np.tril(np.ones((t, t))) / np.arange(1, t + 1)[:, None]
  _, got = fwd(params, clean, {"lm.0.attn.pattern": interventions.replace(jnp.asarray(uni, jnp.float32),
                                                              heads=3)},
               read=["lm.0.attn.z"])
  v = np.asarray(vals["lm.0.attn.v"])[:, :, 3 // (H // G)]
  np.testing.assert_allclose(got["lm.0.attn.z"][:, :, 3], np.einsum("ts,bsk->btk", uni, v),
                             atol=1e-5)
  np.testing.assert_array_equal(got["lm.0.attn.z"][:, :, :3], vals["lm.0.attn.z"][:, :, :3])


def test_vmap_over_a_head_index_equals_one_edit_at_a_time(tiny):
  params, clean, corrupt = tiny
  _, src = fwd(params, clean, read=["lm.1.attn.z"])

  def one(h):
    return fwd(params, corrupt, {"lm.1.attn.z": interventions.replace(src["lm.1.attn.z"], heads=h)})[0]

  batched = jax.jit(jax.vmap(one))(jnp.arange(H))
  for h in range(H):
    np.testing.assert_allclose(batched[h], one(h), atol=1e-5)


def test_gates_and_capture_are_uses_of_the_mechanism(tiny):
  params, clean, _ = tiny
  gates = {"lm": [jnp.asarray([1.0, 0.0, 0.5, 1.0]), jnp.ones((H,))]}
  a = llama.apply(params, SPEC, clean, gates=gates)
  b, _ = fwd(params, clean, {"lm.0.attn.z": interventions.scale(jnp.asarray([1.0, 0.0, 0.5, 1.0])[
      None, None, :, None])})
  np.testing.assert_allclose(a, b, atol=1e-6)
  logits, cap = llama.apply(params, SPEC, clean, capture=True)
  _, vals = fwd(params, clean, read=["lm.*.attn.pattern", "lm.*.attn.z", "lm.*.attn_out"])
  assert isinstance(cap["lm"][0], attention.AttentionOutput)
  np.testing.assert_array_equal(cap["lm"][1].weights, vals["lm.1.attn.pattern"])
  np.testing.assert_array_equal(cap["lm"][1].heads, vals["lm.1.attn.z"])
  np.testing.assert_array_equal(cap["lm"][1].out, vals["lm.1.attn_out"])


def test_final_norm_scale_site_and_logits_at(tiny):
  params, clean, _ = tiny
  full, vals = fwd(params, clean, read=["lm.ln_final.scale", f"lm.{L - 1}.resid_post"])
  x = np.asarray(vals[f"lm.{L - 1}.resid_post"], np.float64)
  np.testing.assert_allclose(vals["lm.ln_final.scale"][..., 0],
                             1 / np.sqrt((x * x).mean(-1) + SPEC.norm_eps), rtol=1e-5)
  at = jnp.asarray([6, 2, 0])
  some = llama.apply(params, SPEC, clean, logits_at=at)
  np.testing.assert_allclose(some[:, 0], np.asarray(full)[np.arange(3), at], atol=1e-5)


@pytest.mark.slow
def test_other_models_have_sites():
  key = jax.random.PRNGKey(1)
  tokens = jnp.asarray(np.random.default_rng(1).integers(1, 20, (2, 5)), jnp.int32)
  p = lm_model.init(key, vocab_size=20, d_model=8, num_heads=2, num_layers=2, d_ff=16,
                    max_len=8)
  spec = common.ModelSpec(kind="lm")
  base = lm_model.apply(p, spec, tokens)
  got, vals = interventions.run_with_hook(lambda hook: lm_model.apply(p, spec, tokens, hook=hook),
                    read=interventions.site_names(p))
  np.testing.assert_allclose(got, base, atol=1e-6)   # reading `result` sums per head
  again, _ = interventions.run_with_hook(lambda hook: lm_model.apply(p, spec, tokens, hook=hook),
                   {n: interventions.replace(v) for n, v in vals.items()})
  np.testing.assert_array_equal(again, got)
  bp = bert.init(key, vocab_size=20, d_model=8, num_heads=2, num_layers=2, d_ff=16,
                 max_len=8)
  bspec = bert.BertSpec()
  hb = bert.apply(bp, bspec, tokens)
  got, vals = interventions.run_with_hook(lambda hook: bert.apply(bp, bspec, tokens, hook=hook),
                    {"encoder.1.attn.z": interventions.scale(0.0, heads=1)}, read=["encoder.*.attn.z"])
  assert np.all(np.asarray(vals["encoder.1.attn.z"])[:, :, 1] == 0)
  assert np.abs(np.asarray(got) - np.asarray(hb)).max() > 1e-4
  sp = seq2seq.init(key, vocab_size=20, d_model=8, num_heads=2, enc_layers=1, dec_layers=1,
                    d_ff=16)
  sspec = common.ModelSpec(kind="seq2seq")
  _, cap = seq2seq.apply(sp, sspec, tokens, tokens, capture=True)
  assert set(cap) == {"encoder", "decoder_self", "decoder_cross"}
  assert cap["decoder_cross"][0].weights.shape == (2, 2, 5, 5)


def test_bad_edits_are_refused(tiny):
  params, clean, _ = tiny
  with pytest.raises(ValueError, match="lm.9.attn.z"):
    fwd(params, clean, {"lm.9.attn.z": interventions.replace(0.0)})
  with pytest.raises(ValueError, match="does not broadcast"):
    fwd(params, clean, {"lm.0.attn.z": interventions.replace(jnp.zeros((5,)))})
  with pytest.raises(ValueError, match="no heads axis"):
    fwd(params, clean, {"lm.0.resid_pre": interventions.replace(0.0, heads=1)})
  with pytest.raises(ValueError, match="op must be one of"):
    interventions.Edit("swap", 0.0)
  with pytest.raises(ValueError, match="must be an Edit"):
    interventions.Hook({"lm.0.attn.z": 0.0})


def test_where_picks_any_elements_and_combines_with_the_axis_selections(tiny):
  params, clean, corrupt = tiny
  _, seen = numpy_llama(params, clean)
  src = seen[(1, "z")]                                   # (3, 7, H, K)
  where = np.zeros((3, 7, H, 1), bool)
  where[0, 2, 1] = True                                  # row 0: head 1 at position 2
  where[2, 4:, 3] = True                                 # row 2: head 3 at positions 4..6

  def sub(mask):
    def f(v):
      v, m = v.copy(), np.broadcast_to(mask, v.shape)
      v[m] = src[m]
      return v
    return f

  got, _ = fwd(params, corrupt, {"lm.1.attn.z": interventions.replace(src, where=where)})
  want, _ = numpy_llama(params, corrupt, {(1, "z"): sub(where)})
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
  plain, _ = numpy_llama(params, corrupt)
  assert np.abs(want - plain).max() > 1e-3            # the edit changes the logits
  # with rows=2 only row 2's elements remain
  got, _ = fwd(params, corrupt, {"lm.1.attn.z": interventions.replace(src, where=where,
                                                                      rows=2)})
  only2 = where.copy()
  only2[:2] = False
  want, _ = numpy_llama(params, corrupt, {(1, "z"): sub(only2)})
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
  for bad, what in ((where[..., 0], "4 axes"), (where.astype(np.int32), "dtype int32"),
                    (np.zeros((2, 7, H, 1), bool), "shape \\(2, 7, 4, 1\\)")):
    with pytest.raises(ValueError, match=f"where must be a boolean array.*{what}"):
      fwd(params, corrupt, {"lm.1.attn.z": interventions.replace(src, where=bad)})
