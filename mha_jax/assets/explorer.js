const D = JSON.parse(document.getElementById('data').textContent);
const st = {sent: 0, stack: (D.stacks || [])[0], layer: 0, head: 0};
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
    const t=mk('title',{}); t.textContent=q[i]+' → '+k[j]+': '+v.toFixed(3);
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
function attentionView(){
  opts($('sent'), D.sentences.map((_,i)=>i), D.sentences.map(s=>(s.label ? s.label+': ' : '')+
    (s.src||s.tokens).join(' ').slice(0,60)));
  opts($('stack'), D.stacks);
  layers();
  $('sent').onchange=e=>{st.sent=+e.target.value; draw();};
  $('stack').onchange=e=>{st.stack=e.target.value; st.layer=0; layers(); draw();};
  $('layer').onchange=e=>{st.layer=+e.target.value; draw();};
  $('legend').innerHTML = Object.entries(D.colors).filter(([r])=>Object.values(D.roles).includes(r))
    .map(([r,c])=>'<span style="background:'+c+'">'+r+'</span>').join('');
  draw();
}
function layers(){ opts($('layer'), D.weights[st.sent][st.stack].map((_,i)=>i)); }

// ---------------------------------------------------------------- the patching view
const P = D.patching;
const pst = {table: null, pos: 0};
function el(tag, attrs, text){ const e=document.createElement(tag);
  Object.entries(attrs||{}).forEach(([a,v])=>e.setAttribute(a,v));
  if(text!==undefined) e.textContent=text; return e; }
function fmt(v){ return v===null ? 'n/a' : (v>=0?'+':'')+v.toFixed(3); }
function color(x){   // x in [-1, 1]: blue - white - red, as the PNGs' RdBu_r
  const a=Math.min(1, Math.abs(x)), c = x>=0 ? [178,24,43] : [33,102,172];
  return 'rgb('+c.map(v=>Math.round(255+(v-255)*a)).join(',')+')'; }
function parseName(n){ const p=n.split('.'), k=p.length;
  return k>=3 ? {stack: p.slice(0,k-2).join('.'), layer: +p[k-2], col: +p[k-1]}
              : {stack: p.slice(0,k-1).join('.'), layer: +p[k-1], col: null}; }
