"""Configs are data: loading, arguments, overrides, locking and validation."""

import json
import os

import pytest

from mha_jax import config as mc


def test_load_with_argument_and_overrides():
  cfg = mc.load_config("configs/translation.py:heads=16,d_model=64")
  assert (cfg.model.num_heads, cfg.model.d_model) == (16, 64)
  rest = mc.apply_overrides(cfg, ["--config.train.steps=7", "--workdir", "x",
                                  "--config.data.grammar.num_nouns", "50",
                                  "--config.model.layer_norm=false", "--config.train.lr=3e-4"])
  assert rest == ["--workdir", "x"]
  assert cfg.train.steps == 7 and cfg.data.grammar.num_nouns == 50
  assert cfg.model.layer_norm is False and cfg.train.lr == 3e-4


def test_unknown_keys_are_named():
  cfg = mc.load_config("configs/translation.py")
  with pytest.raises(ValueError, match=r"config key 'train.stepz' is unknown; did you mean "
                                       r"\['train.steps'"):
    mc.apply_overrides(cfg, ["--config.train.stepz=5"])
  with pytest.raises(ValueError, match=r"config argument 'hedas' is unknown"):
    mc.load_config("configs/translation.py:hedas=4")
  with pytest.raises(AttributeError):      # locked: a typo in code fails too
    cfg.train.stepz = 3
  with pytest.raises(ValueError, match=r"--config.train.steps: cannot read 'many' as int"):
    mc.apply_overrides(cfg, ["--config.train.steps=many"])


def test_validation_names_the_field():
  cfg = mc.load_config("configs/translation.py:heads=5")
  with pytest.raises(ValueError, match=r"model.num_heads=5 does not divide model.d_model=128"):
    mc.validate(cfg)
  cfg = mc.load_config("configs/translation.py")
  mc.apply_overrides(cfg, ["--config.train.steps=0"])
  with pytest.raises(ValueError, match=r"train.steps must be >= 1; got 0"):
    mc.validate(cfg)
  cfg = mc.load_config("configs/lm.py")
  mc.apply_overrides(cfg, ["--config.train.steps=-3"])
  with pytest.raises(ValueError, match=r"train.steps must be >= 1; got -3"):
    mc.validate(cfg)


def test_parse_arg_values_with_commas():
  a = mc.parse_arg("heads=1,4,8,64,d_model=32,flag", heads="", d_model=0, flag=False)
  assert a.heads == "1,4,8,64" and a.d_model == 32 and a.flag is True


def test_incompatible_fields_ignore_resumable_ones():
  a = {"model": {"num_heads": 8}, "train": {"steps": 10, "lr": 1.0}, "eval": {"bleu_examples": 5}}
  b = {"model": {"num_heads": 8}, "train": {"steps": 20, "lr": 1.0}, "eval": {"bleu_examples": 9}}
  assert mc.incompatible_fields(a, b) == []
  b["model"]["num_heads"] = 4
  b["train"]["lr"] = 2.0
  assert mc.incompatible_fields(a, b) == ["model.num_heads", "train.lr"]


def test_every_shipped_config_loads_and_validates():
  for spec in ("configs/translation.py", "configs/translation.py:quickstart",
               "configs/translation.py:voita", "configs/lm.py",
               "configs/lm.py:attn_only,layers=2", "configs/induction.py",
               "configs/attn_only_text.py"):
    mc.validate(mc.load_config(spec))
  text = mc.load_config("configs/attn_only_text.py")    # the papers' two-layer shape
  assert (text.model.num_heads, text.model.num_layers, text.model.attn_only,
          text.model.layer_norm, text.model.pos) == (12, 2, True, False, "qk_sinusoidal")
  assert len(text.data.text_files) > 1000 and all(f.endswith(".py") for f in text.data.text_files)
  assert any("/test/" in f for f in text.data.text_files)         # stdlib_all: subpackages too
  top = mc.load_config("configs/attn_only_text.py:corpus=stdlib").data.text_files
  assert 100 < len(top) < len(text.data.text_files)
  assert {os.path.dirname(f) for f in top} == {os.path.dirname(top[0])}
  sweep = mc.load_config("configs/sweep_heads.py")
  assert [r["overrides"]["model.num_heads"] for r in sweep.runs] == [1, 2, 4, 8, 16, 32, 64]


def test_configs_saved_before_a_field_existed_load_with_the_value_they_ran_with(tmp_path):
  from mha_jax.train import loop
  new = mc.to_dict(mc.load_config("configs/translation.py"))
  old = json.loads(json.dumps(new))
  del old["model"]["pos"], old["model"]["max_rel"]          # a run from before relative positions
  cfg = mc.from_dict(old)
  assert cfg.model.pos == "sinusoidal" and cfg.model.max_rel == 16
  assert "pos" not in old["model"]                          # the saved dict is not modified
  wd = tmp_path / "run"
  wd.mkdir()
  (wd / "config.json").write_text(json.dumps(old))
  (wd / "checkpoints" / "1" / "opt_state").mkdir(parents=True)   # a run, not an empty dir
  resumed = mc.load_config("configs/translation.py")
  mc.apply_overrides(resumed, ["--config.model.pos=sinusoidal"])
  loop.prepare_workdir(resumed, str(wd))                    # same model: may resume
  with pytest.raises(ValueError, match=r"model.pos: 'sinusoidal' -> 'relative'"):
    loop.prepare_workdir(mc.load_config("configs/translation.py"), str(wd))


def test_a_checkpoint_from_before_a_model_field_existed_is_checked_with_its_old_value():
  from mha_jax.errors import UserError
  from mha_jax.train import checkpoint as ckpt_lib
  meta = {"task": "lm", "model": {"d_model": 8, "pos": "qk_sinusoidal"}}   # no max_rel
  cfg = {"task": "lm", "model": {"d_model": 8, "pos": "qk_sinusoidal",
                                 "max_rel": mc.ADDED_FIELDS["lm"]["model.max_rel"]}}
  ckpt_lib.check_model_config(meta, cfg, "checkpoint 5", "config.json")   # the same model
  cfg["model"]["max_rel"] += 1
  with pytest.raises(UserError, match=r"model.max_rel: 16 in the checkpoint, 17 in"):
    ckpt_lib.check_model_config(meta, cfg, "checkpoint 5", "config.json")
  del cfg["model"]["max_rel"]            # a config that predates it too: the same model
  ckpt_lib.check_model_config(meta, cfg, "checkpoint 5", "config.json")
  old = {"task": "lm", "model": {"d_model": 8}}
  assert mc.incompatible_fields(old, {"task": "lm", "model": {"d_model": 8}}) == []
  assert mc.incompatible_fields(old, {"task": "lm", "model": {"d_model": 8,
                                                             "max_rel": 16}}) == []
  assert mc.incompatible_fields(old, {"task": "lm", "model": {"d_model": 8,
                                                             "max_rel": 4}}) == ["model.max_rel"]
