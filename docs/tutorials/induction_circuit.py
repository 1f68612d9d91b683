# %% [markdown]
# # Find the induction circuit
#
# A two-layer attention-only transformer trained on repeated random tokens
# (`[BOS] r_1..r_n r_1..r_n`) can only predict the second copy by looking back:
# an induction head in layer 1 attends to the token after the earlier occurrence of
# the current token and copies it, and it finds that token by K-composition with a
# previous-token head in layer 0 (Elhage et al. 2021; Olsson et al. 2022). Train a small
# one, then let `mha_jax.circuits` find both heads. Small settings: under a minute on 2
# CPU cores (the full config trains 4,000 steps).

# %%
import tempfile

import mha_jax
from mha_jax import config as mc
from mha_jax.circuits import induction_circuits
from mha_jax.train import loop

workdir = tempfile.mkdtemp(prefix="induction_")
cfg = mc.load_config("configs/induction.py")
mc.apply_overrides(cfg, ["--config.train.steps=1000", "--config.train.eval_every=500",
                         "--config.train.checkpoint_every=500"])
summary = loop.train(cfg, workdir, log=lambda s: None)
print(summary["status"], "at step", summary["step"])

# %% [markdown]
# ## Behaviour, composition and term importance
#
# `induction_circuits.circuits` scores every head on held-out repeated tokens (prefix matching,
# copying, previous-token attention), computes Q-, K- and V-composition against a
# random-matrix baseline, and splits the logits into direct path, single heads and
# virtual heads.

# %%
result = induction_circuits.circuits(mha_jax.load(workdir), None,
                                  induction_circuits.CircuitsOptions(samples=50, track=False),
                                  log=lambda s: None)
heads = result["heads"]
for name in sorted(heads):
  s = heads[name]
  print(f"{name}: prefix matching {s['prefix_matching']:.2f}, copying {s['copying']:+.2f}, "
        f"previous token {s['previous_token']:.2f}")

# %% [markdown]
# ## The circuit
#
# The previous-token head is layer 0's head with the highest previous-token score; the
# induction heads have prefix matching >= 0.3 and positive copying, each with its
# strongest K-composition partner.

# %%
print("previous-token head:", result["previous_token_head"])
for r in result["induction_heads"]:
  print(f"induction head {r['head']}: K-composes most with {r['k_partner']} "
        f"({r['k_partner_score']:+.3f} over the baseline)")
for row in result["term_importance"]:
  print(f"kept {row['orders_kept']}: loss {row['loss']:.3f} "
        f"({row['loss_change_vs_full']:+.3f} against the full model)")

# %% [markdown]
# ## In a notebook
#
# A trace of held-out repeated tokens draws the two heads' attention: the
# previous-token head's diagonal just below the main one, the induction head's
# stripe n - 1 positions back.

# %%
run = mha_jax.load(workdir)
tokens, _ = run.task.repeated_tokens(0, 1, 10)
run.run(tokens)
