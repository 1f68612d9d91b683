"""Which kernel serves a call: the `impl` switch, and `auto` with the measurements behind it.

impl names:
  reference  explicit (B, H, T, S) weights (kernels/reference.py); the only one that
             returns weights, what every analysis uses.
  xla        jax.nn.dot_product_attention, XLA's fused path (kernels/xla.py).
  cudnn      the same through cuDNN (NVIDIA GPU, bfloat16/float16).
  blocked    flash-style blocked attention in pure JAX, O(T) memory, any backend
             (kernels/blocked.py).
  pallas     Pallas flash kernels, GPU (Triton) or TPU (flash/splash) (kernels/pallas.py).
  auto       the rule below.

`auto`:
  1. return_weights -> reference (the analyses need explicit weights).
  2. GPU: cudnn where it can serve the call (bf16/f16, K % 8 == 0, K <= 256, no score
     bias); else pallas where it can (no mask, no bias, lengths multiples of the
     block); TPU: pallas (flash with a bias, splash without) where it can serve.
     These are not measured here (no accelerator was at hand when this was written):
     they follow the kernels' purpose, and the GPU/TPU rows of the benchmark are to be
     filled in on such a machine.
  3. Never a kernel that materialises the (B, H, T, S) scores when they would not fit:
     reference and xla need about SCORE_COPIES float32 copies of them in
     forward+backward; when that exceeds score_memory_budget(), blocked.
  Soft-capping (has_softcap) rules out cudnn and every Pallas kernel but TPU splash.
  4. Otherwise the faster of reference and blocked on this backend, as measured
     (docs/results/attention.md): blocked once B * H * T * S reaches
     BLOCKED_FROM_SCORES, reference below (small problems: one block, the custom VJP's
     recomputation does not pay).
"""

from __future__ import annotations

import collections.abc
import functools
import resource

import jax
import numpy as np

from mha_jax import attention_variants as variants
from mha_jax.kernels import blocked as blocked_lib
from mha_jax.kernels import pallas as pallas_lib
from mha_jax.kernels import reference as reference_lib
from mha_jax.kernels import target as target_lib
from mha_jax.kernels import xla as xla_lib
from mha_jax.kernels.target import Target, compile_target, current_target, target_of

__all__ = ["Target", "target_of", "compile_target", "current_target", "resolve_impl",
           "run_kernel", "memory_limit", "score_memory_budget", "check_scores_fit",
           "scores_fit", "check_variant_kernel", "served_kernels"]

IMPLS = ("auto", "reference", "xla", "cudnn", "blocked", "pallas")
NO_WEIGHTS = ("xla", "cudnn", "blocked", "pallas")
TAKES_TABLE = ("blocked",)   # builds the relative-position bias per block
TAKES_WINDOW = ("blocked",)  # skips the key blocks outside a sliding window
# Attention-logit soft-capping: reference and blocked apply it to their scores; xla
# runs the building blocks (jax.nn.dot_product_attention takes no cap); pallas only
# through TPU splash; cudnn refuses it.
TAKES_SOFTCAP = ("reference", "xla", "blocked", "pallas")
# Kernels that take the variants' kernel arguments (attention_variants.Variant.kernel_args):
# sigmoid weights and the sink logit change the kernel's own sums.
TAKES_SIGMOID = ("reference", "blocked")
TAKES_SINK = ("reference", "blocked")


def served_kernels(variant: str) -> tuple[str, ...]:
  """The kernels that serve `variant`, from its registry entry (mha_jax/attention_variants.py):
  every kernel when it acts outside them (gates, QK-norm), else the ones it names."""
  kernels = variants.get(variant).kernels
  return IMPLS[1:] if kernels is None else tuple(kernels)


class _VariantKernels(collections.abc.Mapping):
  """{variant: the kernels that serve it}, read from the registry at each use (a variant
  registered later is in it)."""

  def __getitem__(self, variant):
    if variant not in variants.NAMES:
      raise KeyError(variant)
    return served_kernels(variant)

  def __iter__(self):
    return iter(tuple(variants.NAMES))

  def __len__(self):
    return len(variants.NAMES)


VARIANT_KERNELS = _VariantKernels()


