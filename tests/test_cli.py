"""The `mha-jax` command: zoo and the benchmark harness (no timings are asserted)."""

import json
import subprocess
import sys

import pytest

from mha_jax import cli


def test_zoo_prints_every_model_with_d_k(capsys):
  assert cli.main(["zoo", "--seq-len", "1024"]) == 0
  out = capsys.readouterr().out
  assert "T=1024" in out
  for model, d_k in (("Transformer-base", 64), ("GPT-2 XL", 64), ("LLaMA 65B", 128),
                     ("GPT-3 175B", 128)):
    line = next(l for l in out.splitlines() if l.startswith(model))
    assert int(line.split()[-5]) == d_k, line
  assert "603,979,776" in out            # 4 * 12288^2
  llama2 = next(l for l in out.splitlines() if l.startswith("LLaMA-2 70B")).split()
  assert (llama2[3], llama2[4], llama2[6]) == ("64", "8", "150,994,944")   # h, h_kv, params


def test_console_script_entry_point_runs():
  r = subprocess.run([sys.executable, "-m", "mha_jax.cli", "zoo"], capture_output=True,
                     text=True, check=True)
  assert "LLaMA 13B" in r.stdout


@pytest.mark.slow    # a benchmark run end to end (~11 s); `pytest -m slow`
def test_bench_attention_writes_json_and_table(tmp_path, capsys):
  out = tmp_path / "b.json"
  assert cli.main(["bench", "attention", "--d-model", "32", "--seq-len", "8", "--batch", "1",
                   "--heads", "4,8", "--rounds", "2", "--out", str(out),
                   "--impls", "mha_jax impl=auto,mha_jax impl=blocked"]) == 0
  text = capsys.readouterr().out
  data = json.loads(out.read_text())
  impls = {r["impl"] for r in data["rows"]}
  assert impls == {"mha_jax impl=auto", "mha_jax impl=blocked", "flax.linen MHDPA",
                   "flax.nnx MultiHeadAttention", "linen + jax.nn.dot_product_attention"}
  assert len(data["rows"]) == 2 * 2 * len(impls)       # h x mode x impl
  assert all(len(r["times_ms"]) == 2 and r["median_ms"] > 0 for r in data["rows"])
  assert data["machine"]["matmul_gflops"] > 0
  assert "| 8 | 4 | flax.linen MHDPA |" in text


def test_bench_scale_t_reports_time_memory_and_over_cap(tmp_path, capsys):
  """Each (impl, T) in its own capped subprocess; an allocation over the cap is reported."""
  out = tmp_path / "s.json"
  assert cli.main(["bench", "attention", "--scale-t", "--d-model", "16", "--heads", "2",
                   "--seq-lens", "16,40000", "--impls", "mha_jax impl=reference",
                   "--rounds", "1", "--max-mem-gb", "4", "--out", str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert [r["status"] for r in rows] == ["ok", "over cap"]   # 2 * 40000^2 * 4 B = 12.8 GB
  assert rows[0]["median_ms"] > 0 and 50 < rows[0]["max_rss_mb"] < 4096
  assert "over cap" in capsys.readouterr().out


def test_bench_rejects_heads_not_dividing_width(tmp_path, capsys):
  assert cli.main(["bench", "attention", "--d-model", "30", "--heads", "8",
                   "--out", str(tmp_path / "x.json")]) == 2
  assert "h=8 does not divide d_model=30" in capsys.readouterr().err
  assert not (tmp_path / "x.json").exists()


def test_zoo_head_sweep_keeps_params_and_flops_flat(capsys):
  assert cli.main(["zoo", "--d-model", "64", "--seq-len", "128", "--batch", "16"]) == 0
  rows = [l.split() for l in capsys.readouterr().out.splitlines() if l[:5].strip().isdigit()]
  assert [int(r[0]) for r in rows] == [1, 2, 4, 8, 16, 32, 64]
  assert [int(r[1]) for r in rows] == [64, 32, 16, 8, 4, 2, 1]
  assert {r[2] for r in rows} == {"16,384"} and len({r[3] for r in rows}) == 1
  mib = [float(r[4]) for r in rows]
  assert mib == sorted(mib) and mib[-1] == 64 * mib[0]
