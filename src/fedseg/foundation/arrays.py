"""Pure maths on named tensors (``dict[str, torch.Tensor]``).

``arrays`` is the only payload that crosses a transport: a model's parameters and
buffers, an optimizer's moments, a gradient, a control variate.  Every function
here is pure (no I/O, no global state) and returns new tensors.

Integer tensors (e.g. batch-norm ``num_batches_tracked``) are never averaged as
floats: aggregation functions take them from the first input unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, get_args

import torch

from fedseg.foundation.errors import ConfigError, PayloadError

Arrays = dict[str, torch.Tensor]

__all__ = [
    "AGGREGATIONS",
    "Arrays",
    "add",
    "aggregate",
    "check_aggregation",
    "check_compatible",
    "check_layout",
    "clone",
    "dot",
    "flatten",
    "is_float",
    "layout_of",
    "lerp",
    "nbytes",
    "nonfinite",
    "normalize_weights",
    "prefixed",
    "scale",
    "strip_prefix",
    "sub",
    "weighted_mean",
    "weighted_means",
    "zeros_like",
]


def is_float(t: torch.Tensor) -> bool:
    """True for floating-point (and complex) tensors, the ones that are averaged."""
    return t.is_floating_point() or t.is_complex()


def check_compatible(
    reference: Mapping[str, torch.Tensor], other: Mapping[str, torch.Tensor], what: str = "arrays"
) -> None:
    """Raise :class:`PayloadError` unless ``other`` has the names, shapes and dtypes of ``reference``."""
    missing = sorted(set(reference) - set(other))
    extra = sorted(set(other) - set(reference))
    if missing or extra:
        raise PayloadError(
            f"{what}: names differ from the expected model (missing {missing[:5]}, unexpected {extra[:5]}); "
            "check that every party built the same model configuration"
        )
    for k, ref in reference.items():
        t = other[k]
        if t.shape != ref.shape or t.dtype != ref.dtype:
            raise PayloadError(
                f"{what}: '{k}' has shape {tuple(t.shape)} {t.dtype}, expected {tuple(ref.shape)} {ref.dtype}; "
                "check that every party built the same model configuration"
            )


def normalize_weights(weights: Sequence[float]) -> list[float]:
    """Weights divided by their sum; raises on negative, non-finite or all-zero weights."""
    w = [float(x) for x in weights]
    if not w:
        raise ValueError("no weights given: aggregation needs at least one reply")
    if any(not (x >= 0.0) or x == float("inf") for x in w):
        raise ValueError(f"aggregation weights must be finite and >= 0, got {w}")
    total = sum(w)
    if total <= 0.0:
        raise ValueError(f"aggregation weights sum to {total}; at least one must be positive")
    return [x / total for x in w]


def weighted_mean(items: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float] | None = None) -> Arrays:
    """Σ_k p_k · arrays_k with p normalized to sum to 1 (FedAvg's aggregation).

    Parameters
    ----------
    items
        K arrays with identical names, shapes and dtypes.
    weights
        K non-negative weights (e.g. sample counts n_k); ``None`` gives the uniform mean.
        They are normalized, so ``n_k`` and ``n_k / n`` give the same result.

    Returns
    -------
    Arrays
        Floating tensors are averaged in their own dtype (accumulated in float64 when
        the inputs are float32, then cast back, so the result does not depend on the
        order of the sites beyond float64 rounding); integer tensors come from
        ``items[0]``.
    """
    if not items:
        raise ValueError("weighted_mean of no arrays: aggregation needs at least one reply")
    p = normalize_weights(weights if weights is not None else [1.0] * len(items))
    return weighted_means(items, [(list(range(len(items))), p)])[0]


def weighted_means(
    items: Sequence[Mapping[str, torch.Tensor]], rows: Sequence[tuple[Sequence[int], Sequence[float]]]
) -> list[Arrays]:
    """Several weighted sums of the same K arrays: per row ``(order, p)``, Σ_i p_i · items[order[i]], summed in
    that order (integer tensors from ``items[order[0]]``); :func:`weighted_mean` is one row of normalized
    weights, SoftPull's personalized models K rows.

    The accumulation dtype is float64 for float32 and below.  On a GPU each item's floating tensors are cast
    to it once, not once per row, and each (row, item) term is one ``torch._foreach_add_`` over all tensors:
    K casts per tensor and K² foreach operators instead of 2·K² operators per tensor.  On the CPU the sums go
    tensor by tensor (:func:`_weighted_means_by_tensor`): one accumulator takes all its terms while it is in
    the cache and its ``add_`` casts each float32 tensor as it reads it (exact), instead of K float64 copies of
    every model (less memory traffic; the server's share of a FedAvg round in
    ``benchmarks/engine_overhead.py --profile``).  The arithmetic is a row's
    ``acc = 0; acc += p_i · x_i`` in order, tensor by tensor: bitwise the same both ways on the CPU (its
    foreach is that loop); CUDA's fused foreach kernel computes the same float64 terms, its rounding before
    the cast back at most float64's."""
    if not items:
        raise ValueError("weighted_mean of no arrays: aggregation needs at least one reply")
    first = items[0]
    for other in items[1:]:
        check_compatible(first, other)
    names = [n for n, ref in first.items() if is_float(ref)]
    acc_dtypes = [
        torch.float64 if first[n].dtype in (torch.float16, torch.bfloat16, torch.float32) else first[n].dtype
        for n in names
    ]
    if all(item[n].device.type == "cpu" for item in items for n in names):
        return _weighted_means_by_tensor(items, rows, names, acc_dtypes)
    cast: dict[int, list[torch.Tensor]] = {}
    out = []
    for order, p in rows:
        accs = [torch.zeros(first[n].shape, dtype=d, device=first[n].device) for n, d in zip(names, acc_dtypes)]
        for i, pk in zip(order, p):
            if pk == 0.0:
                continue
            if i not in cast:
                cast[i] = [items[i][n].to(d) for n, d in zip(names, acc_dtypes)]
            if accs:
                torch._foreach_add_(accs, cast[i], alpha=pk)
        summed = dict(zip(names, accs))
        own = items[order[0]]
        out.append(
            {name: (summed[name].to(ref.dtype) if name in summed else own[name].clone()) for name, ref in own.items()}
        )
    return out


def _weighted_means_by_tensor(
    items: Sequence[Mapping[str, torch.Tensor]],
    rows: Sequence[tuple[Sequence[int], Sequence[float]]],
    names: list[str],
    acc_dtypes: list[torch.dtype],
) -> list[Arrays]:
    """:func:`weighted_means` on the CPU, one tensor at a time: each tensor's accumulator takes all its terms
    while it is in the cache, and the add casts each float32 tensor as it reads it (no cast of whole models)."""
    summed: list[dict[str, torch.Tensor]] = [{} for _ in rows]
    for n, d in zip(names, acc_dtypes):
        for r, (order, p) in enumerate(rows):
            acc = torch.zeros(items[0][n].shape, dtype=d)
            for i, pk in zip(order, p):
                if pk != 0.0:
                    acc.add_(items[i][n], alpha=pk)
            summed[r][n] = acc
    out = []
    for (order, _), sums in zip(rows, summed):
        own = items[order[0]]
        out.append(
            {name: (sums[name].to(ref.dtype) if name in sums else own[name].clone()) for name, ref in own.items()}
        )
    return out


Aggregation = Literal["mean", "trimmed_mean", "median"]
"""The aggregation rule of :func:`aggregate` (the ``aggregation`` setting): 'mean' is the papers' FedAvg."""
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
"""Rules of :func:`aggregate`: ``mean`` is the papers' FedAvg; the other two bound one site's influence."""


def check_aggregation(rule: str, trim: float, section: str) -> None:
    """Raise :class:`~fedseg.foundation.errors.ConfigError` naming ``<section>.aggregation`` / ``.trim`` unless they are valid."""
    if rule not in AGGREGATIONS:
        raise ConfigError(
            f"{section}.aggregation = {rule!r}; use one of {list(AGGREGATIONS)} ('mean' is the paper's FedAvg)"
        )
    if not 0.0 <= trim < 0.5:
        raise ConfigError(
            f"{section}.trim = {trim}; it must be in [0, 0.5): the fraction of sites dropped at each end by 'trimmed_mean'"
        )


def aggregate(
    items: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float] | None = None,
    rule: str = "mean",
    trim: float = 0.1,
) -> Arrays:
    """Aggregate K arrays by ``rule``; a drop-in for :func:`weighted_mean` (``rule="mean"`` *is* it, bitwise).

    ``"trimmed_mean"``
        Coordinate-wise: the K values of each element are sorted, the ⌊trim·K⌋
        smallest and ⌊trim·K⌋ largest dropped, and the rest averaged with their
        weights p_k renormalised over the kept ones (Yin et al. 2018 with weights;
        equal weights give the plain trimmed mean).  With ⌊trim·K⌋ = 0 (fewer than
        1/trim sites) nothing is dropped.
    ``"median"``
        Coordinate-wise median of the K values, unweighted (the mean of the two
        middle values when K is even).

    One site can then move an element at most to the range of the honest
    values (median, or trimmed mean while at most ⌊trim·K⌋ sites are hostile),
    however large the numbers it sends.  Integer tensors come from ``items[0]``.
    Computed in float64 and cast back to each tensor's dtype.
    """
    if rule == "mean":
        return weighted_mean(items, weights)
    check_aggregation(rule, trim, "aggregate")
    if not items:
        raise ValueError(f"{rule} of no arrays: aggregation needs at least one reply")
    p = torch.tensor(normalize_weights(weights if weights is not None else [1.0] * len(items)), dtype=torch.float64)
    first = items[0]
    for other in items[1:]:
        check_compatible(first, other)
    k = len(items)
    cut = int(trim * k) if rule == "trimmed_mean" else 0
    out: Arrays = {}
    for name, ref in first.items():
        if not is_float(ref):
            out[name] = ref.clone()
            continue
        vals, order = torch.stack([item[name].to(torch.float64) for item in items]).sort(dim=0)
        if rule == "median":
            mid = vals[(k - 1) // 2] if k % 2 else 0.5 * (vals[k // 2 - 1] + vals[k // 2])
            out[name] = mid.to(ref.dtype)
            continue
        w = p[order][cut : k - cut]
        out[name] = ((vals[cut : k - cut] * w).sum(dim=0) / w.sum(dim=0)).to(ref.dtype)
    return out


def lerp(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], t: float) -> Arrays:
    """(1 − t)·a + t·b for floating tensors; integer tensors from ``a``."""
    check_compatible(a, b)
    return {k: (torch.lerp(v, b[k], t) if is_float(v) else v.clone()) for k, v in a.items()}


