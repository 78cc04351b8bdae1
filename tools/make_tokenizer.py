"""Write ``examples/data/tokenizer.json``: a byte-level BPE tokenizer (vocabulary 512) trained on the
repository's README with the Hugging Face ``tokenizers`` package, for ``examples/train.py --tokenizer``.

    python tools/make_tokenizer.py            # needs `pip install tokenizers`
"""

from __future__ import annotations

import logging
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[1]
#: Vocabulary size: small enough that the example's small models train on a few thousand tokens per step.
VOCAB_SIZE = 512


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([str(ROOT / "README.md")], trainer)
    out = ROOT / "examples" / "data" / "tokenizer.json"
    tok.save(str(out))
    n = len(tok.encode((ROOT / "README.md").read_text(encoding="utf-8")).ids)
    logging.info("wrote %s: vocabulary %d, README.md is %d tokens", out, tok.get_vocab_size(), n)


if __name__ == "__main__":
    main()
