"""The generated corpus of the GPT examples: documents, character tokens, packed batches.

Short documents of a tiny English-like grammar, arithmetic facts and counting
drills, tokenized by character (ids 1..len(CHARS); 0 pads), and packed into
fixed-length rows with ``te_jax.packing``. No downloads; deterministic in the
seed.
"""

from __future__ import annotations

import numpy as np

from te_jax import packing


PAD_ID = 0
CHARS = "\n !',-.:;=?+0123456789abcdefghijklmnopqrstuvwxyz"
VOCAB_SIZE = 64                                  # ids 1..len(CHARS); rounded up
assert len(CHARS) < VOCAB_SIZE
_CHAR_TO_ID = {c: i + 1 for i, c in enumerate(CHARS)}

_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the little bird",
             "a robot", "the teacher", "our king", "the farmer", "a fox",
             "the girl", "his brother", "the baker", "a sailor"]
_VERBS = ["sees", "likes", "finds", "carries", "paints", "follows", "hears",
          "watches", "draws", "wants"]
_OBJECTS = ["a red ball", "the green door", "an apple", "the small boat",
            "a blue kite", "the tall tree", "some bread", "the yellow house",
            "a silver key", "the quiet river"]
_PLACES = ["in the garden", "near the sea", "at the market", "on the hill",
           "under the bridge", "by the window", "in the forest", "at night"]
_ENDINGS = ["and smiles", "and runs home", "but says nothing", "and sings",
            "and waits", "then sleeps"]


def encode(text: str) -> np.ndarray:
  """Character ids (1..len(CHARS)) of ``text``; unknown characters are dropped."""
  return np.array([_CHAR_TO_ID[c] for c in text if c in _CHAR_TO_ID], np.int32)


def decode(ids) -> str:
  return "".join(CHARS[i - 1] for i in np.asarray(ids).tolist() if 0 < i <= len(CHARS))


def _sentence(rng) -> str:
  s = (f"{_SUBJECTS[rng.integers(len(_SUBJECTS))]} {_VERBS[rng.integers(len(_VERBS))]} "
       f"{_OBJECTS[rng.integers(len(_OBJECTS))]} {_PLACES[rng.integers(len(_PLACES))]}")
  if rng.random() < 0.4:
    s += " " + _ENDINGS[rng.integers(len(_ENDINGS))]
  return s + "."


def make_document(rng) -> str:
  """One document: a story, arithmetic facts, or a counting drill."""
  kind = rng.random()
  if kind < 0.6:
    return " ".join(_sentence(rng) for _ in range(rng.integers(1, 7))) + "\n"
  if kind < 0.85:
    facts = []
    for _ in range(rng.integers(2, 9)):
      a, b = rng.integers(0, 50, size=2)
      facts.append(f"{a}+{b}={a + b}.")
    return " ".join(facts) + "\n"
  start, step = int(rng.integers(0, 60)), int(rng.integers(1, 4))
  n = int(rng.integers(5, 20))
  return "count: " + " ".join(str(start + i * step) for i in range(n)) + ".\n"


def make_corpus(num_docs: int, seed: int = 0) -> list[np.ndarray]:
  """``num_docs`` tokenized documents, deterministic in ``seed``."""
  rng = np.random.default_rng(seed)
  return [encode(make_document(rng)) for _ in range(num_docs)]


def make_batch(docs: list[np.ndarray], step: int, rows: int, seq_len: int, *,
               seed: int = 0, block: int = 128, num_shards: int = 1):
  """The packed batch of ``step``: a pure function of (docs, step, seed).

  Draws documents in a step-seeded random order until the rows are about
  full, packs them (first-fit-decreasing) into exactly ``rows`` rows, and pads
  rows so each of ``num_shards`` batch shards holds a multiple of ``block``
  tokens. Returns numpy ``tokens, segment_ids, positions`` of shape
  ``(rows', seq_len)``.
  """
  rng = np.random.default_rng([seed, step])
  order = rng.permutation(len(docs))
  budget = rows * seq_len
  chosen, total = [], 0
  for i in order:
    n = min(len(docs[i]), seq_len)
    if total + n > budget:
      break
    chosen.append(docs[i][:seq_len])
    total += n
  while True:
    try:
      t, s, p = packing.pack_sequences(chosen, seq_len, num_rows=rows)
      break
    except ValueError:                       # fragmentation: one doc fewer
      chosen.pop()
  return packing.pad_batch(t, s, p, block=block, num_shards=num_shards)