function patchTables(){
  const T=[], pj=P.patching||{};
  const add=(id, short, label, data, o)=>{ if(data && Object.keys(data).length)
    T.push(Object.assign({id, short, label, data, kind:'head', kv:false, perPos:false}, o||{})); };
  Object.entries(pj.scores||{}).forEach(([k,v])=>add('patch.'+k, k,
    'activation patching of '+k+(k.endsWith('_kv')?' (per key/value head)':'')+': recovery', v,
    {kv: k.endsWith('_kv')}));
  add('patch.head_out_per_position', 'head_out@pos', 'activation patching of head_out at one '+
    'position: recovery', pj.head_out_per_position, {perPos: true});
  add('patch.resid', 'resid_pre', 'activation patching of resid_pre per layer and position: '+
    'recovery', pj.resid, {kind: 'layerpos'});
  if(P.dla){
    add('dla.heads', 'DLA', 'direct logit attribution of each head (clean runs)', P.dla.heads);
    add('dla.mlp', 'DLA mlp', 'direct logit attribution of each MLP (clean runs)', P.dla.mlp,
        {kind: 'layer'});
  }
  Object.entries((P.attribution||{}).scores||{}).forEach(([k,v])=>add('atp.'+k, 'AtP',
    'attribution patching (AtP) estimate of the '+k+' recovery', v));
  if(P.path) add('path.to_logits', 'path → logits', 'path patching, sender → logits: recovery',
                 P.path.to_logits);
  return T;
}
const PT = P ? patchTables() : [];
function matrix(t, pos){
  const names=Object.keys(t.data), parsed=names.map(parseName);
  const L=Math.max(...parsed.map(p=>p.layer))+1;
  const ncol = t.kind==='head' ? Math.max(...parsed.map(p=>p.col))+1 :
               t.kind==='layerpos' ? Math.max(...names.map(n=>t.data[n].length)) : 1;
  const M=[...Array(L)].map(()=>Array(ncol).fill(null));
  names.forEach((n,i)=>{ const p=parsed[i], v=t.data[n];
    if(t.kind==='head') M[p.layer][p.col]={name: n, v: t.perPos ? v[pos] : v, layer: p.layer, col: p.col};
    else if(t.kind==='layerpos') v.forEach((x,j)=>{ M[p.layer][j]={name: n+' position '+j, v: x, layer: p.layer, col: j}; });
    else M[p.layer][0]={name: n, v: v, layer: p.layer, col: 0}; });
  return {M, L, ncol, stack: parsed[0].stack};
}
function tokenAt(j){ return D.sentences && D.sentences[0] ? D.sentences[0].tokens[j] : undefined; }
function kvNote(t, g){   // which query heads read each key/value head (GQA order)
  const q=PT.find(x=>x.id==='patch.head_out');
  if(!t.kv || !q) return '';
  const h=matrix(q, 0).ncol, r=h/g;
  return ' Key/value head j is read by query heads '+r+'j .. '+r+'j+'+(r-1)+' ('+h+' query heads over '+g+').';
}
function drawGrid(){
  const t=PT.find(x=>x.id===$('ptable').value); pst.table=t;
  $('pposbox').style.display = t.perPos ? '' : 'none';
  const {M, ncol, stack}=matrix(t, pst.pos);
  const cells=M.flat().filter(c=>c && c.v!==null);
  const lim=Math.max(1e-12, ...cells.map(c=>Math.abs(c.v)));
  const axis = t.kind==='head' ? (t.kv ? 'key/value head' : 'head') : t.kind==='layerpos' ? 'position' : '';
  const clickable = D.weights && t.kind==='head' && !t.kv && stack==='lm';
  $('pnote').textContent = t.label+'. Rows: layers; columns: '+(axis||'the layer\'s MLP')+
    '. Colour: blue negative, red positive, scaled to the largest |value| ('+lim.toFixed(3)+').'+
    (clickable ? ' Click a head for its attention pattern on the pairs.' : '')+kvNote(t, ncol);
  $('pscale').innerHTML=''; $('pscale').appendChild(el('span', {style:'width:auto'}, fmt(-lim)+' '));
  for(let i=-5;i<=5;i++){ const s=el('span'); s.style.background=color(i/5); $('pscale').appendChild(s); }
  $('pscale').appendChild(el('span', {style:'width:auto'}, ' '+fmt(lim)));
  const g=$('pgrid'); g.innerHTML='';
  const hr=el('tr'); hr.appendChild(el('th', {}, axis ? 'layer \\ '+axis : 'layer'));
  for(let j=0;j<ncol;j++){ const th=el('th', {}, t.kind==='layer' ? 'MLP' : String(j));
    if(t.kind==='layerpos' && tokenAt(j)!==undefined) th.title=JSON.stringify(tokenAt(j));
    hr.appendChild(th); }
  g.appendChild(hr);
  M.forEach((row,l)=>{ const tr=el('tr'); tr.appendChild(el('th', {}, stack+'.'+l));
    row.forEach(c=>{ if(!c || c.v===null){ tr.appendChild(el('td', {'class':'none'})); return; }
      const td=el('td', {'class':'cell', 'data-name': c.name, 'data-value': String(c.v),
                         title: c.name+': '+fmt(c.v)});
      td.style.background=color(c.v/lim);
      td.onmouseenter=()=>{ $('phover').textContent = c.name+' '+t.short+' = '+fmt(c.v)+
        (t.perPos ? ' at position '+pst.pos : ''); };
      if(clickable) td.onclick=()=>{ st.layer=c.layer; st.head=c.col; layers();
        $('layer').value=c.layer; show('attention'); draw(); $('info').scrollIntoView(); };
      tr.appendChild(td); });
    g.appendChild(tr); });
  drawTop(t, M);
}
function drawTop(t, M){
  const top=M.flat().filter(c=>c && c.v!==null).sort((a,b)=>Math.abs(b.v)-Math.abs(a.v)).slice(0,10);
  const others = (t.kind==='head' && !t.kv) ? PT.filter(x=>x!==t && x.kind==='head' && !x.kv && !x.perPos) : [];
  $('ptopof').textContent = '('+t.label+(t.perPos ? ' at position '+pst.pos : '')+
    (others.length ? '; the same heads in the other tables' : '')+')';
  const tb=$('ptop'); tb.innerHTML='';
  const hr=el('tr'); ['#', 'name', t.short].concat(others.map(x=>x.short)).forEach(h=>hr.appendChild(el('th', {}, h)));
  tb.appendChild(hr);
  top.forEach((c,i)=>{ const tr=el('tr', {'class':'top', 'data-name': c.name});
    tr.appendChild(el('td', {}, String(i+1))); tr.appendChild(el('td', {}, c.name));
    tr.appendChild(el('td', {'class':'num', 'data-value': String(c.v)}, fmt(c.v)));
    others.forEach(x=>{ const v=x.data[c.name];
      tr.appendChild(el('td', {'class':'num'}, v===undefined||v===null ? '' : fmt(v))); });
    tb.appendChild(tr); });
}
function drawAtp(){
  const a=P.attribution, ex=((P.patching||{}).scores||{}).head_out;
  if(!a){ $('patpbox').style.display='none'; return; }
  const box=$('patp'); box.innerHTML='';
  Object.entries(a.agreement||{}).forEach(([k,g])=>box.appendChild(el('div', {'class':'agree'},
    k+': Pearson '+g.pearson.toFixed(3)+', Spearman '+g.spearman.toFixed(3)+', top-10 overlap '+
    g.top10_overlap.toFixed(1)+' (over '+g.n+' heads)')));
  if(a.seconds) box.appendChild(el('div', {}, 'seconds: '+Object.entries(a.seconds).map(([k,v])=>k+' '+v).join(', ')));
  const est=(a.scores||{}).head_out, svg=$('pscatter');
  if(!ex || !est){ svg.style.display='none'; return; }
  const ns=svg.namespaceURI, W=300, m=36;
  const mk=(tag, attrs, text)=>{ const e=document.createElementNS(ns, tag);
    Object.entries(attrs).forEach(([k,v])=>e.setAttribute(k,v)); if(text!==undefined) e.textContent=text; return e; };
  const names=Object.keys(est).filter(n=>ex[n]!==undefined && ex[n]!==null && est[n]!==null);
  const all=names.flatMap(n=>[ex[n], est[n]]);
  const lo=Math.min(0, ...all), hi=Math.max(1e-12, ...all), sc=v=>m+(v-lo)/(hi-lo)*(W-2*m);
  svg.innerHTML='';
  svg.appendChild(mk('line', {x1:sc(lo), y1:W-sc(lo), x2:sc(hi), y2:W-sc(hi), stroke:'#aaa', 'stroke-dasharray':'4 3'}));
  svg.appendChild(mk('line', {x1:m, y1:W-m, x2:W-m, y2:W-m, stroke:'#555'}));
  svg.appendChild(mk('line', {x1:m, y1:W-m, x2:m, y2:m, stroke:'#555'}));
  svg.appendChild(mk('text', {x:W/2, y:W-8, 'text-anchor':'middle'}, 'exact recovery (head_out)'));
  svg.appendChild(mk('text', {x:10, y:W/2, transform:'rotate(-90 10 '+W/2+')', 'text-anchor':'middle'}, 'AtP estimate'));
  svg.appendChild(mk('text', {x:m, y:W-m+12}, lo.toFixed(2)));
  svg.appendChild(mk('text', {x:W-m, y:W-m+12, 'text-anchor':'end'}, hi.toFixed(2)));
  names.forEach(n=>{ const c=mk('circle', {cx:sc(ex[n]), cy:W-sc(est[n]), r:3, 'data-name':n});
    c.appendChild(mk('title', {}, n+': exact '+fmt(ex[n])+', AtP '+fmt(est[n]))); svg.appendChild(c); });
}
function drawEdges(){
  const p=P.path;
  if(!p || !p.edges){ $('pedgebox').style.display='none'; return; }
  $('precv').textContent='receivers: '+((p.receivers||[]).join(', ')||'none')+
    ' (through their q, k, v input); "logits": the sender straight to the logits. '+(p.method||'');
  const tb=$('pedges'); tb.innerHTML='';
  const hr=el('tr'); ['sender', 'receiver', 'channel', 'recovery'].forEach(h=>hr.appendChild(el('th', {}, h)));
  tb.appendChild(hr);
  p.edges.forEach(e=>{ const tr=el('tr', {'class':'edge'});
    [e.sender, e.receiver, e.channel].forEach(x=>tr.appendChild(el('td', {}, x)));
    tr.appendChild(el('td', {'class':'num'}, fmt(e.recovery))); tb.appendChild(tr); });
}
function bar(v, lim){ const b=el('span', {'class':'bar'});
  b.style.width=Math.round(80*Math.abs(v)/lim)+'px'; b.style.background=color(v>=0?0.8:-0.8); return b; }
