"""The primer page's HTML, CSS and JS (package data, put together by mha_jax.assets.page)."""