def check_variant_kernel(kernel: str, variant: str) -> None:
  """Refuses, by name, a kernel that does not serve the variant."""
  if variant not in VARIANT_KERNELS:
    raise ValueError(f"variant must be one of {tuple(VARIANT_KERNELS)}; got {variant!r}")
  served = VARIANT_KERNELS[variant]
  if kernel not in served:
    raise ValueError(f"impl={kernel!r} does not serve variant={variant!r}; the kernels "
                     f"that do: {served} (or impl='auto', which picks among them)")


# B * H * T * S from which `auto` picks blocked over reference on a CPU: below it one
# block covers the problem and the custom VJP's recomputation does not pay. Chosen from
# `mha-jax bench attention` (docs/results/attention.md, from bench_attention_cpu.json).
BLOCKED_FROM_SCORES = 2**21
# float32 (B, H, T, S) tensors alive at once in the reference path's forward+backward:
# measured, --scale-t at T = 4096 (docs/results/bench_attention_scale_t_cpu.json):
# reference and xla peak at 3.5 GB, 0.44 GB of it the runtime, with 0.54 GB per copy.
SCORE_COPIES = 6
# Budget when the device does not say: a quarter of the host's available memory.
_FALLBACK_BYTES = 4 * 2**30


def memory_limit(target: Target | None = None) -> tuple[int, str]:
  """(bytes, what they are) of the memory one device of `target` (None: the current
  target, kernels/target.py) may use: for a known accelerator kind its HBM
  (mha_jax.chips), the same on the machine that lowers a program as on the one that
  runs it; for this process's own device of an unknown kind, its reported limit; for a
  CPU, the host's available memory or the process's address-space limit (RLIMIT_AS),
  whichever is smaller. Read once per process and target."""
  return _memory_limit(current_target() if target is None else target)


@functools.cache
def _memory_limit(target: Target) -> tuple[int, str]:
  hbm = target_lib.hbm_bytes(target.device_kind)
  if target.platform != "cpu" and hbm is not None:
    return hbm, f"the memory of one {target.device_kind} device"
  local = jax.devices()[0]
  if target.platform != "cpu" and (target.platform, target.device_kind) == (
      target_lib.target_of([local]).platform, local.device_kind):
    try:
      stats = local.memory_stats() or {}
    except Exception:  # backends without memory stats
      stats = {}
    if "bytes_limit" in stats:
      return int(stats["bytes_limit"]), "the device's memory"
  if target.platform != "cpu":
    return _FALLBACK_BYTES, f"a guess for {target.device_kind!r} (its memory is not known)"
  host, what = _FALLBACK_BYTES * 4, "the host's memory"
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          host, what = int(line.split()[1]) * 1024, "the host's available memory"
  except OSError:
    pass
  cap = resource.getrlimit(resource.RLIMIT_AS)[0]
  if cap != resource.RLIM_INFINITY and cap < host:
    host, what = cap, "the process's address-space limit (RLIMIT_AS)"
  return host, what


def score_memory_budget(target: Target | None = None) -> int:
  """Bytes the (B, H, T, S) score tensors may take on one device of `target` (None: the
  current one), fixed per process and target (so a kernel choice does not follow the
  machine's load): half a device's memory, a quarter of the host's (memory_limit)."""
  limit, what = memory_limit(target)
  return limit // 4 if (target or current_target()).platform == "cpu" else limit // 2


# float32 (B, H, T, S) tensors a forward pass of the reference kernel needs at least
# (the scores and the weights).
FORWARD_SCORE_COPIES = 2


def check_scores_fit(kernel: str, b: int, h: int, t: int, s: int,
                     target: Target | None = None) -> None:
  """A kernel that holds the (B, H, T, S) scores whole (reference; xla on a CPU target)
  is refused, saying why, when even a forward pass's scores exceed one device's memory
  (target None: the current target): otherwise the run ends in an allocator's error deep
  inside XLA."""
  target = current_target() if target is None else target
  if kernel != "reference" and not (kernel == "xla" and target.platform == "cpu"):
    return
  need = FORWARD_SCORE_COPIES * 4 * b * h * t * s
  limit, what = memory_limit(target)
  if need <= limit:
    return
  fix = ("Use impl='blocked' (or 'auto', which picks it at this size): the same "
         "attention in memory linear in T. Attention weights (return_weights=True) are "
         "this tensor: analyse shorter sequences, or fewer at a time")
  raise ValueError(f"impl={kernel!r} holds the (B, H, T, S) = ({b}, {h}, {t}, {s}) "
                   f"attention scores whole: {need / 2**30:.1f} GiB in float32 for the "
                   f"scores and weights alone, more than {what} "
                   f"({limit / 2**30:.1f} GiB). {fix}")