function drawLens(){
  const z=(P.patching||{}).logit_lens;
  if(!z){ $('plensbox').style.display='none'; return; }
  const tb=$('plens'); tb.innerHTML='';
  const hr=el('tr'); ['read after', 'logit difference', '', 'p(answer)'].forEach(h=>hr.appendChild(el('th', {}, h)));
  tb.appendChild(hr);
  const lim=Math.max(1e-12, ...z.logit_diff.map(Math.abs));
  z.layers.forEach((name,i)=>{ const tr=el('tr', {'class':'lens'});
    tr.appendChild(el('td', {}, name)); tr.appendChild(el('td', {'class':'num'}, fmt(z.logit_diff[i])));
    const td=el('td'); td.appendChild(bar(z.logit_diff[i], lim)); tr.appendChild(td);
    tr.appendChild(el('td', {'class':'num'}, z.prob[i].toFixed(3))); tb.appendChild(tr); });
}
function marked(text, other){   // text with the words that differ from `other` marked
  const a=text.split(/(\s+)/), b=other.split(/(\s+)/), td=el('td');
  a.forEach((w,i)=>{ if(a.length===b.length && w!==b[i]) td.appendChild(el('mark', {}, w));
                     else td.appendChild(document.createTextNode(w)); });
  return td;
}
function drawPairs(){
  const ps=(P.patching||{}).pairs;
  if(!ps){ $('ppairbox').style.display='none'; return; }
  const tb=$('ppairs'); tb.innerHTML='';
  const hr=el('tr'); ['#', 'clean', 'corrupt', 'answer', 'wrong', 'LD clean', 'LD corrupt']
    .forEach(h=>hr.appendChild(el('th', {}, h)));
  tb.appendChild(hr);
  ps.forEach((p,i)=>{ const tr=el('tr', {'class':'pair'}); tr.appendChild(el('td', {}, String(i)));
    const c=String(p.clean===undefined ? '' : p.clean), x=String(p.corrupt===undefined ? '' : p.corrupt);
    tr.appendChild(marked(c, x)); tr.appendChild(marked(x, c));
    [p.answer, p.wrong].forEach(w=>tr.appendChild(el('td', {}, JSON.stringify(w===undefined ? p.answer_id : w))));
    [p.ld_clean, p.ld_corrupt].forEach(v=>tr.appendChild(el('td', {'class':'num'}, fmt(v))));
    tb.appendChild(tr); });
}
function drawSummary(){
  const pj=P.patching || P.dla, box=$('psummary'); box.innerHTML='';
  const line=t=>box.appendChild(el('div', {}, t));
  line('task: '+pj.task+' · workdir: '+pj.workdir+(pj.pairs ? ' · '+pj.pairs.length+' pairs' : ''));
  if(P.patching){
    line('direction: '+P.patching.direction+' · '+P.patching.metric);
    line('mean logit difference: clean '+fmt(P.patching.ld_clean)+', corrupt '+fmt(P.patching.ld_corrupt));
  }
  if(P.dla) line('direct logit attribution: '+P.dla.direction+'; heads + MLPs + embeddings = '+
    fmt(P.dla.sum_of_parts)+' against LD '+fmt(P.dla.ld)+(P.dla.sums_to_ld===false ? ' (not exact on this model)' : ''));
}
function patchingView(){
  opts($('ptable'), PT.map(t=>t.id), PT.map(t=>t.label));
  const perPos=PT.find(t=>t.perPos);
  if(perPos){ const n=Math.max(...Object.values(perPos.data).map(a=>a.length));
    opts($('ppos'), [...Array(n).keys()], [...Array(n).keys()].map(j=>tokenAt(j)===undefined ? String(j) : j+' '+JSON.stringify(tokenAt(j)))); }
  $('ptable').onchange=drawGrid;
  $('ppos').onchange=e=>{ pst.pos=+e.target.value; drawGrid(); };
  drawSummary(); drawGrid(); drawAtp(); drawEdges(); drawLens(); drawPairs();
}

