"""The experiment harness: the seed documents' claims (`claims/`: experiments, rules,
the primer page) and the benchmarks (`bench`, `bench_train`). It uses the library as a
user would; `mha_jax` never imports it, except the CLI's one hook (`verbs`), which adds
the harness's verbs `mha-jax claims`, `mha-jax primer` and `mha-jax bench ...`."""
