"""One study per new mechanism, through the CLI, against transformers: `mha-jax patch
--sites head_out` on tiny imported models of an MoE (mixtral), an ALiBi (bloom), a NoPE
(smollm3) and an MLA (deepseek_v2) family; each head's recovery equals the same patch
done with torch forward hooks on the transformers model (the head's slice of the output
projection's input taken from the clean run, in the corrupt run, at every position)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hf_models import V

from mha_jax import cli

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.xdist_group("families")

# family case -> the attention output projection, under model.layers[i] / transformer.h[i]
O_PROJ = {"mixtral": "self_attn.o_proj", "bloom": "self_attention.dense",
          "deepseek_v2": "self_attn.o_proj",
          "smollm3": "self_attn.o_proj"}


def _pairs(n=4, t=14, seed=0):
  """Clean / corrupt prompts of t tokens differing in 3 places, answer and wrong ids."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    clean = rng.integers(3, V, t)
    corrupt = clean.copy()
    for j in rng.choice(t - 1, 3, replace=False):
      corrupt[j] = (corrupt[j] + 1 + rng.integers(V - 4)) % (V - 3) + 3
    a, w = rng.choice(np.arange(3, V), 2, replace=False)
    out.append((clean, corrupt, int(a), int(w)))
  return out


def _layers(model):
  base = getattr(model, "model", None) or model.transformer
  return base.layers if hasattr(base, "layers") else base.h


def _torch_head_recovery(model, pairs, o_proj):
  """{"lm.L.H": recovery} of patching head H's output (before W_O) from clean into
  corrupt, with forward pre-hooks on each layer's output projection."""
  cfg = model.config
  h = cfg.num_attention_heads if hasattr(cfg, "num_attention_heads") else cfg.n_head
  clean = torch.as_tensor(np.stack([p[0] for p in pairs]), dtype=torch.long)
  corrupt = torch.as_tensor(np.stack([p[1] for p in pairs]), dtype=torch.long)
  ans, wrong = [p[2] for p in pairs], [p[3] for p in pairs]
  layers = _layers(model)
  mods = [layers[i].get_submodule(o_proj) for i in range(len(layers))]
  saved = {}

  def ld(logits):
    last = logits[:, -1].double()
    return (last[range(len(ans)), ans] - last[range(len(ans)), wrong]).numpy()

  def keep(i):
    def hook(_m, args):
      saved[i] = args[0].detach().clone()
    return hook
  handles = [m.register_forward_pre_hook(keep(i)) for i, m in enumerate(mods)]
  with torch.no_grad():
    ld_clean = ld(model(clean).logits)
  for hd in handles:
    hd.remove()
  with torch.no_grad():
    ld_corrupt = ld(model(corrupt).logits)
  c, x = ld_clean.mean(), ld_corrupt.mean()
  out = {}
  k = saved[0].shape[-1] // h
  for i, m in enumerate(mods):
    for head in range(h):
      def patch(_m, args, i=i, head=head):
        y = args[0].clone()
        y[..., head * k:(head + 1) * k] = saved[i][..., head * k:(head + 1) * k]
        return (y,)
      hd = m.register_forward_pre_hook(patch)
      with torch.no_grad():
        got = ld(model(corrupt).logits).mean()
      hd.remove()
      out[f"lm.{i}.{head}"] = (got - x) / (c - x)
  return out


# mixtral in the default run; the other three (CLI runs of ~30 s each) are slow
@pytest.mark.parametrize("case", ["mixtral"] + [pytest.param(c, marks=pytest.mark.slow)
                                                for c in ("bloom", "deepseek_v2", "smollm3")])
def test_patch_head_out_through_the_cli_equals_torch_hooks(imported, case, tmp_path):
  model, _, folder = imported(case)          # conftest.py's: shared with test_families
  wd = os.path.join(os.path.dirname(folder), "w")
  pairs = _pairs()
  lines = [json.dumps({"clean": " ".join(f"t{i}" for i in c),
                       "corrupt": " ".join(f"t{i}" for i in x),
                       "answer": f"t{a}", "wrong": f"t{w}"}) for c, x, a, w in pairs]
  (tmp_path / "pairs.jsonl").write_text("\n".join(lines) + "\n")
  out = str(tmp_path / "patch")
  assert cli.main(["patch", "--workdir", wd, "--pairs", str(tmp_path / "pairs.jsonl"),
                   "--method", "activation", "--keep-failing", "--sites", "head_out",
                   "--out", out]) == 0
  doc = json.load(open(os.path.join(out, "patching.json")))
  ours = doc["scores"]["head_out"]
  want = _torch_head_recovery(model, pairs, O_PROJ[case])
  assert ours.keys() == want.keys()
  got = np.array([ours[k] for k in want])
  ref = np.array(list(want.values()))
  err = float(np.max(np.abs(got - ref)))
  print(f"\n{case}: patch --sites head_out vs torch hooks, {len(ref)} heads, max |diff| "
        f"of the recovery {err:.1e} (recoveries {ref.min():.3f} .. {ref.max():.3f})")
  assert err < 1e-4
  assert np.ptp(ref) > 1e-3      # the heads' effects differ: the comparison can fail
