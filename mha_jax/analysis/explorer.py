"""A self-contained attention explorer page (no network, no CDN).

Pick a sentence, an attention type, a layer and a head; the page shows each query
token's attention row over the keys, shaded by weight, like the figures in the seed
documents. Head buttons are coloured by role. The data sits in the page as JSON.
"""

from __future__ import annotations

import html
import json

import numpy as np

from mha_jax.analysis import capture as capture_lib
from mha_jax.data import vocab as V
from mha_jax.models.common import STACKS

_COLORS = {"positional": "#1f77b4", "syntactic": "#2ca02c", "rare": "#d62728",
           "previous_token": "#1f77b4", "induction": "#9467bd", "duplicate_token": "#ff7f0e",
           "other": "#999999", "n/a": "#999999"}

_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>mha-jax attention explorer</title>
<style>
body{font-family:sans-serif;margin:16px;color:#222}
select,button{margin:2px;font-size:13px}
.head{border:2px solid transparent;color:#fff;min-width:34px}
.head.sel{border-color:#000}
table.att{border-collapse:collapse;margin-top:12px}
table.att td,table.att th{padding:2px 5px;font-size:12px;text-align:center}
table.att th.q{text-align:right}
#legend span{display:inline-block;padding:2px 6px;margin-right:4px;color:#fff;font-size:12px}
</style></head><body>
<h2>Attention explorer: TITLE</h2>
<div>sentence <select id="sent"></select> attention <select id="stack"></select>
layer <select id="layer"></select></div>
<div id="heads"></div><div id="legend"></div><div id="info"></div>
<table class="att" id="att"></table>
<script id="data" type="application/json">DATA</script>
<script>
const D = JSON.parse(document.getElementById('data').textContent);
const st = {sent: 0, stack: D.stacks[0], layer: 0, head: 0};
const $ = id => document.getElementById(id);
function opts(sel, items, labels){ sel.innerHTML=''; items.forEach((v,i)=>{
  const o=document.createElement('option'); o.value=v; o.textContent=labels?labels[i]:v; sel.appendChild(o);}); }
function role(stack, layer, head){ const r = D.roles[stack+'.'+layer+'.'+head]; return r || 'other'; }
function drawHeads(){
  const box=$('heads'); box.innerHTML='heads ';
  const n = D.weights[st.sent][st.stack][st.layer].length;
  for(let h=0; h<n; h++){ const b=document.createElement('button');
    const r=role(st.stack, st.layer, h);
    b.className='head'+(h===st.head?' sel':''); b.textContent=h; b.dataset.head=h;
    b.dataset.role=r; b.style.background=D.colors[r]||'#999'; b.title=r;
    b.onclick=()=>{st.head=h; draw();}; box.appendChild(b); }
}
function draw(){
  const s = D.sentences[st.sent], w = D.weights[st.sent][st.stack][st.layer];
  if(st.head >= w.length) st.head = 0;
  drawHeads();
  if(!w.length){ $('info').textContent='this layer has no heads (all pruned)'; $('att').innerHTML=''; return; }
  const q = st.stack==='encoder' ? s.src : (st.stack.startsWith('decoder') ? s.tgt : s.tokens);
  const k = (st.stack==='encoder'||st.stack==='decoder_cross') ? s.src :
            (st.stack==='decoder_self' ? s.tgt : s.tokens);
  const rows = w[st.head];
  $('info').textContent = st.stack+'.'+st.layer+'.'+st.head+' role: '+role(st.stack,st.layer,st.head);
  const t=$('att'); t.innerHTML='';
  const hr=document.createElement('tr'); hr.appendChild(document.createElement('th'));
  k.forEach(tok=>{const th=document.createElement('th'); th.textContent=tok; hr.appendChild(th);});
  t.appendChild(hr);
  rows.forEach((row,i)=>{ const tr=document.createElement('tr'); tr.className='row';
    const th=document.createElement('th'); th.className='q'; th.textContent=q[i]; tr.appendChild(th);
    row.forEach(v=>{ const td=document.createElement('td'); td.className='w'; td.dataset.w=v;
      td.textContent=v.toFixed(2); td.style.background='rgba(31,119,180,'+v+')';
      td.style.color = v>0.5?'#fff':'#222'; tr.appendChild(td);});
    t.appendChild(tr);});
}
opts($('sent'), D.sentences.map((_,i)=>i), D.sentences.map(s=>(s.src||s.tokens).join(' ').slice(0,60)));
opts($('stack'), D.stacks);
function layers(){ opts($('layer'), D.weights[st.sent][st.stack].map((_,i)=>i)); }
layers();
$('sent').onchange=e=>{st.sent=+e.target.value; draw();};
$('stack').onchange=e=>{st.stack=e.target.value; st.layer=0; layers(); draw();};
$('layer').onchange=e=>{st.layer=+e.target.value; draw();};
$('legend').innerHTML = Object.entries(D.colors).filter(([r])=>Object.values(D.roles).includes(r))
  .map(([r,c])=>'<span style="background:'+c+'">'+r+'</span>').join('');
draw();
</script></body></html>
"""


def page_data(run, rows, split: str = "test", sentences: int = 20) -> dict:
  """The explorer's JSON: sentences, weights[sentence][stack][layer][head][query][key]."""
  roles = {r["head"]: r.get("role", "other") for r in rows}
  is_tr = run.config.task == "translation"
  sents, weights = [], []
  for batch, cap, weight in capture_lib.iter_captures(run, split, limit=sentences):
    n = int(weight.sum())
    for b in range(n):
      if is_tr:
        src = np.asarray(batch["src"][b])
        tgt = np.asarray(batch["tgt"][b])[:-1]
        s_len, t_len = int((src != V.PAD_ID).sum()), int((tgt != V.PAD_ID).sum())
        vocab = run.model.vocab
        sents.append({"src": [vocab.tokens[i] for i in src[:s_len]],
                      "tgt": [vocab.tokens[i] for i in tgt[:t_len]]})
        lens = {"encoder": (s_len, s_len), "decoder_self": (t_len, t_len),
                "decoder_cross": (t_len, s_len)}
      else:
        toks = np.asarray(batch["tokens"][b])[:-1]
        sents.append({"tokens": [str(int(i)) for i in toks]})
        lens = {"lm": (len(toks), len(toks))}
      weights.append({stack: [np.round(np.asarray(r.weights[b])[:, :lens[stack][0],
                                                                 :lens[stack][1]], 3).tolist()
                              for _, r in sorted(layers.items())]
                      for stack, layers in cap.items()})
  return {"sentences": sents, "weights": weights, "roles": roles, "colors": _COLORS,
          "stacks": [s for s in STACKS if weights and s in weights[0]]}


def write(run, rows, path: str, split: str = "test", sentences: int = 20) -> dict:
  data = page_data(run, rows, split, sentences)
  text = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
  page = _PAGE.replace("TITLE", html.escape(run.workdir)).replace("DATA", text)
  with open(path, "w", encoding="utf-8") as f:
    f.write(page)
  return data
