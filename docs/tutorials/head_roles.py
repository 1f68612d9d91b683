# %% [markdown]
# # From a checkpoint to its head roles
#
# Train a small encoder-decoder on the built-in synthetic language pair, load it back
# from its workdir as every study does, look at one head's attention, and let the role
# detectors say what each encoder head does (positional, syntactic, rare-word, other;
# Voita et al. 2019). Small settings: it runs in under a minute on 2 CPU cores. For the
# full-size run use `mha-jax quickstart`.

# %%
import tempfile

import numpy as np

import mha_jax
from mha_jax import config as mc
from mha_jax.toolkit import capture
from mha_jax.roles import head_roles
from mha_jax.train import loop

workdir = tempfile.mkdtemp(prefix="head_roles_")
cfg = mc.load_config("configs/translation.py:quickstart,layers=2")
mc.apply_overrides(cfg, ["--config.train.steps=200", "--config.train.eval_every=200",
                         "--config.train.checkpoint_every=200", "--config.data.train_size=4000",
                         "--config.data.valid_size=64", "--config.data.test_size=64",
                         "--config.eval.bleu_examples=32"])
summary = loop.train(cfg, workdir, log=lambda s: None)
print(summary["status"], "at step", summary["step"])

# %% [markdown]
# ## Load the run
#
# `mha_jax.load` reads the newest good checkpoint and the run's task: its data, model,
# loss and evaluation. Heads are named `stack.layer.head`.

# %%
loaded = mha_jax.load(workdir)
print(loaded.step, len(loaded.head_names), loaded.head_names[:4])
print({k: round(v, 3) for k, v in loaded.task.evaluate(loaded.params, "test").items()
       if k in ("loss", "accuracy")})

# %% [markdown]
# ## One head's attention
#
# `capture.iter_captures` runs the model's own forward pass with a hook that reads the
# pattern sites, and yields every layer's weights (B, H, T, S), batch by batch.

# %%
batch, cap, weight = next(capture.iter_captures(loaded, "test", stacks=("encoder",), limit=8))
w_BHTS = np.asarray(cap["encoder"][0].weights)
print("encoder layer 0 weights", w_BHTS.shape)
print("head encoder.0.0, first sentence, argmax key per query:", w_BHTS[0, 0].argmax(-1)[:10])

# %% [markdown]
# ## Roles
#
# `head_roles.head_roles` scores every head on the test split against the gold dependency
# arcs that come with each synthetic sentence and assigns a role by fixed thresholds.

# %%
rows = head_roles.head_roles(loaded, "test")
enc = [r for r in rows if r["stack"] == "encoder"]
counts = {}
for r in enc:
  counts[r["role"]] = counts.get(r["role"], 0) + 1
print("encoder roles:", counts)
best = max(enc, key=lambda r: r["positional_share"])
print(f"most positional head {best['head']}: offset {best['positional_offset']:+d} "
      f"for {best['positional_share']:.0%} of tokens")

# %% [markdown]
# ## In a notebook
#
# `mha_jax.show` draws {head: role} as a table coloured by role.

# %%
mha_jax.show({r["head"]: r["role"] for r in rows})
