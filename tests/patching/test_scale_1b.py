"""scripts/scale_1b.py's path at test size (issue 47's 1B run, 2 layers, width 64): a
random transformers Llama with SmolLM2's tokenizer saved sharded in bf16, imported, then
`patch --sites head_out` and `circuit --method eap-ig` on 4 IOI pairs with a memory
budget; the head table equals torch forward hooks on the same transformers model."""

import os
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))


@pytest.mark.slow
def test_the_1b_run_s_path_at_test_size(tmp_path):
  import scale_1b
  doc = scale_1b.run("tiny", str(tmp_path), budget="64MB", sample=6)
  assert doc["import"]["rc"] == doc["patch"]["rc"] == doc["circuit"]["rc"] == 0
  ref = doc["reference"]
  assert len(ref["heads"]) == 5 and ref["max_abs_diff"] < 1e-4
  assert ref["ld_clean"] != ref["ld_corrupt"]
  assert doc["patch_plan"]["bytes"] <= 64 * 10**6
  mem = doc["circuit_summary"]["memory_budget"]
  assert mem["bytes"] == 64 * 10**6 and mem["eap_ig"]["bytes"] <= 64 * 10**6
