"""Head roles, in one package: what each head does.

The shared role logic (floor 4, what several studies read): `role_scores` (Voita et
al.'s statistics and the LM pattern scores, reduced batch by batch; the roles' colours
and order), `head_roles` (every head's statistics and role for a loaded run, by its
task), `syntax` (syntactic heads of a wordpiece encoder on CoNLL-U sentences),
`detectors` (successor, copy suppression, IOI and retrieval detectors of decoder LMs),
`head_taxonomy` (every head of a decoder LM assigned a role, each role checked causally),
`bootstrap` (the text roles' scores over many windows, with bootstrap intervals)
and `behaviour` (prefix matching, previous token, copying and ICL scores on repeated
tokens).

The role studies (floor 5, one verb each): `taxonomy` (`mha-jax taxonomy`) and
`role_steps` (`mha-jax role-steps`: the step at which each role appears over a run's
checkpoints).
"""
