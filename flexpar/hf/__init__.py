"""flexpar.hf: a transformers.Trainer script trained by flexpar with one import changed.

    from flexpar.hf import Trainer      # was: from transformers import Trainer

See docs/guide.md, "From a Hugging Face Trainer script". transformers (and
peft for peft models) are the `flexpar[hf]` extra.
"""

from flexpar.hf.trainer import Trainer

__all__ = ["Trainer"]
