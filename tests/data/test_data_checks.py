"""The data's checks: binary files and CoNLL-U heads refused naming the field and the file;
special ids defined once per vocabulary."""

import os

import pytest

from mha_jax.errors import UserError
from builders import ROOT


def test_binary_data_files_name_the_field_and_the_file(tmp_path):
  from mha_jax.data import parallel, text
  p = tmp_path / "train.src"
  p.write_bytes(b"ok line\n\xff\xfe\x00binary\n")
  with pytest.raises(UserError, match=rf"data.train_src: '{p}' is not UTF-8 text"):
    parallel.read_lines(str(p), "data.train_src")
  with pytest.raises(UserError, match=rf"data.text_files: '{p}' is not UTF-8 text"):
    text.read_corpus([str(p)])


@pytest.mark.parametrize("head,msg", [
    ("x", r"not valid CoNLL-U .*'head'"),
    ("9", r"sentence 1 of .*token 1 \('the'\): head 9 is not a token of the sentence \(0..2\)"),
    ("_", r"head None is not a token"),
])
def test_conllu_heads_that_are_not_tokens_are_refused(tmp_path, head, msg):
  from mha_jax.data import parallel
  p = tmp_path / "t.conllu"
  p.write_text(f"1\tthe\tthe\tDET\t_\t_\t{head}\tdet\t_\t_\n"
               "2\tdog\tdog\tNOUN\t_\t_\t0\troot\t_\t_\n\n")
  with pytest.raises(UserError, match=msg):
    parallel.read_conllu_arcs(str(p), [["the", "dog"]], "data.conllu.train")


def test_special_ids_have_one_definition_per_vocabulary():
  import ast
  import glob
  from mha_jax.data import repeated_tokens, text, vocab as vocab_lib
  from mha_jax.models import common
  assert text.BOS_ID is vocab_lib.LM_BOS_ID and repeated_tokens.BOS_ID is vocab_lib.LM_BOS_ID
  assert common.ModelSpec("seq2seq").pad_id == vocab_lib.PAD_ID
  root = os.path.join(ROOT, "mha_jax")
  literal = []
  for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
    if path.endswith(os.path.join("data", "vocab.py")):
      continue
    for node in ast.walk(ast.parse(open(path).read())):
      if isinstance(node, (ast.Assign, ast.AnnAssign)):   # X_ID = 0, pad_id: int = 0
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [getattr(t, "id", getattr(t, "attr", "")) for t in targets]
        if (any(n.lower().endswith("_id") for n in names) and
            isinstance(node.value, ast.Constant)):
          literal.append((os.path.basename(path), names))
      if isinstance(node, ast.Compare) and any(   # ids != 0: padding by a literal
          isinstance(c, ast.Constant) and c.value == 0 for c in node.comparators) and any(
              isinstance(o, ast.NotEq) for o in node.ops) and any(
                  w in ast.unparse(node.left) for w in ("src", "tgt", "ids")):
        literal.append((os.path.basename(path), ast.unparse(node)))
  assert literal == []


@pytest.mark.parametrize("heads,msg", [
    (("2", "1", "0"), r"sentence 1 of .*: the heads form a cycle \(tokens 1 -> 2 -> 1\)"),
    (("1", "0", "2"), r"the heads form a cycle \(tokens 1 -> 1\)"),
    (("2", "3", "1"), r"sentence 1 of .* has no root \(no token with head 0\)"),
])
def test_conllu_heads_that_form_no_tree_are_refused(tmp_path, heads, msg):
  from mha_jax.data import parallel
  p = tmp_path / "t.conllu"
  p.write_text(f"1\tthe\tthe\tDET\t_\t_\t{heads[0]}\tdet\t_\t_\n"
               f"2\tdog\tdog\tNOUN\t_\t_\t{heads[1]}\troot\t_\t_\n"
               f"3\truns\trun\tVERB\t_\t_\t{heads[2]}\troot\t_\t_\n\n")
  with pytest.raises(UserError, match=msg):
    parallel.read_conllu_arcs(str(p), [["the", "dog", "runs"]], "data.conllu.train")
