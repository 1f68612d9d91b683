"""The config's checks: every numeric field range-checked by name, an unknown impl
refused naming the other fields."""

import os

import pytest

from mha_jax import config as mc
from mha_jax.errors import UserError
from mha_jax.train import loop
from builders import QUIET, induction_cfg


@pytest.mark.parametrize("field,value,msg", [
    ("model.dropout", "1.5", r"model.dropout must be in \[0, 1\); got 1.5"),
    ("model.dropout", "-0.1", r"model.dropout must be in \[0, 1\); got -0.1"),
    ("train.clip", "-1", r"train.clip must be >= 0 \(global-norm clipping; 0 = none\); got -1"),
    ("train.keep", "-1", r"train.keep must be >= 1 \(checkpoints kept on disk\); got -1"),
    ("train.label_smoothing", "1.0", r"train.label_smoothing must be in \[0, 1\); got 1.0"),
    ("train.lr", "0", r"train.lr must be > 0; got 0"),
    ("train.b2", "1.5", r"train.b2 must be in \[0, 1\); got 1.5"),
    ("train.warmup", "-5", r"train.warmup must be >= 0; got -5"),
    ("train.weight_decay", "-0.1", r"train.weight_decay must be >= 0; got -0.1"),
    ("train.max_loss_factor", "0.5", r"train.max_loss_factor must be > 1"),
    ("eval.batch_size", "0", r"eval.batch_size must be >= 1; got 0"),
    ("data.half_len", "-1", r"data.half_len must be >= 0; got -1"),
])
def test_every_numeric_field_is_range_checked_by_name(field, value, msg):
  with pytest.raises(UserError, match=msg):
    mc.validate(induction_cfg(f"--config.{field}={value}"))


def test_an_unknown_impl_is_refused_with_the_other_config_fields(tmp_path):
  wd = str(tmp_path / "run")
  with pytest.raises(UserError, match=r"model.impl must be one of auto, reference, xla, "
                                      r"cudnn, blocked, pallas; got 'fast'"):
    loop.train(induction_cfg("--config.train.steps=2", "--config.model.impl=fast"), wd,
               **QUIET)
  assert not os.path.exists(wd)
