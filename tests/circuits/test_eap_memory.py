"""EAP / EAP-IG's memory plan (toolkit/memory.eap_plan): ends per gradient chunk chosen
from the shapes and a budget, its bytes within the budget, the same scores at any
chunking, and a budget below one end refused with the minimum."""

import dataclasses

import numpy as np
import pytest

from mha_jax.circuits import edges as edges_lib
from mha_jax.errors import UserError
from mha_jax.toolkit import activation_patching, memory
from oracles import LlamaTask, tiny_llama_pairs

LLAMA_1B = memory.PatchShapes(layers=16, heads=32, kv_heads=8, head_dim=64, d_model=2048,
                              d_mlp=8192, vocab=49152, t=20, pairs=4, dtype_bytes=2)
LLAMA_8B = memory.PatchShapes(layers=32, heads=32, kv_heads=8, head_dim=128, d_model=4096,
                              d_mlp=14336, vocab=128256, t=20, pairs=8)


def by_hand(s: memory.PatchShapes, nodes: int, ends: int, program: str) -> int:
  """The byte model written out (memory.EapShapes' docstrings)."""
  b = s.dtype_bytes
  layer = (16 * s.t * s.d_model + b * s.t * (2 * s.heads + 2 * s.kv_heads) * s.head_dim
           + 8 * s.heads * s.t * s.t + 3 * b * s.t * s.d_mlp)
  fixed = 12 * s.pairs * s.t * nodes * s.d_model + s.layers * s.pairs * layer + 8 * s.pairs * s.vocab
  store = {"eap": 2, "ig": 3, "activations": 0}[program] * 4 * s.pairs * s.t * s.d_model
  return fixed + ends * (store + (4 * nodes if store else 0))


def graph_size(s: memory.PatchShapes) -> tuple[int, int]:
  return 1 + s.layers * (s.heads + 1), s.layers * (s.heads + 2 * s.kv_heads + 1) + 1


@pytest.mark.parametrize("shapes", [LLAMA_1B, LLAMA_8B])
@pytest.mark.parametrize("program", ["eap", "ig", "activations"])
@pytest.mark.parametrize("budget", [10**8, 4 * 10**9, 16 * 10**9, 10**12])
def test_the_chosen_ends_per_chunk_fit_and_are_the_most_that_do(shapes, program, budget):
  nodes, ends = graph_size(shapes)
  sh = memory.EapShapes(shapes, nodes, ends, program)
  one = by_hand(shapes, nodes, 1, program)
  if budget < one:
    with pytest.raises(UserError, match=f"memory_budget of {budget:,} bytes.*at least "
                                        f"{one:,} bytes"):
      memory.eap_plan(sh, budget)
    return
  plan = memory.eap_plan(sh, budget)
  c = plan.ends_per_chunk
  assert plan.bytes == by_hand(shapes, nodes, c, program) <= budget
  assert c == ends or by_hand(shapes, nodes, c + 1, program) > budget
  # the chunks cover every end once, in order
  assert [e for lo, hi in plan.chunks for e in range(lo, hi)] == list(range(ends))
  assert all(hi - lo <= c for lo, hi in plan.chunks)


def test_the_issue_s_8b_store_is_what_the_model_counts():
  """The issue's number: Llama-3.1-8B's grouped graph has 1,569 ends, and at B 8, T 20,
  D 4,096 the float32 gradient store is 4.1 GB."""
  nodes, ends = graph_size(LLAMA_8B)
  assert ends == 1569
  sh = memory.EapShapes(LLAMA_8B, nodes, ends, "eap")
  assert 4.1e9 < ends * 4 * 8 * 20 * 4096 < 4.2e9
  assert sh.per_end() * ends > ends * 4 * 8 * 20 * 4096


@pytest.fixture(scope="module")
def tiny():
  params, pairs = tiny_llama_pairs(slice(1, 4), [7, 7, 7])
  return params, pairs


def studies(tiny, budget_of):
  params, pairs = tiny
  s = activation_patching.Study(LlamaTask(), params, pairs, memory_budget=2**30)
  big = edges_lib.EdgeStudy(s)
  need = budget_of(big)
  s2 = activation_patching.Study(LlamaTask(), params, pairs, memory_budget=need,
                                 baseline=s.baseline())
  return big, edges_lib.EdgeStudy(s2)


