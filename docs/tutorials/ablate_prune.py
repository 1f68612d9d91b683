# %% [markdown]
# # Ablate and prune
#
# Which heads matter? Train a small translation model, switch single heads off (zero
# and mean ablation), rank the heads by Michel et al.'s gradient importance, then prune
# the encoder down to a few heads with L0 gates (Voita et al. 2019) and with Michel's
# ranking, and compare. Small settings: under a minute on 2 CPU cores.

# %%
import os
import tempfile

import mha_jax
from mha_jax import config as mc
from mha_jax.toolkit import importance
from mha_jax.pruning import prune as prune_lib
from mha_jax.train import loop

root = tempfile.mkdtemp(prefix="ablate_prune_")
workdir = os.path.join(root, "run")
cfg = mc.load_config("configs/translation.py:quickstart,layers=2")
mc.apply_overrides(cfg, ["--config.train.steps=200", "--config.train.eval_every=200",
                         "--config.train.checkpoint_every=200", "--config.data.train_size=4000",
                         "--config.data.valid_size=64", "--config.data.test_size=64",
                         "--config.eval.bleu_examples=32"])
loop.train(cfg, workdir, log=lambda s: None)
loaded = mha_jax.load(workdir)
base = loaded.task.evaluate(loaded.params, "test")
print(f"all heads: test loss {base['loss']:.3f}, accuracy {base['accuracy']:.3f}")

# %% [markdown]
# ## Ablation
#
# A head's gate multiplies its output before W_O: gate 0 is a zero ablation. A mean
# ablation replaces the head's output by its mean over the valid split (a param edit:
# the mean goes through the head's rows of W_O into the block's output bias).

# %%
heads = importance.parse_heads(loaded.params, "encoder.0.0,encoder.1.3")
for mode in ("zero", "mean"):
  out = importance.ablate(loaded, heads, mode=mode, bleu_limit=32)
  print(f"{mode} ablation of encoder.0.0 and encoder.1.3: loss {out['loss'] - base['loss']:+.3f}")

# %% [markdown]
# ## Importance
#
# I_h = E_x |dL/d gate_h| at gates 1 (Michel et al. 2019), from per-example gradients.

# %%
imp = importance.michel_importance(loaded, "valid", limit=64)
top = sorted(imp["raw"].items(), key=lambda kv: -kv[1])[:5]
print("most important heads:", ", ".join(f"{h} {v:.4f}" for h, v in top))

# %% [markdown]
# ## Pruning to 4 of the 16 encoder heads
#
# L0: Hard Concrete gates trained on loss + λ·L0 with the model frozen, then the 4 heads
# with the largest log α. Michel: remove the least important heads, re-score, repeat.
# Each writes an ordinary workdir with the masked params.

# %%
for method in ("l0", "michel", "random"):
  opts = prune_lib.PruneOptions(method=method, keep=4, steps=40, bleu_limit=32)
  info = prune_lib.prune(loaded, os.path.join(root, method), opts, log=lambda s: None)
  print(f"{method:>6}: kept {', '.join(info['kept_heads'])}; test loss "
        f"{info['after']['loss']:.3f} (all heads {info['base']['loss']:.3f})")

# %% [markdown]
# ## In a notebook
#
# `mha_jax.show` draws {head: importance} as bars.

# %%
mha_jax.show(imp["raw"])
