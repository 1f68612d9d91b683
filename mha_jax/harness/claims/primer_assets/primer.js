"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
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
function div(v, lim){   // blue - white - red
  const a = Math.min(1, Math.abs(v) / (lim || 1)), c = v >= 0 ? [178, 24, 43] : [33, 102, 172];
  return "rgb(" + c.map(x => Math.round(255 + (x - 255) * a)).join(",") + ")";
}
function drawMats(){
  const m = D.matrices, cuts = Object.keys(m.cuts), h = cuts[+$("hm").value], dk = m.cuts[h], d = m.d_model;
  $("hm").max = cuts.length - 1;
  const lim = Math.max(...Object.values(m.matrices).flat(2).map(Math.abs));
  $("hmval").textContent = `h = ${h}, d_k = ${dk}: the same ${4*d*d} numbers; stored as wq ${JSON.stringify([d, +h, dk])}, wo ${JSON.stringify([+h, dk, d])}`;
  const cell = 20;
  let s = "";
  Object.entries(m.matrices).forEach(([nm, mat], n) => {
    const x0 = 14 + n * 200, y0 = 40, rows = nm === "W_O";
    s += `<text x="${x0}" y="14">${nm} (${d} x ${d}), heads: ${rows ? "row" : "column"} blocks</text>`;
    mat.forEach((row, i) => row.forEach((v, j) => {
      s += `<rect class="mcell" data-m="${nm}" data-i="${i}" data-j="${j}" data-v="${v}" x="${x0+j*cell}" y="${y0+i*cell}" width="${cell-1}" height="${cell-1}" fill="${div(v, lim)}"><title>${nm}[${i},${j}] = ${v}</title></rect>`;
    }));
    for (let b = 0; b <= +h; b++) {
      const at = b * dk;
      s += rows ? `<line class="block" data-m="${nm}" data-at="${at}" x1="${x0-3}" y1="${y0+at*cell-0.5}" x2="${x0+d*cell+2}" y2="${y0+at*cell-0.5}" stroke="#000" stroke-width="2"/>`
                : `<line class="block" data-m="${nm}" data-at="${at}" x1="${x0+at*cell-0.5}" y1="${y0-3}" x2="${x0+at*cell-0.5}" y2="${y0+d*cell+2}" stroke="#000" stroke-width="2"/>`;
      if (b < +h) s += rows ? `<text x="${x0+d*cell+4}" y="${y0+(at+dk/2)*cell+4}">${b}</text>`
                            : `<text x="${x0+(at+dk/2)*cell}" y="${y0-6}" text-anchor="middle">${b}</text>`;
    }
  });
  $("s-mats").innerHTML = s;
  $("matsnote").textContent = `Numbers of the layer's four matrices (blue negative, red positive). Lines: the ${h} head blocks of width d_k = ${dk}; the layer's stored shapes are ` +
    Object.entries(m.stored).map(([k, v]) => `${k} ${JSON.stringify(v)}`).join(", ") + " (h = " + m.heads + ").";
}
function drawZoo(){
  const z = D.seven_lines;
  $("code").textContent = z.code.join("\n");
  const cols = ["model", "d_model", "h", "h_kv", "d_k", "wq stored", "input", "output", "params (formula)", "XLA FLOPs (matmul formula)"];
  let t = "<tr>" + cols.map(c => `<th>${esc(c)}</th>`).join("") + "</tr>";
  z.rows.forEach(r => {
    t += `<tr class="zrow" data-model="${esc(r.model)}"><td>${esc(r.model)}</td><td>${r.d_model}</td><td>${r.heads}</td><td>${r.kv_heads}</td><td>${r.d_k}</td>` +
      `<td>${JSON.stringify(r.stored.wq)}</td><td>${JSON.stringify(r.input_shape)}</td><td class="out">${JSON.stringify(r.output_shape)}</td>` +
      `<td class="params" data-v="${r.params}">${r.params.toLocaleString()} (${r.params_formula.toLocaleString()})</td>` +
      `<td class="flops" data-v="${r.flops}">${(r.flops/1e6).toFixed(1)} M (${(r.flops_formula/1e6).toFixed(1)} M)</td></tr>`;
  });
  $("zoo").innerHTML = t;
  $("zoonote").textContent = "Measured by running: the output's shape, the parameters the layer holds and XLA's FLOP count of the compiled program (its softmax and scaling on top of the matmuls); weights are zeros, the input random. Parameters and FLOPs follow d_model, not h; d_k stays at 64-128 while h grows.";
}
function drawPrune(){
  const P = D.pruning;
  if (!P) { $("prnote").textContent = "Not in this page: no pruned translation run was given (the pruning claim of `mha-jax claims` makes one; or python -m mha_jax.claims.primer --pruning-workdir W)."; $("s-prune").setAttribute("height", 0); $("f-prune").querySelector(".ctl").style.display = "none"; return; }
  const order = Object.keys(P.removed_rank), cell = 44;
  if ($("pr").max !== String(order.length)) { $("pr").max = order.length; $("pr").value = order.length; }
  const n = +$("pr").value;
  const gone = new Set(order.filter(h => P.removed_rank[h] <= (n ? P.removed_rank[order[n-1]] : 0)));
  $("prval").textContent = `${gone.size} of ${order.length} removed (${P.layers * P.heads - gone.size} left; ${P.kept.length} kept at the end)`;
  const used = [...new Set(Object.values(P.roles))];
  $("prlegend").innerHTML = used.map(r => `<span style="background:${P.colors[r] || "#999"}">${esc(r)}</span>`).join("") + " black border: kept; number: order of removal (1 = first)";
  let s = "";
  for (let l = 0; l < P.layers; l++) {
    s += `<text x="4" y="${30+l*cell+cell/2}">${esc(P.stack)} ${l}</text>`;
    for (let h = 0; h < P.heads; h++) {
      const name = `${P.stack}.${l}.${h}`, role = P.roles[name] || "other", kept = P.kept.includes(name), r = P.removed_rank[name];
      const x = 80 + h * cell, y = 20 + l * cell;
      s += `<rect class="phead${kept ? " kept" : ""}" data-head="${name}" data-role="${role}" data-rank="${r === undefined ? "" : r}" x="${x}" y="${y}" width="${cell-6}" height="${cell-6}" fill="${P.colors[role] || "#999"}" opacity="${gone.has(name) ? 0.18 : 1}" stroke="${kept ? "#000" : "none"}" stroke-width="3"><title>${name}: ${role}${kept ? ", kept" : `, removed ${r}`}</title></rect>`;
      if (r !== undefined) s += `<text x="${x+(cell-6)/2}" y="${y+(cell-6)/2+4}" text-anchor="middle">${r}</text>`;
    }
  }
  for (let h = 0; h < P.heads; h++) s += `<text x="${80+h*cell+(cell-6)/2}" y="14" text-anchor="middle">head ${h}</text>`;
  $("s-prune").setAttribute("height", 30 + P.layers * cell);
  $("s-prune").innerHTML = s;
  const fmt = o => Object.entries(o).filter(([, v]) => v).map(([k, v]) => `${v} ${k}`).join(", ");
  $("prnote").textContent = `${P.method} pruning of ${P.workdir}: kept ${P.kept.length} of ${order.length + P.kept.length} heads (${fmt(P.roles_kept)}); all heads: ${fmt(P.roles_all)}. ` +
    `Specialised (positional, syntactic, rare): ${(100*P.specialised_share_kept).toFixed(0)} % of the kept against ${(100*P.specialised_share_all).toFixed(0)} % of all; the first ${P.kept.length} removed: ${fmt(P.first_removed_roles)}.` +
    ` Kept${P.method === "l0" ? ", strongest gate first" : ""}: ` + P.kept.map(h => `${h} (${P.roles[h] || "other"})`).join(", ") + "." +
    (P.bleu_kept !== null ? ` BLEU ${P.bleu_all === null ? "" : P.bleu_all.toFixed(1) + " with all heads, "}${P.bleu_kept.toFixed(1)} with the kept.` : "");
}
function drawText(){
  const T = D.text_circuit;
  if (!T) { $("textnote").textContent = "Not in this page: no natural-text model was given (train configs/attn_only_text.py, then python -m mha_jax.claims.primer --text-workdir W)."; return; }
  const n = T.tokens.length, cell = Math.min(18, Math.floor(360 / n)), lab = T.tokens;
  let s = "";
  [T.previous_token_head, T.induction_head].forEach((name, k) => {
    const x0 = 60 + k * 410, y0 = 40, w = T.patterns[name];
    s += `<text x="${x0}" y="14">${k ? "induction head" : "previous-token head"} ${name}: ${k ? "prefix matching " + T.scores[name].prefix_matching.toFixed(3) : "attention to t-1 " + T.scores[name].previous_token.toFixed(3)}</text>`;
    w.forEach((row, i) => { s += `<text x="${x0-4}" y="${y0+i*cell+cell-4}" text-anchor="end">${esc(lab[i])}</text>`;
      row.forEach((v, j) => { s += `<rect class="tcell" data-head="${name}" data-i="${i}" data-j="${j}" data-v="${v}" x="${x0+j*cell}" y="${y0+i*cell}" width="${cell-1}" height="${cell-1}" fill="rgba(31,119,180,${v})"/>`; }); });
  });
  const names = Object.keys(T.k_composition), vals = names.map(h => T.k_composition[h]);
  const y1 = 60 + n * cell;
  s += `<text x="10" y="${y1 + 14}">K-composition into ${esc(T.induction_head)}, minus the random baseline ${T.k_composition_baseline.toFixed(3)} (the previous-token head darker)</text>`
    + bars(10, y1 + 34, 800, 90, vals, names.map(h => h.split(".").slice(1).join(".")), C[0], "", names.indexOf(T.previous_token_head));
  const lay = n => n.split(".")[1], per = (all, l) => Object.keys(all).filter(h => lay(h) === l);
  const p0 = per(T.previous_token_all, lay(T.previous_token_head)), p1 = per(T.prefix_matching_all, lay(T.induction_head));
  s += bars(10, y1 + 184, 390, 70, p0.map(h => T.previous_token_all[h]), p0.map(h => h.split(".")[2]), C[1], `attention to t-1, layer ${lay(T.previous_token_head)}'s heads`, p0.indexOf(T.previous_token_head))
    + bars(420, y1 + 184, 390, 70, p1.map(h => T.prefix_matching_all[h]), p1.map(h => h.split(".")[2]), C[4], `prefix matching, layer ${lay(T.induction_head)}'s heads`, p1.indexOf(T.induction_head));
  $("s-text").setAttribute("height", y1 + 284);
  $("s-text").innerHTML = s;
  const best = T.strongest_partner;
  $("textnote").textContent = `${T.workdir} at step ${T.step}, on [BOS] r r (${n/2} random tokens repeated). The strongest K-composition partner is ${best} (${T.k_composition[best].toFixed(3)}, the row's median ${T.k_composition_median.toFixed(3)})` +
    (best === T.previous_token_head ? ": the previous-token head." : `; the previous-token head ${T.previous_token_head} has ${T.k_composition[T.previous_token_head].toFixed(3)}.`);
}
drawZoo(); drawText();
const draws = {q: drawQuery, mix: drawMix, qt: drawTrained, h: drawCut, reads: drawCut, dk: drawDiv, q4: drawTypes, wo: drawWO, hc: drawCost, q1: drawDk1, hm: drawMats, pr: drawPrune};
for (const [id, fn] of Object.entries(draws)) { $(id).addEventListener("input", fn); $(id).addEventListener("change", fn); }
Object.values(draws).forEach(fn => fn());