def scores_fit(b: int, h: int, t: int, s: int, budget: int | None = None,
               target: Target | None = None) -> bool:
  """Whether SCORE_COPIES float32 (B, H, T, S) tensors fit in the budget (None: the
  target's, score_memory_budget)."""
  budget = score_memory_budget(target) if budget is None else budget
  return SCORE_COPIES * 4 * b * h * t * s <= budget


def _cudnn_ok(q_BTHK, has_bias, has_softcap=False, target: Target | None = None) -> bool:
  target = current_target() if target is None else target
  if has_bias or has_softcap:
    return False
  try:
    xla_lib.check_cudnn_supported(q_BTHK, platform=target.platform)
    return True
  except ValueError:
    return False


def _pallas_ok(q_BTHK, k_BSGK, has_mask, has_bias, has_softcap=False,
               target: Target | None = None) -> bool:
  target = current_target() if target is None else target
  if target.platform not in ("gpu", "tpu"):
    return False
  try:
    pallas_lib.check_supported(pallas_lib.kernel_for(target.platform, has_bias), q_BTHK,
                               k_BSGK, k_BSGK,
                               mask_BHTS=np.zeros(()) if has_mask else None,
                               bias_BHTS=np.zeros(()) if has_bias else None,
                               softcap=1.0 if has_softcap else None,
                               platform=target.platform)
    return True
  except ValueError:
    return False


def resolve_impl(impl: str, q_BTHK: jax.Array, return_weights: bool, has_bias: bool = False,
                 *, k_BSGK: jax.Array | None = None, has_mask: bool = False,
                 budget: int | None = None, has_softcap: bool = False,
                 variant: str = "softmax", target: Target | None = None) -> str:
  """The kernel `impl` means for this call: one of IMPLS other than 'auto'.

  Args:
    impl: the requested name.
    q_BTHK: the queries (shape and dtype are read).
    return_weights: the caller wants (B, H, T, S) weights.
    has_bias: a score bias (bias or rel_bias) is present.
    k_BSGK: the keys; None means the queries' shape (self-attention).
    has_mask: a boolean mask (beyond causal) is present.
    budget: bytes for score tensors; None asks the device (score_memory_budget).
    has_softcap: attention-logit soft-capping is asked for (not cudnn; pallas only
      through TPU splash).
    variant: the attention variant; auto picks only kernels in served_kernels(variant)
      and a named kernel outside them is refused by name.
    target: the devices the program is compiled for; None: the current target
      (kernels/target.py: an active compile_target, else the mesh in context, else
      jax.devices()[0]). The choice depends on the target alone, never on the process's
      default backend. Inside compile_target the choice is appended to its list.
  """
  target = current_target() if target is None else target
  kernel = _resolve(impl, q_BTHK, return_weights, has_bias, k_BSGK, has_mask, budget,
                    has_softcap, variant, target)
  target_lib.record(kernel)
  return kernel


def _resolve(impl, q_BTHK, return_weights, has_bias, k_BSGK, has_mask, budget, has_softcap,
             variant, target: Target) -> str:
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
  if impl != "auto":
    check_variant_kernel(impl, variant)
  served = VARIANT_KERNELS.get(variant, ())   # an unknown one is refused by attention
  if return_weights:
    if impl in NO_WEIGHTS:
      raise ValueError(f"impl={impl!r} does not expose attention weights; use "
                       f"impl='reference' or 'auto' with return_weights=True")
    return "reference"
  if impl == "cudnn":
    xla_lib.check_cudnn_supported(q_BTHK, platform=target.platform)
  if impl != "auto":
    return impl
  k_BSGK = q_BTHK if k_BSGK is None else k_BSGK
  b, t, h, _ = q_BTHK.shape
  s = k_BSGK.shape[1]
  if target.platform == "gpu" and "cudnn" in served and _cudnn_ok(
      q_BTHK, has_bias, has_softcap, target):
    return "cudnn"
  if "pallas" in served and _pallas_ok(q_BTHK, k_BSGK, has_mask, has_bias, has_softcap,
                                       target):
    return "pallas"
  if not scores_fit(b, h, t, s, budget, target):
    return "blocked"
  return "blocked" if b * h * t * s >= BLOCKED_FROM_SCORES else "reference"