// ---------------------------------------------------------------- the circuit view
const C = D.circuit;
function circuitPlaces(g, width){   // node name -> [x, y]: layer rows upwards, heads across the width
  const cols=Math.max(...g.heads)+2, dx=Math.max(30, (width-110)/cols), dy=30;
  const W=dx*cols+90, H=dy*(g.layers+2)+20, at={};
  at.embed=[W/2, H-20]; at.logits=[W/2, 20];
  for(let l=0;l<g.layers;l++){ const y=H-20-dy*(l+1);
    for(let h=0;h<g.heads[l];h++) at['lm.'+l+'.'+h]=[50+dx*h, y];
    if(g.mlp[l]) at['lm.'+l+'.mlp']=[50+dx*(Math.max(...g.heads)+0.6), y]; }
  return {at, W, H};
}
function circuitNodes(edges){   // the nodes a circuit touches: senders, and the node of a one-node end
  const on=new Set();
  edges.forEach(e=>{ on.add(e.from); if(e.into.length===1) on.add(e.into[0]); });
  on.delete('embed'); on.delete('logits'); return on;
}
function roleColor(n){ const r=(C.roles||{})[n]; return r===undefined ? null : ((C.colors||{})[r]||'#999'); }
function circuitSummary(){
  const g=C.graph, sm=C.summary, box=$('csummary'); box.innerHTML='';
  const line=t=>box.appendChild(el('div', {}, t));
  line('task: '+sm.task+' · workdir: '+sm.workdir+' · '+sm.pairs+' pairs · ablation: '+sm.ablation);
  line('method: '+sm.method+(sm.method==='auto' ? ' (kept: '+sm.chosen+')' : '')+' · graph: '+
       g.edges_total+' edges · CPR '+sm.cpr.toFixed(3)+', CMD '+sm.cmd.toFixed(3));
  line('circuit at target '+sm.target+': '+C.edges.length+' edges, '+C.heads.length+' heads, '+
       C.mlps.length+' MLPs · faithfulness '+sm.faithfulness.toFixed(3)+
       ' · faithfulness_nodes '+(sm.faithfulness_nodes===null ? 'n/a' : sm.faithfulness_nodes.toFixed(3)));
  const lg=$('clegend'); lg.innerHTML='';
  [...new Set(Object.values(C.roles||{}))].sort().forEach(r=>{
    const s=el('span', {'class':'crole', 'data-role':r}, r); s.style.borderLeft='12px solid '+(C.colors[r]||'#999');
    lg.appendChild(s); });
}
function circuitDraw(edges){
  const g=C.graph, svg=$('cgraph'), ns=svg.namespaceURI;
  const {at, W, H}=circuitPlaces(g, Math.max(400, svg.parentNode.clientWidth||720));
  svg.setAttribute('width', W); svg.setAttribute('height', H); svg.innerHTML='';
  const mk=(tag, attrs, text)=>{ const e=document.createElementNS(ns, tag);
    Object.entries(attrs).forEach(([k,v])=>e.setAttribute(k,v));
    if(text!==undefined) e.textContent=text; return e; };
  const lim=Math.max(1e-12, ...edges.map(e=>Math.abs(e.score)));
  edges.forEach(e=>e.into.forEach(n=>{ const a=at[e.from], b=at[n];
    const ln=mk('line', {x1:a[0], y1:a[1], x2:b[0], y2:b[1], 'class':'cedge',
      stroke: e.score<0 ? '#d62728' : '#1f77b4', 'stroke-width': 0.4+3*Math.abs(e.score)/lim,
      'data-from': e.from, 'data-to': e.to, 'data-score': e.score});
    ln.onmouseenter=()=>{ $('chover').textContent=e.from+' -> '+e.to+': '+fmt(e.score); };
    svg.appendChild(ln); }));
  const on=circuitNodes(edges), labels=mk('g', {'class':'clabels'});
  Object.entries(at).forEach(([n,[x,y]])=>{
    if(n==='embed' || n==='logits'){ svg.appendChild(mk('rect', {x:x-20, y:y-7, width:40, height:14, fill:'#000'}));
      svg.appendChild(mk('text', {x:x+24, y:y+3}, n)); return; }
    const p=n.split('.'), role=(C.roles||{})[n], col=roleColor(n);
    const tip=n+(role!==undefined ? ' ('+role+')' : '')+(on.has(n) ? ' in the circuit' : '');
    if(p[2]==='mlp'){ const r=mk('rect', {x:x-8, y:y-5, width:16, height:10, 'class':'cmlp'+(on.has(n)?' on':''), 'data-name':n});
      r.appendChild(mk('title', {}, n)); svg.appendChild(r); return; }
    const c=mk('circle', {cx:x, cy:y, r:on.has(n)?6:3, 'class':'cnode'+(on.has(n)?' on':''), 'data-name':n});
    if(col!==null){ c.style.fill=col; c.setAttribute('data-role', role);
      if(on.has(n)){ c.style.stroke='#000'; c.style.strokeWidth='1.5'; } else c.style.fillOpacity='.45'; }
    c.appendChild(mk('title', {}, tip));
    c.onmouseenter=()=>{ $('chover').textContent=tip; };
    if(D.weights) c.onclick=()=>{ st.layer=+p[1]; st.head=+p[2]; layers(); $('layer').value=st.layer;
      show('attention'); draw(); $('info').scrollIntoView(); };
    svg.appendChild(c);
    // a label under its own node, no wider than a column: labels never overlap
    if(on.has(n)) labels.appendChild(mk('text', {x:x, y:y+14, 'text-anchor':'middle', 'class':'clabel'}, p[1]+'.'+p[2])); });
  svg.appendChild(labels);
}
function circuitView(){
  circuitSummary();
  const S=C.sizes||[], box=$('csizebox');
  if(S.length<2){ box.style.display='none'; circuitDraw(C.edges); return; }
  const at=(C.at===null || C.at===undefined) ? S.length-1 : C.at, slider=$('csize');
  slider.min=0; slider.max=S.length-1; slider.step=1; slider.value=at;
  const pick=j=>{ const sz=S[j], edges=sz.rows.map(r=>C.ranked[r]), on=circuitNodes(edges);
    const heads=[...on].filter(n=>!n.endsWith('.mlp')).length;
    $('csizeinfo').textContent=sz.kept+' edges ('+(100*sz.fraction).toPrecision(2)+' % of the graph), '+heads+
      ' heads, faithfulness '+sz.faithfulness.toFixed(3)+(j===C.at ? ' · the target circuit' : '');
    slider.dataset.kept=sz.kept; slider.dataset.faithfulness=sz.faithfulness;
    circuitDraw(edges); };
  slider.oninput=()=>pick(+slider.value);
  pick(at);
}

// ---------------------------------------------------------------- the views
function show(v){
  $('attn-view').style.display = v==='attention' ? '' : 'none';
  $('patch-view').style.display = v==='patching' ? '' : 'none';
  $('circuit-view').style.display = v==='circuit' ? '' : 'none';
  [...$('views').children].forEach(b=>b.classList.toggle('on', b.dataset.view===v));
}
const LABELS={circuit: 'circuit', patching: 'patching results', attention: 'attention patterns'};
const views=(C ? ['circuit'] : []).concat(P ? ['patching'] : []).concat(D.weights ? ['attention'] : []);
if(views.length>1) views.forEach(v=>{ const b=el('button', {'data-view': v}, LABELS[v]);
  b.onclick=()=>show(v); $('views').appendChild(b); });
if(D.weights) attentionView();
if(P) patchingView();
if(C) circuitView();
show(views[0]);
