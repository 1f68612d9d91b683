"""DIR/primer.html: the first seed document's figures, interactive and offline.

Every number on the page is computed here by the project's own code (the attention
function and its building blocks, the accounting, the trained toy models of the claims
run) and embedded as JSON; the page's script only draws and looks up precomputed grids
as sliders move. No network request: inline script and style, no external resource.
"""

from __future__ import annotations

import json

import jax
import numpy as np

from mha_jax import storage
from mha_jax import accounting
from mha_jax import attention as A
from mha_jax.claims import experiments as E


def _r(x, nd: int = 4):
  return np.round(np.asarray(x, np.float64), nd).tolist()


def page_data(ctx: E.Context) -> dict:
  params, x, r, names = E.sentence_layer()
  w = np.asarray(r.weights)[0]                                       # (H, T, S)
  heads = np.asarray(r.heads)[0]                                     # (T, H, K)
  wo = np.asarray(params["wo"])
  data = {"sentence": list(E.SENTENCE), "head_names": names, "weights": _r(w),
          "head_outputs": _r(heads), "signal": E.SIGNAL}
  mix = E.mixture_curve()
  grid = np.linspace(0, 1, 21)
  rows_by_query = []
  for q in range(len(E.SENTENCE)):
    rows_by_query.append(_r(E.mixture_curve(q, grid)["rows"]))
  data["mixture"] = {"ratios": _r(mix["ratios"]), "peak": _r(mix["peak"]),
                     "rows_by_query": rows_by_query}
  d = 8
  cuts = {}
  xq = jax.random.normal(jax.random.PRNGKey(3), (d,))
  wq = E.init_params(jax.random.PRNGKey(1), d, 1)["wq"]
  for h in (1, 2, 4, 8):
    shapes = A.param_shapes(d, h, d // h)
    cuts[str(h)] = {"d_k": d // h, "shapes": {k: list(v) for k, v in shapes.items()},
                    "params": accounting.attention_params(d, h),
                    "reads": _r(E.q_jacobian({"wq": wq.reshape(d, h, d // h)}, xq) > 0, 0)}               # (D, H)
  data["cuts"] = {"d_model": d, "by_h": cuts}
  data["divisor"] = _r_tree(ctx.cache.get("divisor_curves") or E.divisor_curves())
  slider = E.wo_slider(heads[4], wo, head=0)
  data["wo"] = {"token": E.SENTENCE[4], "trained": ctx.cache.get("wo_slider") is not None,
                "sentence": _r_tree(slider)}
  if ctx.cache.get("wo_slider"):
    data["wo"]["trained_layer"] = _r_tree(ctx.cache["wo_slider"])
  cost = ctx.cache.get("cost_table")
  if cost is None:                                    # formulas + pytrees, no compile
    hs = list(E.COST_HEADS)
    cost = {"d_model": 768, "seq_len": 256, "heads": hs,
            "params": [accounting.attention_params(768, h) for h in hs],
            "flops_xla": None,
            "flops_formula": accounting.attention_flops(768, 256)["total"],
            "score_bytes": [accounting.score_memory_bytes(1, h, 256) for h in hs]}
  data["cost"] = _r_tree(cost)
  if ctx.cache.get("compromise_example") is not None:
    data["compromise"] = _r_tree(ctx.cache["compromise_example"])
  dk1 = ctx.cache.get("dk1_example")
  if dk1 is not None:
    data["dk1"] = _r_tree(dk1)
  return data


def _r_tree(x):
  if isinstance(x, dict):
    return {k: _r_tree(v) for k, v in x.items()}
  if isinstance(x, (list, tuple, np.ndarray)):
    return [_r_tree(v) for v in x]
  if isinstance(x, (float, np.floating)):
    return round(float(x), 5)
  if isinstance(x, np.integer):
    return int(x)
  return x


def write(ctx: E.Context, path: str) -> dict:
  data = page_data(ctx)
  blob = json.dumps(data).replace("</", "<\\/")
  storage.write_text(path, PAGE.replace("__DATA__", blob))
  return data


PAGE = r"""<!doctype html>
<html><head><meta charset="utf-8"><title>Multi-head attention: a primer, measured</title>
<style>
body{font:15px/1.45 system-ui,sans-serif;max-width:860px;margin:24px auto;padding:0 12px;color:#222}
h2{margin-top:34px;border-bottom:1px solid #ddd}
.fig{border:1px solid #e4e4e4;border-radius:6px;padding:10px;margin:10px 0}
.ctl{margin:6px 0} .ctl input[type=range]{width:320px;vertical-align:middle}
.note{color:#666;font-size:13px} .num{font-family:monospace}
svg text{font:11px system-ui,sans-serif}
</style></head><body>
<h1>Multi-head attention, measured</h1>
<p class="note">Every number on this page was computed by mha-jax (its attention function
and building blocks, its accounting, and models trained by <code>mha-jax claims</code>) and
embedded below; the page makes no network request.</p>

<h2>1. One head, one mixture</h2>
<p>A positional head (previous token) and a syntactic head (the dependency partner), run
through the attention function on "<span id="sent"></span>". Drag the query:</p>
<div class="fig" id="f-query"><div class="ctl">query <input type="range" id="q" min="0" max="5" value="4">
<b id="qname"></b></div><svg id="s-query" width="820" height="170"></svg></div>

<p>One head has no third option: it mixes. Slide from purely positional to purely syntactic
and read the peak at the query "it":</p>
<div class="fig" id="f-mix"><div class="ctl">mix <input type="range" id="mix" min="0" max="20" value="0">
<span class="num" id="mixval"></span></div><svg id="s-mix" width="820" height="190"></svg></div>

<p>The same, trained: one attention layer asked for the previous token and the latest
earlier "noun" at once (the two-target toy task, equal parameters for every h):</p>
<div class="fig" id="f-trained"><div class="ctl">query <input type="range" id="qt" min="2" max="11" value="8">
<span class="num" id="qtval"></span></div><svg id="s-trained" width="820" height="330"></svg>
<p class="note" id="qtnote"></p></div>

<h2>2. Cutting d_model into h heads</h2>
<div class="fig" id="f-cut"><div class="ctl">h <input type="range" id="h" min="0" max="3" value="2">
<span class="num" id="hval"></span></div>
<div class="ctl"><label><input type="checkbox" id="reads"> show what each head reads (gradient of its q w.r.t. the 8 inputs)</label></div>
<svg id="s-cut" width="820" height="200"></svg></div>

<h2>3. The divisor</h2>
<p>Each head divides by its own sqrt(d_k). Same signal, three divisors:</p>
<div class="fig" id="f-div"><div class="ctl">d_k <input type="range" id="dk" min="0" max="7" value="0">
<span class="num" id="dkval"></span></div><svg id="s-div" width="820" height="220"></svg></div>

<h2>4. Four kinds of head</h2>
<div class="fig" id="f-types"><div class="ctl">query <input type="range" id="q4" min="0" max="5" value="4">
<b id="q4name"></b></div><svg id="s-types" width="820" height="230"></svg></div>

<h2>5. Concatenate, then W_O mixes</h2>
<div class="fig" id="f-wo"><div class="ctl">W_O mixing <input type="range" id="wo" min="0" max="10" value="0">
<span class="num" id="woval"></span></div><svg id="s-wo" width="820" height="210"></svg>
<p class="note" id="wonote"></p></div>

<h2>6. What h costs</h2>
<div class="fig" id="f-cost"><div class="ctl">h <input type="range" id="hc" min="0" max="12" value="6">
<span class="num" id="hcval"></span></div><svg id="s-cost" width="820" height="210"></svg></div>

<h2>7. d_k = 1</h2>
<div class="fig" id="f-dk1"><div class="ctl">query <input type="range" id="q1" min="1" max="11" value="11">
<span class="num" id="q1val"></span></div><svg id="s-dk1" width="820" height="210"></svg>
<p class="note" id="dk1note"></p></div>

<script>
"use strict";
const D = __DATA__;
const $ = id => document.getElementById(id);
const C = ["#1f77b4", "#2ca02c", "#d62728", "#9a9a9a", "#9467bd", "#ff7f0e"];
function esc(s){return String(s).replace(/[&<>]/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;"}[c]));}
function bars(x0, y0, w, h, vals, labels, color, title, hi){
  let s = `<text x="${x0}" y="${y0-6}">${esc(title)}</text>`;
  const bw = w / vals.length, mx = Math.max(1e-9, ...vals.map(Math.abs));
  vals.forEach((v, i) => {
    const bh = h * Math.abs(v) / mx, x = x0 + i * bw;
    s += `<rect class="bar" data-v="${v}" x="${x+2}" y="${y0+h-bh}" width="${bw-4}" height="${bh}" fill="${color}" opacity="${hi===i?1:0.75}"/>`;
    s += `<text x="${x+bw/2}" y="${y0+h+13}" text-anchor="middle">${esc(labels[i])}</text>`;
    s += `<text x="${x+bw/2}" y="${y0+h-bh-3}" text-anchor="middle">${v.toFixed(2)}</text>`;
  });
  return s;
}
function line(x0, y0, w, h, xs, series, mark, xlab, logx){
  const X = v => logx ? Math.log2(v) : v;
  const xmin = X(xs[0]), xmax = X(xs[xs.length-1]);
  const all = series.flatMap(s => s.ys.filter(v => v !== null));
  const ymin = Math.min(0, ...all), ymax = Math.max(...all) * 1.05 || 1;
  const px = v => x0 + w * (X(v) - xmin) / (xmax - xmin || 1);
  const py = v => y0 + h - h * (v - ymin) / (ymax - ymin || 1);
  let s = `<line x1="${x0}" y1="${y0+h}" x2="${x0+w}" y2="${y0+h}" stroke="#999"/>`;
  s += `<text x="${x0+w/2}" y="${y0+h+26}" text-anchor="middle">${esc(xlab)}</text>`;
  const every = Math.ceil(xs.length / 9);
  xs.forEach((v, i) => { if (i % every === 0) s += `<text x="${px(v)}" y="${y0+h+13}" text-anchor="middle">${+(+v).toFixed(2)}</text>`; });
  series.forEach((se, k) => {
    const pts = xs.map((v, i) => se.ys[i] === null ? null : `${px(v)},${py(se.ys[i])}`).filter(p => p);
    s += `<polyline fill="none" stroke="${se.color||C[k]}" stroke-width="2" points="${pts.join(" ")}"/>`;
    s += `<text x="${x0+w+6}" y="${y0+14+14*k}" fill="${se.color||C[k]}">${esc(se.name)}</text>`;
    if (mark !== null && se.ys[mark] !== null)
      s += `<circle class="mark" cx="${px(xs[mark])}" cy="${py(se.ys[mark])}" r="5" fill="${se.color||C[k]}"/>`;
  });
  return s;
}
function heat(x0, y0, cell, m, title, hiRow){
  let s = `<text x="${x0}" y="${y0-6}">${esc(title)}</text>`;
  m.forEach((row, i) => row.forEach((v, j) => {
    s += `<rect x="${x0+j*cell}" y="${y0+i*cell}" width="${cell-1}" height="${cell-1}" fill="rgba(31,119,180,${v})" stroke="${i===hiRow?'#000':'none'}"/>`;
  }));
  return s;
}
const S = D.sentence;
$("sent").textContent = S.join(" ");

function drawQuery(){
  const q = +$("q").value; $("qname").textContent = S[q];
  $("s-query").innerHTML = bars(10, 20, 380, 110, D.weights[0][q], S, C[0], "positional head (previous token)", null)
    + bars(420, 20, 380, 110, D.weights[1][q], S, C[1], "syntactic head (dependency partner)", null);
}
function drawMix(){
  const i = +$("mix").value, m = D.mixture.ratios[i];
  const row = D.mixture.rows_by_query[4][i];
  $("mixval").textContent = `${m.toFixed(2)} syntactic, peak ${Math.max(...row).toFixed(3)}`;
  $("s-mix").innerHTML = bars(10, 20, 360, 120, row, S, C[4], "one head's weights at 'it'", null)
    + line(430, 20, 300, 120, D.mixture.ratios.map(r => +r.toFixed(2)), [{name: "peak", ys: D.mixture.peak}], i, "mix ratio", false);
}
function drawTrained(){
  if (!D.compromise) { $("qtnote").textContent = "Not computed in this run (the one_head_compromises claim trains these models)."; $("s-trained").innerHTML = ""; return; }
  const e = D.compromise, t = +$("qt").value, p = e.partner[t], n = t + 1;
  const lab = e.tokens.slice(0, n).map((x, j) => (j === t - 1 ? "prev " : j === p ? "partner " : "") + x);
  $("qtval").textContent = `query ${t}: previous token at ${t - 1}, partner at ${p < 0 ? "none" : p}`;
  $("s-trained").innerHTML = bars(10, 20, 800, 70, e.h1[0][t].slice(0, n), lab, C[4], "h = 1: its one head", null)
    + bars(10, 130, 390, 70, e.h2[0][t].slice(0, n), lab, C[0], "h = 2: head 0", null)
    + bars(420, 130, 390, 70, e.h2[1][t].slice(0, n), lab, C[1], "h = 2: head 1", null);
  $("qtnote").textContent = "held-out loss by h: " + Object.entries(e.loss).map(([h, l]) => `h=${h}: ${l.toFixed(3)}`).join(", ");
}
function drawCut(){
  const hs = ["1", "2", "4", "8"], h = hs[+$("h").value], c = D.cuts.by_h[h], d = D.cuts.d_model;
  $("hval").textContent = `h = ${h}, d_k = ${c.d_k}; W_Q, W_K, W_V, W_O hold ${c.params} numbers for every h`;
  let s = "";
  ["W_Q", "W_K", "W_V"].forEach((nm, m) => {
    const x0 = 20 + m * 200, cell = 18;
    s += `<text x="${x0}" y="14">${nm} (${d} x ${d}), cut into ${h} x ${c.d_k} columns</text>`;
    for (let i = 0; i < d; i++) for (let j = 0; j < d; j++) {
      const head = Math.floor(j / c.d_k);
      s += `<rect class="cell" x="${x0+j*cell}" y="${22+i*cell}" width="${cell-1}" height="${cell-1}" fill="${C[head % 6]}" opacity="${$("reads").checked ? (c.reads[i][head] ? 0.9 : 0.1) : 0.35 + 0.5*(head % 2)}"/>`;
    }
  });
  $("s-cut").innerHTML = s;
}
function drawDiv(){
  const i = +$("dk").value, dv = D.divisor, names = Object.keys(dv.peak);
  $("dkval").textContent = `d_k = ${dv.d_k[i]}: peak ` + names.map(n => `${n} ${dv.peak[n][i].toFixed(3)}`).join(", ");
  $("s-div").innerHTML = line(40, 20, 280, 150, dv.d_k, names.map(n => ({name: n, ys: dv.peak[n]})), i, "d_k (peak weight)", true)
    + line(470, 20, 240, 150, dv.d_k, names.map(n => ({name: n, ys: dv.entropy[n]})), i, "d_k (entropy, nats)", true);
}
function drawTypes(){
  const q = +$("q4").value; $("q4name").textContent = S[q];
  let s = "";
  D.head_names.forEach((nm, h) => { s += heat(20 + h * 200, 24, 26, D.weights[h], nm, q); });
  $("s-types").innerHTML = s;
}
function drawWO(){
  const i = +$("wo").value, src = D.wo.trained_layer || D.wo.sentence, a = src.alphas[i];
  const per = src.per_head[i], k = src.d_k;
  const y = per[0].map((_, j) => per.reduce((t, row) => t + row[j], 0));
  $("woval").textContent = `${a.toFixed(1)}: ${(100*src.other_share[i]).toFixed(1)} % of head 0's slot comes from the other heads`;
  $("wonote").textContent = D.wo.trained_layer ? "W_O of a trained layer (the two-target toy model, h = 4); output of one token." :
    "W_O at initialisation on the sentence's four heads (train a layer with `mha-jax claims` to see a trained one).";
  $("s-wo").innerHTML = bars(10, 20, 800, 130, y, y.map((_, j) => j < k ? `h0.${j}` : `${j}`), C[0], "the layer's output: head 0's slot first", null);
}
function drawCost(){
  const i = +$("hc").value, c = D.cost, h = c.heads[i];
  $("hcval").textContent = `h = ${h}, d_k = ${c.d_model / h}: params ${c.params[i].toLocaleString()}, score bytes ${c.score_bytes[i].toLocaleString()}` +
    (c.flops_xla ? `, XLA FLOPs ${(c.flops_xla[i]/1e9).toFixed(3)} G (formula ${(c.flops_formula/1e9).toFixed(3)} G)` : "");
  const f = c.flops_xla ? c.flops_xla.map(v => v / c.flops_formula) : c.heads.map(() => null);
  $("s-cost").innerHTML = line(40, 20, 280, 140, c.heads, [{name: "params / 4D^2", ys: c.params.map(p => p / c.params[0])},
      {name: "XLA FLOPs / formula", ys: f}], i, "h at d_model 768", true)
    + line(470, 20, 240, 140, c.heads, [{name: "score MiB", ys: c.score_bytes.map(b => b / 1048576), color: C[2]}], i, "h", true);
}
function drawDk1(){
  if (!D.dk1) { $("dk1note").textContent = "Not computed in this run (the dk1 claim trains the d_k = 1 model)."; $("s-dk1").innerHTML = ""; return; }
  const t = +$("q1").value, e = D.dk1, ks = e.keys.slice(0, t + 1), q = e.queries[t], w = e.weights[t].slice(0, t + 1);
  const top = w.indexOf(Math.max(...w)), ext = q > 0 ? ks.indexOf(Math.max(...ks)) : ks.indexOf(Math.min(...ks));
  $("q1val").textContent = `query ${t}: q = ${q.toFixed(3)}; argmax weight at key ${top}; ${q > 0 ? "largest" : "smallest"} key at ${ext}`;
  $("s-dk1").innerHTML = bars(10, 20, 380, 120, ks, ks.map((_, j) => j), C[5], "scalar keys k_j (one head, d_k = 1)", ext)
    + bars(420, 20, 380, 120, w, w.map((_, j) => j), C[0], "its weights for this query", top);
  $("dk1note").textContent = `Trained model with h = d_model = ${e.d_model}: ${(100*e.share).toFixed(2)} % of rows put their argmax on an extreme key. Loss by h: ` +
    Object.entries(e.loss_by_h).map(([h, l]) => `h=${h}: ${l.toFixed(3)}`).join(", ");
}
const draws = {q: drawQuery, mix: drawMix, qt: drawTrained, h: drawCut, reads: drawCut, dk: drawDiv, q4: drawTypes, wo: drawWO, hc: drawCost, q1: drawDk1};
for (const [id, fn] of Object.entries(draws)) { $(id).addEventListener("input", fn); $(id).addEventListener("change", fn); }
Object.values(draws).forEach(fn => fn());
</script></body></html>
"""
