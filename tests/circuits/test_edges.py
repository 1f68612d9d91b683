"""circuits/graph, edges, search: edge patching against a float64 NumPy substitution."""

import jax
import numpy as np
import pytest

from mha_jax import interventions
from mha_jax.circuits import edges as edges_lib
from mha_jax.circuits import search
from mha_jax.errors import UserError
from mha_jax.models import common
from mha_jax.models import lm as lm_model
from mha_jax.toolkit import activation_patching
from mha_jax.toolkit.pairs import Pairs
from mha_jax.toolkit import ablations
from oracles import numpy_rope
from oracles import G, H, K, L, SPEC, LlamaTask, tiny_llama_pairs


class LinearTask:
  """An attention-only LM without norms: the logits are linear in the last residual."""
  vocab_size = 20
  spec = common.ModelSpec(kind="lm", layer_norm=False, attn_only=True)

  def apply(self, params, batch, *, key=None, hook=None):
    return lm_model.apply(params, self.spec, batch["tokens"][:, :-1], hook=hook,
                          logits_at=batch.get("logits_at"))


@pytest.fixture(scope="module")
def setup():
  params, pairs = tiny_llama_pairs(slice(1, 4), [7, 7, 7])
  s = activation_patching.Study(LlamaTask(), params, pairs)
  return s, params, pairs


@pytest.fixture(scope="module")
def es(setup):
  """The EdgeStudy of the tiny LLaMA's pairs (corrupt ablation), built once."""
  return edges_lib.EdgeStudy(setup[0])


# ------------------------------------------------------------------ the NumPy reference


