"""Evaluation: which samples each device evaluates, and how per-batch sums add up (pure).

The evaluation set is cut into fixed *chunks* of `batch` consecutive samples
(the last one may be shorter). A chunk is the unit of evaluation, as a VW is
the unit of training: it is always evaluated as one batch, loaded under its own
data seed, whichever device runs it, so its metric sums do not depend on the
device set. The devices of a generation split the chunks into contiguous runs
in proportion to their shares (the VW assignment of the next step, which
follows their measured speeds): device i gets chunks
`[C * S_i // S, C * S_{i+1} // S)` where `S_i` is the sum of the shares before
it and `C` the chunk count. Every chunk, and so every sample, is evaluated by
exactly one device; a device may get none when there are fewer chunks than
devices.

The sums of every device are added in one all-reduce of a float64 vector in
sorted-key order (`metric_vector` / `metrics_of`). Counts stay exact (float64
holds integers below 2**53); float metrics agree with a single-process
evaluation up to the order of float64 additions.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Sequence

from flexpar.core import batching

# A domain tag for the evaluation's data-loading seeds, apart from training's streams.
_EVAL_STREAM = 3


def chunk_count(size: int, batch: int) -> int:
    """How many chunks of `batch` samples cover `size` samples (the last may be short)."""
    _check_size(size, batch)
    return -(-size // batch)


def split_chunks(chunks: int, shares: Sequence[int]) -> list:
    """Per device, the `range` of chunk ids it evaluates: contiguous, in rank order, covering all.

    Device i gets `chunks * S_i // S` up to `chunks * S_{i+1} // S` (S_i: the
    sum of the shares of the devices before it, S: of all), so its count is
    within one of its proportional share `chunks * share_i / S`.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 0:
        raise ValueError(f"chunks={chunks!r} must be a whole number >= 0")
    shares = list(shares)
    if not shares:
        raise ValueError("shares is empty: an evaluation needs at least one device")
    for index, share in enumerate(shares):
        if isinstance(share, bool) or not isinstance(share, int) or share < 1:
            raise ValueError(f"shares[{index}]={share!r} must be a whole number >= 1")
    total = sum(shares)
    bounds = [0]
    prefix = 0
    for share in shares:
        prefix += share
        bounds.append(chunks * prefix // total)
    return [range(low, high) for low, high in zip(bounds, bounds[1:])]


def sample_ranges(size: int, shares: Sequence[int], batch: int) -> list:
    """Per device, the `range` of sample indices it evaluates (chunk-aligned; see the module doc)."""
    return [
        range(min(size, part.start * batch), min(size, part.stop * batch))
        for part in split_chunks(chunk_count(size, batch), shares)
    ]


def batches_of(samples: range, batch: int) -> list:
    """The chunks (as index ranges) of a device's chunk-aligned sample range, in order."""
    return [range(start, min(start + batch, samples.stop)) for start in range(samples.start, samples.stop, batch)]


def chunk_seed(seed: int, first_sample: int) -> int:
    """The data seed a chunk is loaded under (augmentation in an evaluation set is unusual, but
    the same chunk then sees the same random stream on any device)."""
    return batching._derive_seed(_EVAL_STREAM, seed, first_sample)


def _check_size(size: int, batch: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"the evaluation set has {size!r} samples; it needs at least one")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"eval_batch={batch!r} must be a positive whole number")


# ------------------------------------------------------------------ metrics


class MetricsError(ValueError):
    """`evaluate(model, batch)` returned something that is not a dict of summed numbers."""


def as_numbers(value: Any, keys: Sequence[str] = ()) -> dict:
    """`evaluate`'s result as {key: float}, checked: a non-empty dict of str -> number or scalar tensor.

    With `keys` (the sorted keys found by the driver's check), the result must
    have exactly those keys: every device adds the same vector.
    """
    if not isinstance(value, Mapping) or not value:
        raise MetricsError(
            "evaluate(model, batch) must return a non-empty dict of summed metrics, e.g. "
            f"{{'loss_sum': ..., 'correct': ..., 'count': ...}}; it returned {_describe(value)}"
        )
    numbers_of = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key:
            raise MetricsError(f"evaluate(model, batch) returned the key {key!r}; metric names must be strings")
        numbers_of[key] = _number(key, item)
    if keys and sorted(numbers_of) != list(keys):
        raise MetricsError(
            f"evaluate(model, batch) returned the keys {sorted(numbers_of)}, but the first batch gave "
            f"{list(keys)}: every batch must return the same metrics"
        )
    return numbers_of


def _number(key: str, item: Any) -> float:
    if hasattr(item, "detach") and hasattr(item, "numel"):  # a torch tensor
        if item.numel() != 1:
            raise MetricsError(
                f"evaluate(model, batch) returned {key!r} with shape {tuple(item.shape)}; each metric must be "
                "one number (a sum over the batch): reduce it, e.g. with .sum()"
            )
        return float(item.detach().reshape(()).item())
    if isinstance(item, bool) or not isinstance(item, numbers.Real):
        raise MetricsError(f"evaluate(model, batch) returned {key!r} = {_describe(item)}; each metric must be a number")
    return float(item)


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}"


def metric_vector(sums: Mapping[str, float], keys: Sequence[str]) -> list:
    """The sums in `keys` order (missing keys count 0: a device that evaluated no chunk)."""
    return [float(sums.get(key, 0.0)) for key in keys]


def metrics_of(vector: Sequence[float], keys: Sequence[str]) -> dict:
    """The summed vector back as {key: value}, integers as ints (counts read as counts)."""
    result = {}
    for key, value in zip(keys, vector):
        value = float(value)
        result[key] = int(value) if value.is_integer() and abs(value) < 2**53 else value
    return result


def means(metrics: Mapping[str, float]) -> dict:
    """Per-sample means of summed metrics, when they hold a `count`: `loss_sum` -> `loss`, `correct` -> `correct`.

    {"loss_sum": 12.0, "correct": 30, "count": 40} -> {"loss": 0.3, "correct": 0.75}.
    Empty without a positive `count`.
    """
    count = metrics.get("count")
    if not isinstance(count, (int, float)) or isinstance(count, bool) or not count > 0:
        return {}
    result = {}
    for key, value in metrics.items():
        if key == "count":
            continue
        name = key[: -len("_sum")] if key.endswith("_sum") and len(key) > len("_sum") else key
        result[name] = value / count if math.isfinite(value) else value
    return result
