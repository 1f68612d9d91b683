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