def run_kernel(kernel: str, q_BTHK, k_BSGK, v_BSGK, mask_BHTS, causal: bool, bias_BHTS,
               rel_bias_HR=None, *, block_q: int | None = None, block_k: int | None = None,
               block_heads: int | None = None, softcap: float | None = None,
               window: int | None = None, sigmoid_bias: float | None = None,
               sink_H=None):
  """(o (B, T, H, K), w (B, H, T, S) or None) from the named kernel.

  mask_BHTS and bias_BHTS broadcast to (B, H, T, S); rel_bias_HR (H, 2R + 1) is a
  relative-position table with query 0 at position 0, taken by the kernels in
  TAKES_TABLE (the caller turns it into a dense bias for the others). softcap (Gemma 2's
  attention-logit soft-capping) is served by the kernels in TAKES_SOFTCAP. window (a
  sliding window, i - j < window) is taken by the kernels in TAKES_WINDOW, which skip
  the blocks outside it; the caller makes it a mask for the others. sigmoid_bias: the
  weights are sigmoid(scores + sigmoid_bias), unnormalised (variant sigmoid; kernels in
  TAKES_SIGMOID). sink_H (H,): one logit per head in the softmax's denominator (variant
  sink; TAKES_SINK).
  """
  if sigmoid_bias is not None and kernel not in TAKES_SIGMOID:
    check_variant_kernel(kernel, "sigmoid")
  if sink_H is not None and kernel not in TAKES_SINK:
    check_variant_kernel(kernel, "sink")
  if softcap is not None and kernel not in TAKES_SOFTCAP:
    raise ValueError(f"softcap (attention-logit soft-capping) is not served by kernel "
                     f"{kernel!r}: cuDNN's attention through jax.nn takes no cap. Use one "
                     f"of {TAKES_SOFTCAP} or 'auto'")
  if window is not None and kernel not in TAKES_WINDOW:
    raise ValueError(f"kernel {kernel!r} takes no window; pass it as a mask")
  t, s = q_BTHK.shape[1], k_BSGK.shape[1]
  if rel_bias_HR is not None and kernel not in TAKES_TABLE:
    raise ValueError(f"kernel {kernel!r} takes no rel_bias table; pass its dense bias")
  target = current_target()
  check_scores_fit(kernel, q_BTHK.shape[0], q_BTHK.shape[2], t, s, target)
  if kernel == "reference":
    full = mask_BHTS
    if causal:
      cm = xla_lib.causal_mask(t, s)
      full = cm if full is None else full & cm
    return reference_lib.reference_kernel(q_BTHK, k_BSGK, v_BSGK, full, bias_BHTS,
                                          softcap=softcap, sigmoid_bias=sigmoid_bias,
                                          sink_H=sink_H)
  if kernel == "xla" and softcap is not None:   # the same XLA ops, without the weights
    check_scores_fit("reference", q_BTHK.shape[0], q_BTHK.shape[2], t, s, target)
    full = mask_BHTS
    if causal:
      cm = xla_lib.causal_mask(t, s)
      full = cm if full is None else full & cm
    return reference_lib.reference_kernel(q_BTHK, k_BSGK, v_BSGK, full, bias_BHTS,
                                          softcap=softcap)[0], None
  if kernel in ("xla", "cudnn"):
    return xla_lib.fused_kernel(q_BTHK, k_BSGK, v_BSGK, mask_BHTS, causal, kernel,
                                bias_BHTS), None
  if kernel == "blocked":
    return blocked_lib.blocked_attention(q_BTHK, k_BSGK, v_BSGK, mask_BHTS, bias_BHTS,
                                         causal=causal, rel_bias_HR=rel_bias_HR,
                                         block_q=block_q, block_k=block_k,
                                         block_heads=block_heads, softcap=softcap,
                                         window=window, sigmoid_bias=sigmoid_bias,
                                         sink_H=sink_H), None
  if kernel == "pallas":
    return pallas_lib.pallas_attention(
        q_BTHK, k_BSGK, v_BSGK, mask_BHTS, bias_BHTS, causal=causal, softcap=softcap,
        kernel=pallas_lib.kernel_for(target.platform, bias_BHTS is not None),
        platform=target.platform), None
  raise ValueError(f"kernel must be one of {IMPLS[1:]}; got {kernel!r}")
