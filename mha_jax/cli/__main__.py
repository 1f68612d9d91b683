"""`python -m mha_jax.cli VERB ...`, the same as `mha-jax VERB ...`."""

import sys

from mha_jax.cli import main

sys.exit(main())