def add(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], alpha: float = 1.0) -> Arrays:
    """a + alpha·b (floating tensors; integer tensors from ``a``)."""
    check_compatible(a, b)
    return {k: (v + alpha * b[k] if is_float(v) else v.clone()) for k, v in a.items()}


def sub(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> Arrays:
    """a − b (floating tensors; integer tensors from ``a``)."""
    return add(a, b, alpha=-1.0)


def scale(a: Mapping[str, torch.Tensor], factor: float) -> Arrays:
    """factor·a (floating tensors; integer tensors unchanged)."""
    return {k: (v * factor if is_float(v) else v.clone()) for k, v in a.items()}


def zeros_like(a: Mapping[str, torch.Tensor]) -> Arrays:
    """Zeros with the names, shapes and dtypes of ``a``."""
    return {k: torch.zeros_like(v) for k, v in a.items()}


def clone(a: Mapping[str, torch.Tensor]) -> Arrays:
    """Detached copies of every tensor."""
    return {k: v.detach().clone() for k, v in a.items()}


def dot(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Σ over floating tensors of ⟨a_k, b_k⟩, as a float64 scalar."""
    check_compatible(a, b)
    total = torch.zeros((), dtype=torch.float64)
    for k, v in a.items():
        if is_float(v):
            total = total + (v.double() * b[k].double()).sum()
    return total


def flatten(a: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """All floating tensors concatenated into one 1-D float64 vector, in name order."""
    parts = [a[k].detach().reshape(-1).double() for k in sorted(a) if is_float(a[k])]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def nbytes(a: Mapping[str, torch.Tensor]) -> int:
    """Bytes of tensor data in ``a`` (what a transport carries, headers excluded)."""
    return sum(v.numel() * v.element_size() for v in a.values())


def prefixed(prefix: str, a: Mapping[str, torch.Tensor]) -> Arrays:
    """Names prefixed with ``prefix/`` (to pack several models into one payload)."""
    return {f"{prefix}/{k}": v for k, v in a.items()}


def strip_prefix(prefix: str, a: Mapping[str, torch.Tensor]) -> Arrays:
    """The entries named ``prefix/...``, with the prefix removed."""
    head = prefix + "/"
    return {k[len(head) :]: v for k, v in a.items() if k.startswith(head)}


def nonfinite(a: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of floating tensors that hold a NaN or an infinity (empty when all finite)."""
    return [k for k, v in a.items() if is_float(v) and not bool(torch.isfinite(v).all())]


def layout_of(a: Mapping[str, torch.Tensor]) -> dict[str, list]:
    """``{name: [shape, dtype]}`` (JSON-able) of named tensors, in their order, to check what is loaded later
    against it (and to give it back that order: a file holds its tensors sorted by name)."""
    return {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in a.items()}


def check_layout(a: Mapping[str, torch.Tensor], layout: Mapping[str, Sequence]) -> None:
    """Raise :class:`PayloadError` unless ``a`` has exactly the names, shapes and dtypes of ``layout`` (:func:`layout_of`)."""
    missing, extra = sorted(set(layout) - set(a)), sorted(set(a) - set(layout))
    if missing or extra:
        raise PayloadError(f"names differ (missing {missing[:5]}, unexpected {extra[:5]})")
    for k, (shape, dtype) in layout.items():
        v = a[k]
        if list(v.shape) != list(shape) or str(v.dtype).removeprefix("torch.") != dtype:
            raise PayloadError(
                f"'{k}' has shape {list(v.shape)} {str(v.dtype).removeprefix('torch.')}, expected {list(shape)} {dtype}"
            )
