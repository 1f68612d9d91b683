"""A self-contained attention explorer page (no network, no CDN).

Pick a sentence, an attention type, a layer and a head; the page shows each query
token's attention row over the keys, shaded by weight, like the figures in the seed
documents. Head buttons are coloured by role. The data sits in the page as JSON.
"""

from __future__ import annotations

import html
import json

import numpy as np

from mha_jax import storage
from mha_jax.analysis import capture as capture_lib
from mha_jax.analysis import roles as roles_lib
from mha_jax.data import vocab as V
from mha_jax.models import common as C
from mha_jax.models.common import STACKS


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
#model{display:grid;gap:2px;margin:8px 0}
canvas.thumb{border:2px solid #999;cursor:pointer;width:32px;height:32px;image-rendering:pixelated}
canvas.thumb.sel{outline:2px solid #000}
canvas.thumb.pruned{opacity:.35;border-style:dashed}
#headview text{font-size:11px;cursor:default}
#headview line{stroke:#1f77b4}
</style></head><body>
<h2>Attention explorer: TITLE</h2>
<div>sentence <select id="sent"></select> attention <select id="stack"></select>
layer <select id="layer"></select></div>
<div id="legend"></div>
<details open><summary>model view: every head (rows: layers, columns: heads; border: role,
dashed: pruned); click one to open it</summary><div id="model"></div></details>
<div id="heads"></div><div id="info"></div>
<details open><summary>head view: lines from each token (left) to the tokens it attends
(right); hover a line for its weight, a token for its lines</summary>
<svg id="headview" width="420" height="60"></svg></details>
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
const pruned = new Set(D.pruned || []);
function drawModel(){
  const box=$('model'), L=D.weights[st.sent][st.stack];
  const n=Math.max(1, ...L.map(l=>l.length));
  box.style.gridTemplateColumns='repeat('+n+', 36px)'; box.innerHTML='';
  L.forEach((heads,l)=>{ for(let h=0; h<n; h++){
    if(h>=heads.length){ box.appendChild(document.createElement('span')); continue; }
    const rows=heads[h], c=document.createElement('canvas'), name=st.stack+'.'+l+'.'+h;
    c.width=rows[0].length; c.height=rows.length; c.className='thumb'+
      (pruned.has(name)?' pruned':'')+(l===st.layer&&h===st.head?' sel':'');
    c.dataset.layer=l; c.dataset.head=h; c.title=name+' '+role(st.stack,l,h)+(pruned.has(name)?' (pruned)':'');
    c.style.borderColor=D.colors[role(st.stack,l,h)]||'#999';
    const ctx=c.getContext('2d'), img=ctx.createImageData(c.width,c.height);
    rows.forEach((row,i)=>row.forEach((v,j)=>{ const p=4*(i*c.width+j);
      img.data[p]=255-Math.round(224*v); img.data[p+1]=255-Math.round(136*v);
      img.data[p+2]=255-Math.round(75*v); img.data[p+3]=255; }));
    ctx.putImageData(img,0,0);
    c.onclick=()=>{ st.layer=l; st.head=h; $('layer').value=l; draw(); };
    box.appendChild(c); }});
}
function drawHeadView(q,k,rows){
  const svg=$('headview'), ns=svg.namespaceURI, dy=16, n=Math.max(q.length,k.length);
  svg.setAttribute('height', dy*n+10); svg.innerHTML='';
  const mk=(tag,attrs)=>{const e=document.createElementNS(ns,tag);
    Object.entries(attrs).forEach(([a,v])=>e.setAttribute(a,v)); return e;};
  rows.forEach((row,i)=>row.forEach((v,j)=>{ if(v<0.02) return;
    const ln=mk('line',{x1:150,y1:dy*i+12,x2:270,y2:dy*j+12,'stroke-width':1+3*v,
      'stroke-opacity':v,'data-q':i,'data-k':j,'data-w':v,'class':'hv'});
    const t=mk('title',{}); t.textContent=q[i]+' \u2192 '+k[j]+': '+v.toFixed(3);
    ln.appendChild(t); svg.appendChild(ln); }));
  const hl=(i,on)=>svg.querySelectorAll('line[data-q="'+i+'"]').forEach(l=>
    l.style.stroke=on?'#d62728':'');
  q.forEach((tok,i)=>{ const t=mk('text',{x:145,y:dy*i+16,'text-anchor':'end','class':'qt'});
    t.textContent=tok; t.onmouseenter=()=>hl(i,true); t.onmouseleave=()=>hl(i,false);
    svg.appendChild(t); });
  k.forEach((tok,j)=>{ const t=mk('text',{x:275,y:dy*j+16,'class':'kt'}); t.textContent=tok;
    svg.appendChild(t); });
}
function draw(){
  const s = D.sentences[st.sent], w = D.weights[st.sent][st.stack][st.layer];
  if(st.head >= w.length) st.head = 0;
  drawHeads(); drawModel();
  if(!w.length){ $('info').textContent='this layer has no heads (all pruned)'; $('att').innerHTML=''; return; }
  const q = st.stack==='encoder' ? (s.src||s.tokens) : (st.stack.startsWith('decoder') ? s.tgt : s.tokens);
  const k = (st.stack==='encoder'||st.stack==='decoder_cross') ? (s.src||s.tokens) :
            (st.stack==='decoder_self' ? s.tgt : s.tokens);
  drawHeadView(q, k, w[st.head]);
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
  """The explorer's JSON: sentences, `weights[sentence][stack][layer][head][query][key]`."""
  roles = {r["head"]: r.get("role", "other") for r in rows}
  is_tr = run.task.reports_bleu     # source and target words (TranslationData)
  sents, weights = [], []
  for batch, cap, weight in capture_lib.iter_captures(run, split, limit=sentences):
    n = int(weight.sum())
    for b in range(n):
      if is_tr:
        src = np.asarray(batch["src"][b])
        tgt = np.asarray(batch["tgt"][b])[:-1]
        s_len, t_len = int((src != V.PAD_ID).sum()), int((tgt != V.PAD_ID).sum())
        vocab = run.task.vocab
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
  return {"sentences": sents, "weights": weights, "roles": roles,
          "colors": roles_lib.ROLE_COLORS,
          "stacks": [s for s in STACKS if weights and s in weights[0]]}


def real_page_data(run, rows, split: str = "test", sentences: int = 2, max_tokens: int = 20,
                   half_len: int = 10) -> dict:
  """The explorer's JSON for an imported model (LLaMA LM or BERT encoder): `sentences`
  pieces of the built-in text cut to max_tokens tokens (and, for an LM, one sequence of
  repeated random tokens), tokens shown as the tokenizer's strings, weights to 2 places
  (SmolLM2's 270 heads stay well under 5 MB)."""
  from mha_jax.pruning import masks as M
  model = run.task
  roles = {r["head"]: r.get("role", "other") for r in rows}
  batches = []
  for batch, _weight in model.eval_batches(split, max(sentences, 1)):
    cut = {k: np.asarray(v)[:sentences, :max_tokens + 1] for k, v in batch.items()}
    batches.append(cut)
    break
  if model.decoder_only:
    tokens, _ = model.repeated_tokens(7_000_003, 1, half_len)
    batches.append({"tokens": tokens})
  sents, weights = [], []
  for batch in batches:
    cap = capture_lib.captured(model, run.params, batch)
    stack = "lm" if "lm" in cap else "encoder"
    toks = np.asarray(batch["tokens"])
    for b in range(len(toks)):
      ids = toks[b, :-1] if stack == "lm" else toks[b][np.asarray(batch["mask"])[b]]
      n = len(ids)
      sents.append({"tokens": [model.tokenizer.decode([int(i)]) or f"<{int(i)}>"
                               for i in ids]})
      weights.append({stack: [np.round(np.asarray(r.weights[b])[:, :n, :n], 2).tolist()
                              for r in cap[stack]]})
  mask = M.read_mask(run.workdir)
  pruned = ([n for n in C.head_names(run.params) if n not in set(M.kept_names(mask))]
            if mask else [])
  return {"sentences": sents, "weights": weights, "roles": roles,
          "colors": roles_lib.ROLE_COLORS,
          "stacks": [s for s in STACKS if weights and s in weights[0]], "pruned": pruned}


def write(run, rows, path: str, split: str = "test", sentences: int = 20) -> dict:
  if not run.task.trainable:       # an imported model: its tokenizer's strings
    data = real_page_data(run, rows, split, min(sentences, 2))
  else:
    data = page_data(run, rows, split, sentences)
  text = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
  page = _PAGE.replace("TITLE", html.escape(run.workdir)).replace("DATA", text)
  storage.write_text(path, page)
  return data
