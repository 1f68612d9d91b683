"""Tokenizers built with `tokenizers`: from a GGUF file's vocabulary and merges, or from an
HF tokenizer.json. Either way the workdir holds one tokenizer.json."""

from __future__ import annotations

from mha_jax.errors import UserError

# tokenizer.ggml.pre -> digit handling before the byte-level split (llama.cpp's
# pre-tokenizer families for byte-level BPE).
_DIGITS_ONE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
               "minerva")
_PLAIN_GPT2 = ("gpt2", "default", "mpt", "olmo", "jais", "gpt-2")
# LLaMA 3 / tiktoken-style split (numbers in groups of up to three).
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                   r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GGUF token types
CONTROL, USER_DEFINED = 3, 4


def _built(build, where: str):
  """build(), the errors of `tokenizers` on a vocabulary it cannot take (a duplicate
  token, a merge of unknown tokens, ...; Rust panics included) as one UserError."""
  try:
    return build()
  except UserError:
    raise
  except (KeyboardInterrupt, SystemExit, MemoryError):
    raise
  except BaseException as e:  # noqa: BLE001 - pyo3's PanicException is a BaseException
    raise UserError(f"{where}: the tokenizer cannot be built from tokenizer.ggml.*: "
                     f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from None


def from_gguf_vocab(tokens, merges, token_types, pre: str, where: str):
  """A byte-level BPE `tokenizers.Tokenizer` from GGUF metadata (tokenizer.ggml.*)."""
  return _built(lambda: _from_gguf_vocab(tokens, merges, token_types, pre, where), where)


def _from_gguf_vocab(tokens, merges, token_types, pre: str, where: str):
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
  vocab = {t: i for i, t in enumerate(tokens)}
  pairs = []
  for m in merges:
    a, sep, b = m.partition(" ")
    if not sep:
      raise UserError(f"{where}: tokenizer.ggml.merges entry {m!r} is not 'a b'")
    pairs.append((a, b))
  tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre in _DIGITS_ONE:
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level])
  elif pre in _PLAIN_GPT2:
    tok.pre_tokenizer = byte_level
  elif pre in ("llama-bpe", "llama3"):
    from tokenizers import Regex
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  else:
    raise UserError(f"{where}: tokenizer.ggml.pre={pre!r} is not supported; supported: "
                     f"{sorted(_DIGITS_ONE + _PLAIN_GPT2 + ('llama-bpe',))}")
  tok.decoder = decoders.ByteLevel()
  types = list(token_types) if token_types is not None else [1] * len(tokens)
  special = [AddedToken(t, special=True, normalized=False)
             for t, ty in zip(tokens, types) if ty == CONTROL]
  user = [AddedToken(t, special=False, normalized=False)
          for t, ty in zip(tokens, types) if ty == USER_DEFINED]
  tok.add_special_tokens(special)
  if user:
    tok.add_tokens(user)
  return tok


def sentencepiece_merges(tokens, order) -> list[tuple[str, str]]:
  """BPE merges implied by a SentencePiece vocabulary: every split of a token into two
  tokens, best (highest `order`) first; ties by the pieces' lengths, then ids (the rule
  of transformers' generate_merges, which its GGUF reader uses)."""
  vocab = {t: i for i, t in enumerate(tokens)}
  merges = []
  for merge, score in zip(tokens, order):
    local = []
    for i in range(1, len(merge)):
      a, b = merge[:i], merge[i:]
      if a in vocab and b in vocab:
        local.append((a, b, score))
    local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
    merges.extend(local)
  merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
  return [(a, b) for a, b, _ in merges]


def from_gguf_gemma(tokens, token_types, where: str):
  """Gemma's SentencePiece BPE as a `tokenizers.Tokenizer` (_from_gguf_gemma)."""
  return _built(lambda: _from_gguf_gemma(tokens, token_types, where), where)


def _from_gguf_gemma(tokens, token_types, where: str):
  """Gemma's SentencePiece BPE (tokenizer.ggml.model 'llama' in a Gemma GGUF) as a
  `tokenizers.Tokenizer`: spaces become U+2581, byte fallback, no prefix space. The file
  has no merges: they are rebuilt from the vocabulary, in the order the tokens appear
  (Gemma's scores do not follow its merge order). Tokens of two or more spaces, stored as
  real spaces, are spelled with U+2581 like the rest."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
  tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
  if len(set(tokens)) != len(tokens):
    raise UserError(f"{where}: tokenizer.ggml.tokens lists a token twice")
  vocab = {t: i for i, t in enumerate(tokens)}
  merges = sentencepiece_merges(tokens, [-i for i in range(len(tokens))])
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token="<unk>",
                             byte_fallback=True))
  tok.normalizer = normalizers.Replace(" ", "\u2581")
  tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous",
                                           invert=False)
  tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                   decoders.Fuse()])
  types = list(token_types) if token_types is not None else [1] * len(tokens)
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, ty in zip(tokens, types) if ty == CONTROL])
  user = [AddedToken(t, special=False, normalized=False)
          for t, ty in zip(tokens, types) if ty == USER_DEFINED]
  if user:
    tok.add_tokens(user)
  return tok