@pytest.mark.slow
@pytest.mark.parametrize("program", ["eap", "ig"])
def test_scores_are_the_same_at_any_chunking(tiny, program):
  """One end per chunk (the smallest budget that fits) against every end at once."""
  big, small = studies(tiny, lambda es: memory.eap_bytes(es.shapes(program), 1))
  run = (lambda es: es.eap()) if program == "eap" else (
      lambda es: es.eap_ig(3, "inputs", "midpoint"))
  want, got = run(big), run(small)
  assert len(big.last_plan.chunks) == 1
  assert small.last_plan.ends_per_chunk == 1
  assert len(small.last_plan.chunks) == len(small.graph.ends)
  assert small.last_plan.bytes <= small.s.memory_budget
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("program", ["eap", pytest.param("ig", marks=pytest.mark.slow)])
def test_chunks_of_several_ends_across_sites(tiny, program):
  """Three chunks that split a layer's query heads and span sites, against one."""
  big, small = studies(tiny, lambda es: memory.eap_bytes(
      es.shapes(program), -(-len(es.graph.ends) // 3)))
  assert len(small.plan(program).chunks) == 3
  run = (lambda es: es.eap()) if program == "eap" else (
      lambda es: es.eap_ig(2, "inputs", "left"))
  np.testing.assert_allclose(run(small), run(big), atol=1e-6, rtol=1e-5)


def test_a_budget_below_one_end_is_refused_by_name(tiny):
  big, small = studies(tiny, lambda es: memory.eap_bytes(es.shapes("eap"), 1) - 1)
  need = memory.eap_bytes(big.shapes("eap"), 1)
  with pytest.raises(UserError, match=f"at least {need:,} bytes") as e:
    small.eap()
  assert e.value.settings == ("memory_budget",)


def test_the_shapes_are_the_study_s(tiny):
  big, _ = studies(tiny, lambda es: 1)
  sh = big.shapes("eap")
  assert (sh.nodes, sh.ends) == (len(big.graph.nodes), len(big.graph.ends))
  assert dataclasses.asdict(sh.model)["t"] == big.s.t


@pytest.mark.slow
def test_the_circuit_command_takes_a_budget(tiny_attn_lm, tmp_path, capsys):
  import json
  from mha_jax import cli
  wd, _ = tiny_attn_lm
  args = ["circuit", "--workdir", wd, "--task", "induction", "--n-pairs", "3",
          "--method", "eap", "--keep-failing", "--sample", "6", "--steps", "1"]
  assert cli.main(args + ["--memory-budget", "8MiB", "--out", str(tmp_path / "a")]) == 0
  doc = json.loads((tmp_path / "a" / "circuit.json").read_text())
  mem = doc["memory_budget"]
  assert mem["bytes"] == 8 * 2**20
  assert mem["eap"]["bytes"] <= 8 * 2**20 and mem["eap_ig"]["bytes"] <= 8 * 2**20
  capsys.readouterr()
  assert cli.main(args + ["--memory-budget", "1KB", "--out", str(tmp_path / "b")]) != 0
  err = capsys.readouterr().err
  assert "memory-budget of 1,000 bytes" in err and "needs at least" in err


@pytest.mark.parametrize("data,model", [(1, 1), (2, 1), (1, 8), (4, 8)])
def test_a_mesh_splits_the_node_values_and_the_end_gradients(data, model):
  """On a mesh, a device holds 1/data of the pairs and 1/model of D of the node values,
  and 1/data of the pairs of each end's gradient (the rest of the model as on one)."""
  nodes, ends = graph_size(LLAMA_8B)
  one = memory.EapShapes(LLAMA_8B, nodes, ends, "eap")
  split = memory.EapShapes(LLAMA_8B, nodes, ends, "eap", data=data, model_axis=model)
  s = LLAMA_8B
  node_values = 12 * s.pairs * s.t * nodes * s.d_model
  assert one.fixed() - split.fixed() == node_values - node_values // (data * model)
  assert split.per_end() == 2 * 4 * (s.pairs // data) * s.t * s.d_model + 4 * nodes


def test_a_budget_below_one_end_names_the_most_pairs_that_fit():
  """The refusal names the largest pair count whose one-end chunk fits (checked by
  hand one pair more and at that count), and none when not even one pair fits."""
  nodes, ends = graph_size(LLAMA_8B)
  sh = memory.EapShapes(LLAMA_8B, nodes, ends, "eap")
  at = lambda b: by_hand(dataclasses.replace(LLAMA_8B, pairs=b), nodes, 1, "eap")  # noqa: E731
  budget = (at(3) + at(4)) // 2
  assert memory.eap_pairs_that_fit(sh, budget) == 3
  with pytest.raises(UserError, match="at most 3 of its 8 pairs fit it.*--n-pairs 3"):
    memory.eap_plan(sh, budget)
  assert memory.eap_pairs_that_fit(sh, at(1) - 1) == 0
  with pytest.raises(UserError) as e:
    memory.eap_plan(sh, at(1) - 1)
  assert "pairs fit" not in str(e.value)