def numpy_edges(params, tokens, ablated_edges=(), ablated=None, embed=None):
  """Float64 LLaMA forward from the formulas in which each named end reads
  sum over upstream nodes of (ablated[u] if "u -> end" is in ablated_edges else the
  node's output in this run); embed (B, T, D) replaces the input embedding. Returns
  (logits (B, T, V), {node name: output (B, T, D)})."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  cut = set(ablated_edges)
  out, order = {}, []

  def read(end):
    return sum(ablated[u] if f"{u} -> {end}" in cut else out[u] for u in order)

  def rms(s, x):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + SPEC.norm_eps) * s

  out["embed"] = p["embed"][np.asarray(tokens)] if embed is None else embed
  order.append("embed")
  b, t, _ = out["embed"].shape
  tri = np.tril(np.ones((t, t), bool))
  for i in range(L):
    lp, a = p["lm"][f"layer_{i}"], p["lm"][f"layer_{i}"]["attn"]
    ks, vs = [], []
    for g in range(G):
      hk, hv = rms(lp["ln1"]["scale"], read(f"lm.{i}.{g}.k")), rms(lp["ln1"]["scale"],
                                                                    read(f"lm.{i}.{g}.v"))
      k = hk @ a["wk"][:, g]
      ks.append(np.stack([numpy_rope(k[bb], np.arange(t), SPEC.rope_base) for bb in range(b)]))
      vs.append(hv @ a["wv"][:, g])
    new = {}
    for h in range(H):
      q = rms(lp["ln1"]["scale"], read(f"lm.{i}.{h}.q")) @ a["wq"][:, h]
      q = np.stack([numpy_rope(q[bb], np.arange(t), SPEC.rope_base) for bb in range(b)])
      k, v = ks[h // (H // G)], vs[h // (H // G)]
      s = np.einsum("btk,bsk->bts", q, k) / np.sqrt(K)
      s = np.where(tri, s, -np.inf)
      w = np.exp(s - s.max(-1, keepdims=True))
      w /= w.sum(-1, keepdims=True)
      new[f"lm.{i}.{h}"] = np.einsum("bts,bsk->btk", w, v) @ a["wo"][h]
    out.update(new)
    order += list(new)
    m = lp["mlp"]
    h2 = rms(lp["ln2"]["scale"], read(f"lm.{i}.mlp"))
    g1 = h2 @ m["w_gate"]
    out[f"lm.{i}.mlp"] = ((g1 / (1 + np.exp(-g1))) * (h2 @ m["w_up"])) @ m["w_down"]
    order.append(f"lm.{i}.mlp")
  x = rms(p["lm"]["ln_final"]["scale"], read("logits"))
  return x @ p["embed"].T, out


def ld_np(logits, pairs):
  rows = np.arange(len(pairs))
  last = logits[rows, pairs.length - 1]
  return last[rows, pairs.answer] - last[rows, pairs.wrong]


def test_the_graph_names_and_counts_its_nodes_and_edges(setup, es):
  s, _, _ = setup
  g = es.graph
  assert g.nodes[:6] == ["embed", "lm.0.0", "lm.0.1", "lm.0.2", "lm.0.3", "lm.0.mlp"]
  # layer 1: 4 query ends, 2 key and 2 value ends (kv heads), one MLP end; then logits
  assert g.ends[9:] == ["lm.1.0.q", "lm.1.1.q", "lm.1.2.q", "lm.1.3.q", "lm.1.0.k",
                        "lm.1.1.k", "lm.1.0.v", "lm.1.1.v", "lm.1.mlp", "logits"]
  names = g.edge_names()
  # attention ends read embed (+ layer 0's 5 nodes at layer 1); MLP ends also their heads
  n_edges = 8 * 1 + 5 + 8 * 6 + 10 + 11
  assert g.size() == {"nodes": 12, "heads": 8, "mlps": 2, "ends": 19, "edges": n_edges}
  assert len(names) == n_edges and len(set(names)) == n_edges
  assert "lm.0.2 -> lm.1.1.k" in names and "lm.1.mlp -> logits" in names
  assert "lm.1.0 -> lm.1.0.q" not in names and "lm.1.0 -> lm.1.mlp" in names
  assert g.end_node(g.ends.index("lm.1.1.k")) == [g.nodes.index("lm.1.2"),
                                                  g.nodes.index("lm.1.3")]


def test_exact_edge_patching_equals_numpy_substitution(setup, es):
  s, params, pairs = setup
  names = es.graph.edge_names()
  _, clean_out = numpy_edges(params, pairs.clean)
  _, corrupt_out = numpy_edges(params, pairs.corrupt)
  base = ld_np(numpy_edges(params, pairs.clean)[0], pairs).mean()
  np.testing.assert_allclose(es.m_full, base, atol=1e-4)
  rows = [0, 7, 13, 25, 40, 60, len(names) - 1]
  got = es.exact(rows)
  for r, g in zip(rows, got):
    lg, _ = numpy_edges(params, pairs.clean, [names[r]], corrupt_out)
    np.testing.assert_allclose(g, ld_np(lg, pairs).mean() - base, atol=1e-4)
  assert np.abs(got).max() > 1e-3
  # a circuit of many edges, through the batched curve program, mean and zero ablations
  rng = np.random.default_rng(0)
  cut = [n for n in names if rng.random() < 0.5]
  keep = es.keep_of([i for i, n in enumerate(names) if n not in cut])
  lg, _ = numpy_edges(params, pairs.clean, cut, corrupt_out)
  np.testing.assert_allclose(es.curve(keep[None])[0], ld_np(lg, pairs).mean(), atol=1e-4)


@pytest.mark.slow
def test_mean_and_zero_ablated_circuits_equal_numpy(setup):
  s, params, pairs = setup
  names = edges_lib.EdgeStudy(s).graph.edge_names()
  _, clean_out = numpy_edges(params, pairs.clean)
  rng = np.random.default_rng(1)
  cut = [n for n in names if rng.random() < 0.5]
  for kind, abl in (("zero", {u: 0 * v for u, v in clean_out.items()}),
                    ("mean", {u: np.broadcast_to(v.mean(0), v.shape) for u, v in
                              clean_out.items()}),
                    ("resample", {u: v[[1, 2, 0]] for u, v in clean_out.items()})):
    ek = edges_lib.EdgeStudy(s, ablation=kind)
    keep = ek.keep_of([i for i, n in enumerate(names) if n not in cut])
    lg, _ = numpy_edges(params, pairs.clean, cut, abl)
    np.testing.assert_allclose(ek.metric(keep), ld_np(lg, pairs).mean(), atol=1e-4)


def test_every_edge_kept_is_the_model_and_none_the_ablated_model(setup, es):
  s, params, pairs = setup
  np.testing.assert_allclose(es.m_full, s.ld_clean.mean(), atol=1e-5)
  np.testing.assert_allclose(es.m_empty, s.ld_corrupt.mean(), atol=1e-4)
  ez = edges_lib.EdgeStudy(s, ablation="zero")
  _, clean_out = numpy_edges(params, pairs.clean)
  lg, _ = numpy_edges(params, pairs.clean, ez.graph.edge_names(),
                      {u: 0 * v for u, v in clean_out.items()})
  np.testing.assert_allclose(ez.m_empty, ld_np(lg, pairs).mean(), atol=1e-4)
  assert abs(ez.m_empty - es.m_empty) > 1e-3
  assert es.faithfulness([es.m_full, es.m_empty]).tolist() == [1.0, 0.0]


def test_a_kv_edge_changes_exactly_the_query_heads_that_read_it(setup, es):
  s, params, pairs = setup
  names = es.graph.edge_names()
  z_of = jax.jit(lambda keep: interventions.run_with_hook(
      lambda hook: s.task.apply(params, {"tokens": s.tokens["clean"]}, hook=hook),
      edges_lib.graph_lib.edge_edits(es.graph, params, keep, es.ablated),
      read=es.sites + ("lm.1.attn.z",))[1]["lm.1.attn.z"])   # the edits read the sites
  base = {"lm.1.attn.z": z_of(np.ones(es.mask.shape, np.float32))}
  for end, heads in (("lm.1.1.k", {2, 3}), ("lm.1.0.v", {0, 1})):
    r = names.index(f"lm.0.1 -> {end}")
    keep = es.keep_of([i for i in range(len(names)) if i != r])
    vals = {"lm.1.attn.z": z_of(keep)}
    moved = np.abs(np.asarray(vals["lm.1.attn.z"] - base["lm.1.attn.z"])).max(axis=(0, 1, 3))
    assert {h for h in range(H) if moved[h] > 1e-3} == heads, (end, moved)  # float noise ~1e-5


def test_eap_equals_exact_patching_where_the_metric_is_linear_in_the_edge():
  params = lm_model.init(jax.random.PRNGKey(2), vocab_size=20, d_model=12, num_heads=3,
                         num_layers=2, d_ff=8, max_len=8, layer_norm=False, attn_only=True)
  params = jax.tree.map(lambda a: a * 3.0 if a.ndim == 3 else a, params)  # sharper heads
  params["embed"] = params["embed"] * 30.0
  rng = np.random.default_rng(1)
  clean = rng.integers(1, 20, (4, 6)).astype(np.int32)
  corrupt = rng.integers(1, 20, (4, 6)).astype(np.int32)
  pairs = Pairs(clean, corrupt, np.asarray([1, 2, 3, 4]), np.asarray([5, 6, 7, 8]),
                np.full(4, 6), [{}] * 4)
  es = edges_lib.EdgeStudy(activation_patching.Study(LinearTask(), params, pairs))
  ends = [es.graph.ends[e] for e in es.edges[:, 1]]
  # into the logits, or into a last-layer value (its pattern unchanged): linear
  linear = [i for i, e in enumerate(ends) if e == "logits" or e.startswith("lm.1.")
            and e.endswith(".v")]
  ex, eap = es.exact(), es.eap()
  np.testing.assert_allclose(eap[linear], ex[linear], rtol=1e-5, atol=1e-4)
  assert np.abs(ex[linear]).max() > 1e-3
  nonlinear = [i for i, e in enumerate(ends) if e.endswith(".k") and e.startswith("lm.1.")]
  assert np.abs(eap[nonlinear] - ex[nonlinear]).max() > 1e-3
  # EAP from one backward to the ends = minus the gradient of the edge mask at 1
  g = jax.grad(lambda k: es.pairs_metric(params, k, es.ablated).mean())(
      np.ones(es.mask.shape, np.float32))
  np.testing.assert_allclose(eap, -np.asarray(g)[es.edges[:, 0], es.edges[:, 1]],
                             rtol=1e-3, atol=1e-3)     # float32 sums in another order
  ig1 = es.eap_ig(1, on="inputs", points="midpoint")     # alpha 1/2: not EAP
  assert np.abs(ig1 - eap).max() > 1e-3


@pytest.mark.slow
def test_eap_ig_on_the_edge_mask_is_complete():
  # EAP-IG on the edge mask sums to m(M) - m(empty) (completeness; a gentle model)
  rng = np.random.default_rng(1)
  pairs = Pairs(rng.integers(1, 20, (4, 6)).astype(np.int32),
                rng.integers(1, 20, (4, 6)).astype(np.int32), np.asarray([1, 2, 3, 4]),
                np.asarray([5, 6, 7, 8]), np.full(4, 6), [{}] * 4)
  params = lm_model.init(jax.random.PRNGKey(2), vocab_size=20, d_model=12, num_heads=3,
                         num_layers=2, d_ff=8, max_len=8, layer_norm=False, attn_only=True)
  params["embed"] = params["embed"] * 30.0
  es = edges_lib.EdgeStudy(activation_patching.Study(LinearTask(), params, pairs))
  iga = es.eap_ig(16, on="activations", points="midpoint")
  np.testing.assert_allclose(-iga.sum(), es.m_full - es.m_empty, rtol=1e-2)


@pytest.mark.slow
def test_eap_ig_on_inputs_is_the_averaged_gradient(setup, es):
  s, params, pairs = setup
  ig = es.eap_ig(2, on="inputs", points="midpoint")
  # by hand: at alpha in (1/4, 3/4), the embedding between corrupt and clean, the edge
  # deltas (A_u - a_u(clean)) fixed; minus the mean gradient of the metric
  import jax.numpy as jnp
  ones = jnp.ones(es.mask.shape)
  ce, ae = es.clean_out[:, :, 0], es.ablated[:, :, 0]
  gs = [jax.grad(lambda k, a=a: es.pairs_metric(params, k, es.ablated, es.clean_out,
                                                  ae + a * (ce - ae)).mean())(ones)
        for a in (0.25, 0.75)]
  want = -np.asarray((gs[0] + gs[1]) / 2)[es.edges[:, 0], es.edges[:, 1]]
  np.testing.assert_allclose(ig, want, atol=1e-5)
  ag = es.agreement(ig, sample=30, top=5)
  iga = es.eap_ig(2, on="activations", points="midpoint")     # on the edge mask: keep = alpha everywhere
  gs = [jax.grad(lambda k: es.pairs_metric(params, k, es.ablated).mean())(ones * a)
        for a in (0.25, 0.75)]
  want = -np.asarray((gs[0] + gs[1]) / 2)[es.edges[:, 0], es.edges[:, 1]]
  np.testing.assert_allclose(iga, want, atol=1e-5)
  assert ag["n"] == 30 and -1 <= ag["spearman"] <= 1 and ag["sampled_of"] == len(es.edges)


def test_ablation_kinds_equal_their_definitions():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, 4, 2, 5))
  xc = rng.normal(size=x.shape)
  ref = rng.normal(size=(6, 4, 2, 5))
  np.testing.assert_array_equal(ablations.values("zero", x), np.zeros_like(x))
  np.testing.assert_allclose(ablations.values("corrupt", x, corrupt=xc), xc)
  np.testing.assert_allclose(ablations.values("resample", x), x[[1, 2, 0]])
  np.testing.assert_allclose(ablations.values("resample", x, perm=[2, 0, 1]), x[[2, 0, 1]])
  m = ablations.values("mean", x, reference=ref)
  for b in range(3):
    for t in range(4):
      np.testing.assert_allclose(m[b, t], sum(ref[r, t] for r in range(6)) / 6, atol=1e-6)
  m2 = ablations.values("mean", x, reference=ref, per_position=False)
  np.testing.assert_allclose(m2[2, 1], ref.reshape(24, 2, 5).mean(0), atol=1e-6)
  e = ablations.edit("zero", x, heads=1)
  got = interventions.apply_edit(e, "lm.0.attn.z", np.asarray(x, np.float32))
  want = x.copy()
  want[:, :, 1] = 0
  np.testing.assert_allclose(got, want, atol=1e-6)
  with pytest.raises(UserError, match="ablation must be one of"):
    ablations.values("shuffle", x)


def test_top_n_prunes_edges_that_no_longer_connect(setup, es):
  s, _, _ = setup
  g, names = es.graph, es.graph.edge_names()
  want = ["embed -> lm.0.0.v", "lm.0.1 -> lm.1.0.q", "lm.1.0 -> logits",
          "lm.0.3 -> lm.1.mlp"]          # the last: lm.0.3 is never reached from embed
  scores = np.asarray([len(want) - want.index(n) if n in want else 0.0 for n in names])
  keep = search.top_n(g, es.edges, scores, len(want))
  kept = {names[i] for i, (u, e) in enumerate(es.edges) if keep[u, e]}
  assert kept == set(want[:3])
  # a dead end: lm.0.2 feeds lm.1.3's query, which nothing downstream reads
  keep2 = search.top_n(g, es.edges, scores + np.asarray(
      [9.0 if n in ("embed -> lm.0.2.q", "lm.0.2 -> lm.1.3.q") else 0 for n in names]), 5)
  kept2 = {names[i] for i, (u, e) in enumerate(es.edges) if keep2[u, e]}
  assert kept2 == set(want[:3])
  assert search.touched(g, keep)["heads"] == ["lm.0.1", "lm.1.0"]


def test_curve_areas_and_greedy(setup, es):
  s, _, _ = setup
  ex = es.exact()
  pts, keeps = search.curve(es, ex, [1, 5, 20, len(es.edges)])
  assert pts[-1]["kept"] == len(es.edges) and abs(pts[-1]["faithfulness"] - 1) < 1e-5
  for p, k in zip(pts, keeps):
    assert abs(p["faithfulness"] - es.faithfulness(es.metric(k))) < 1e-4
  a = search.areas([1.0, 0.5], [1.0, 0.5])
  assert a == {"cpr": pytest.approx(0.375), "cmd": pytest.approx(0.125)}
  # MIB's ten fractions, int(k * n) edges each, and a midpoint between neighbours
  n = search.sizes(1000)
  assert n[::2] == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000] and n[1] == 1 and len(n) == 19
  assert search.sizes(100)[:3] == [0, 0, 0]                # the empty circuit, as MIB's
  pts = [{"requested": k, "faithfulness": f} for k, f in
         zip(search.fractions(), np.linspace(0.2, 1.0, 19))]
  want = sum((b - a) * (fa + fb) / 2 for a, b, fa, fb in zip(
      search.MIB_FRACTIONS, search.MIB_FRACTIONS[1:], [p["faithfulness"] for p in pts[::2]],
      [p["faithfulness"] for p in pts[2::2]]))
  assert search.curve_areas(pts)["cpr"] == pytest.approx(want)
  keep = search.greedy(es, threshold=0.02)
  assert 0 < keep.sum() < len(es.edges)
  f = es.faithfulness(es.metric(keep))
  assert abs(f - 1) < 0.02 * len(es.edges)    # each removal moved m by < 2 %
  with pytest.raises(UserError, match="threshold"):
    search.greedy(es, threshold=1.5)


def test_node_view_equals_patching_the_other_heads(setup):
  s, params, pairs = setup
  got = search.node_view(s, ["lm.0.1", "lm.1.2"])
  zc = s.values("corrupt", ("lm.0.attn.z", "lm.1.attn.z"))
  edits = {"lm.0.attn.z": interventions.replace(zc["lm.0.attn.z"], heads=[0, 2, 3]),
           "lm.1.attn.z": interventions.replace(zc["lm.1.attn.z"], heads=[0, 1, 3])}
  ld_set = s.edited("clean", edits)["ld"].mean()
  none = {n: interventions.replace(v) for n, v in zc.items()}
  ld_none = s.edited("clean", none)["ld"].mean()
  want = (ld_set - ld_none) / (s.ld_clean.mean() - ld_none)
  np.testing.assert_allclose(got["faithfulness_nodes"], want, rtol=1e-5)
  full = search.node_view(s, [f"lm.{i}.{h}" for i in range(L) for h in range(H)])
  np.testing.assert_allclose(full["faithfulness_nodes"], 1.0, atol=1e-5)
