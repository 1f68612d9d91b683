# %% [markdown]
# # Which heads of SmolLM2 name the indirect object?
#
# "When Mary and John went to the store, John gave a drink to" ... " Mary". Indirect
# object identification (IOI, Wang et al. 2022) is a behaviour small LMs have, and
# activation patching asks which heads carry it: run the prompt with the subject
# swapped ("..., Mary gave a drink to", which points at John), put one head's output
# from the clean run into it, and see how much of the clean logit difference
# logit(Mary) - logit(John) comes back. Every head of SmolLM2-135M (30 layers x 9 query
# heads over 3 key/value heads) is patched in one compiled program. Small settings (2
# pairs, the last 10 layers): under a minute on 2 CPU cores; `mha-jax patch` runs the
# full study.

# %%
import mha_jax
from mha_jax import interventions
from mha_jax.toolkit import activation_patching, pairs

loaded = mha_jax.load("smollm2-135m")    # from the pip package, imported once, offline
ioi = pairs.ioi_pairs(loaded.task, n=2, seed=0)
for t in ioi.text:
  print(t["clean"], "->", t["answer"], "| corrupt:", t["corrupt"])

# %% [markdown]
# ## Clean, corrupt, and the sites in between
#
# A `Study` holds the pairs; its baseline is the logit difference on the clean and the
# corrupt prompts. Underneath, every method runs the model's own forward with edits of
# named sites (`mha_jax.interventions`): here, by hand, head 3 of layer 23's output `z`
# from the clean run put into the corrupt run.

# %%
study = activation_patching.Study(loaded.task, loaded.params, ioi)
print("logit difference clean", study.ld_clean.round(2), "corrupt", study.ld_corrupt.round(2))

clean_z = study.values("clean", ["lm.23.attn.z"])["lm.23.attn.z"]     # (N, T, H, K)
out = study.edited("corrupt", {"lm.23.attn.z": interventions.replace(clean_z, heads=3)})
print("lm.23.3 patched: logit difference", out["ld"].round(2))

# %% [markdown]
# ## Every head at once
#
# `patch("z")` patches each head's output (all positions) from the clean run into the
# corrupt one: one vmap over the interventions. The score is the normalised recovery
# (LD - LD_corrupt) / (LD_clean - LD_corrupt). The prompts' shared prefix (the tokens
# before the second subject) is computed once and attended through the KV cache.

# %%
res = study.patch("z", layers=range(20, 30))
table = activation_patching.head_table(res["recovery"])
for name, v in activation_patching.top(table, 5, by_abs=True):
  print(f"{name}: recovery {v:+.3f}")

# %% [markdown]
# ## Direct logit attribution and attribution patching
#
# DLA: each head's direct write into the logit(answer) - logit(wrong) direction, the
# final norm's scale frozen at the clean run. AtP: the first-order estimate of every
# head's patching effect from one forward and one backward, with its agreement with
# the exact numbers above.

# %%
dla = study.dla()
print("top DLA:", activation_patching.top(activation_patching.head_table(dla["heads"]), 3, by_abs=True))
print(f"heads + MLPs + embeddings = {dla['ld_frozen_sum']:.3f} = LD {dla['ld']:.3f}")
atp = study.attribution(("z",))["z"]["heads"]
print("AtP vs exact (layers 20-29):", activation_patching.agreement(atp[20:], res["recovery"][20:]))

# %% [markdown]
# ## In a notebook
#
# `mha_jax.show` draws the recovery table as bars, and a trace of the first clean prompt
# draws its attention (pick layer 23, head 3).

# %%
mha_jax.show(table)
loaded.run(ioi.text[0]["clean"])
