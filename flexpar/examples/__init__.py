"""Packaged demos: real training on data that ships with a package.

- `flexpar.examples.digits`: a small CNN on scikit-learn's 8x8 handwritten
  digits (needs scikit-learn: ``pip install -e ".[examples]"``).
- `flexpar.examples.tiny_lm`: a byte-level causal transformer on the Python
  standard library's own source files (needs nothing beyond torch).
- `flexpar.examples.tiny_lm_variable`: the same model on variable-length samples
  (standard-library paragraphs, each at its own length), balanced by token count
  with `Job(sample_cost=...)`; the data of `benchmarks/balance.py`'s
  variable-length round.
- `flexpar.examples.hf_gpt`: a small Hugging Face GPT-2 (built from a config,
  not downloaded) on the same text, with bf16, clipping and a token-weighted
  loss (needs transformers: ``pip install -e ".[hf]"``).

Each module defines its pieces (model factory, optimizer factory, loss,
dataset) at module level, so worker processes can import them by name, plus
`build_job()` and `main(argv)`. The submodules are not imported here, so that
importing one demo never pulls in the other's dependencies.
"""

__all__ = ["digits", "tiny_lm", "tiny_lm_variable", "hf_gpt"]
