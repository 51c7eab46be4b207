"""Parameter validation shared by all schemes.

Every check raises at `apply()` time, before the model is touched, with what was expected (the allowed range),
what was found and what to do (peft-style `__post_init__` validation; transformers only warns on most invalid
RoPE values). Bools, strings, NaN and ±inf are refused everywhere; every number has a finite range.

The ranges below are wide enough for every published setting and narrow enough that the numbers computed from
them stay finite and meaningful in fp32 (the dtype in which transformers computes RoPE angles).
"""

from __future__ import annotations

import math
import numbers
import os

import torch

from .registry import did_you_mean

# ---- ranges shared by several schemes ----------------------------------------------------------------------------
# Context extension ratio s = L′/L. The largest published one is LongRoPE's 2048k-from-4k, i.e. 512× (Ding et al.
# 2024); 1024 leaves room for that with 2× headroom. Beyond it the interpolated frequencies θ_i/s of every pair
# sit below anything a position can resolve, and window = s·L overflows for large s (factor=1e308: OverflowError).
FACTOR_RANGE = (1.0, 1024.0)
# RoPE base b: > 1 (b^(−2i/d) must decrease; YaRN divides by ln b); ≤ 1e12, 1e5× above the largest bases in use
# (Llama 3: 5e5, Qwen2.5-1M: 1e7), where θ_i = b^(−2i/d) is still a normal fp32 number for every pair.
THETA_MAX = 1e12
# Token counts (pretraining windows L, T5's max_distance): positions are computed in fp32, which counts integers
# exactly only up to 2^24 = 16,777,216; the longest trained windows today are ~10M (Llama 4 Scout).
POSITIONS_MAX = 1 << 24
# Multiplicative attention temperatures (YaRN/LongRoPE `attention_factor`): cos/sin are scaled by it, so logits by
# its square; [0.1, 10] scales logits by 1/100 … 100 (YaRN's own default at factor 1024 is 0.1·ln 1024 + 1 ≈ 1.69).
# Far below, q·k underflows to 0 and attention silently becomes uniform; far above, logits overflow (1e308: inf).
ATTENTION_FACTOR_RANGE = (0.1, 10.0)
# YaRN's mscale / mscale_all_dim (DeepSeek: 1.0) enter as 0.1·mscale·ln s + 1.
MSCALE_MAX = 10.0
# Thresholds counted in rotations or wavelengths: YaRN beta_fast/beta_slow (32 / 1) and Llama 3.1
# low/high_freq_factor (1 / 4). 1e4 is far beyond any published value; YaRN takes ln(L / (2π·beta)), which a
# huge beta drives to a math domain error (beta_fast=1e308) and a denormal one to ±inf.
ROTATIONS_RANGE = (1e-4, 1e4)
# LongRoPE's per-pair rescale factors λ_i (θ′_i = θ_i / λ_i; Phi-3: 1 … ~60). Symmetric in log space: 1e-4
# keeps 1/λ_i finite in fp32 (a denormal λ_i gives θ′ = inf and NaN logits).
LONGROPE_FACTOR_RANGE = (1e-4, 1e4)
# ALiBi: m_h = 2^(−max_bias·h/n), so the last head's slope is 2^(−max_bias) for any head count n. fp32 (the slopes'
# dtype) leaves its normal range below 2^−126 and rounds to 0 below 2^−149: max_bias ≳ 126 makes the last heads'
# slopes denormal or 0, and max_bias ≳ 149·n zeroes every head (max_bias=1e9 is NoPE). 64 keeps every slope a
# normal fp32/bf16 number with a wide margin; the paper and BLOOM use 8.
ALIBI_MAX_BIAS = 64.0
# T5 buckets: `num_buckets` ≥ 2 (half exact, half log-spaced; 32 in T5); 1024 is 32× T5's.
NUM_BUCKETS_RANGE = (2, 1024)
# Self-Extend group size G (the paper uses 2 … 64) and leaky ReRoPE's k (16 in Su's post); k → ∞ is ReRoPE.
GROUP_SIZE_RANGE = (1, 10_000)
LEAKY_FACTOR_RANGE = (1.0, 1e4)
# Neighbour windows W (Self-Extend, ReRoPE, leaky ReRoPE) in tokens. A W longer than every sequence only means
# "all pairs near" (exact RoPE), so the bound only keeps the numbers integral and finite.
WINDOW_RANGE = (1, 100_000_000)
# learned_absolute: rows of the position table; 4M rows × hidden 4096 in bf16 is 32 GiB. The memory the table
# really needs depends on the model (`check_table_memory`).
TABLE_ROWS_MAX = 1 << 22
# A table may take at most this fraction of the machine's physical memory.
TABLE_MEMORY_FRACTION = 0.5


def _where(scheme: str, key: str) -> str:
    return f"{scheme}: parameter `{key}`"


def _fmt(x) -> str:
    """A bound as a user would type it: 1024, 0.1, 1e+12 (no trailing .0)."""
    if isinstance(x, numbers.Integral):
        return str(int(x))
    return f"{x:g}" if float(x).is_integer() or abs(x) >= 1e-4 else repr(x)


def _shown(value) -> str:
    """The found value for a message; absurdly long reprs (10**400, long lists) are cut."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}…({len(text)} characters)"


def describe_range(*, gt=None, ge=None, lt=None, le=None) -> str:
    """'in [1, 1024]', 'in (0, 10]', '>= 1', 'real' for the given bounds."""
    low = f"({_fmt(gt)}" if gt is not None else f"[{_fmt(ge)}" if ge is not None else None
    high = f"{_fmt(lt)})" if lt is not None else f"{_fmt(le)}]" if le is not None else None
    if low and high:
        return f"in {low}, {high}"
    if low:
        return f"{'>' if gt is not None else '>='} {low[1:]}"
    if high:
        return f"{'<' if lt is not None else '<='} {high[:-1]}"
    return "real"


def _in_range(value, gt, ge, lt, le) -> bool:
    return ((gt is None or value > gt) and (ge is None or value >= ge)
            and (lt is None or value < lt) and (le is None or value <= le))


def _tail(hint: str, expected: str) -> str:
    return hint or (f"Pass a value {expected}." if expected != "real" else "Pass a finite number.")


def number(scheme: str, key: str, value, *, gt=None, ge=None, lt=None, le=None, hint: str = "") -> float:
    """A finite real number (bools, strings, NaN, ±inf rejected) within the given bounds, returned as float.

    `hint` says what to do (what the parameter means, what is usual); without one the message says to pass a value
    in the range. Messages: '<scheme>: parameter `<key>` must be a finite number in [lo, hi], got <value>. <hint>'."""
    expected = describe_range(gt=gt, ge=ge, lt=lt, le=le)
    span = f" {expected}" if expected != "real" else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{_where(scheme, key)} must be a number{span}, "
                        f"got {type(value).__name__} {_shown(value)}. {_tail(hint, expected)}")
    try:
        as_float = float(value)
    except OverflowError:  # an int beyond the float range (10**400)
        as_float = math.inf if value > 0 else -math.inf
    if not math.isfinite(as_float) or not _in_range(as_float, gt, ge, lt, le):
        raise ValueError(f"{_where(scheme, key)} must be a finite number{span}, "
                         f"got {_shown(value)}. {_tail(hint, expected)}")
    return as_float


def integer(scheme: str, key: str, value, *, ge=None, le=None, hint: str = "") -> int:
    """An int (bools, strings, NaN, ±inf and non-integral floats rejected) in [ge, le]; integral floats (4096.0,
    1e4) are accepted as ints."""
    expected = describe_range(ge=ge, le=le)
    what = f"an integer {expected}" if expected != "real" else "an integer"
    given = value
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{_where(scheme, key)} must be {what}, "
                        f"got {type(given).__name__} {_shown(given)}. {_tail(hint, expected)}")
    value = int(value)
    if not _in_range(value, None, ge, None, le):
        raise ValueError(f"{_where(scheme, key)} must be {what}, got {_shown(given)}. {_tail(hint, expected)}")
    return value


def boolean(scheme: str, key: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{_where(scheme, key)} must be True or False, got {type(value).__name__} {_shown(value)}.")
    return value


def number_list(scheme: str, key: str, value, *, gt=None, ge=None, lt=None, le=None,
                hint: str = "") -> tuple[float, ...]:
    """A non-empty sequence of numbers, each checked by `number` (message key `key[i]`), returned as a tuple
    (hashable, so schemes stay frozen)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{_where(scheme, key)} must be a list of numbers, got {type(value).__name__} {_shown(value)}.")
    items = list(value.tolist() if hasattr(value, "tolist") else value)
    if not items:
        raise ValueError(f"{_where(scheme, key)} must not be empty.")
    return tuple(number(scheme, f"{key}[{i}]", v, gt=gt, ge=ge, lt=lt, le=le, hint=hint) for i, v in enumerate(items))


def name_list(scheme: str, key: str, value, *, hint: str = "") -> tuple[str, ...]:
    """A non-empty list of names (a str is one name, or several joined by '/' as in a spec: `key=a/b`), as a tuple
    without repeats, in the order given (hashable, so schemes stay frozen)."""
    items = value.split("/") if isinstance(value, str) else value
    if isinstance(items, bytes) or not isinstance(items, (list, tuple)):
        raise TypeError(f"{_where(scheme, key)} must be a name or a list of names, got {type(value).__name__} "
                        f"{_shown(value)}.{' ' + hint if hint else ''}")
    if not items:
        raise ValueError(f"{_where(scheme, key)} must name at least one, got an empty list."
                         f"{' ' + hint if hint else ''}")
    for i, item in enumerate(items):
        if not isinstance(item, str) or not item.strip():
            raise TypeError(f"{_where(scheme, key)}[{i}] must be a non-empty name (str), got {type(item).__name__} "
                            f"{_shown(item)}.{' ' + hint if hint else ''}")
    return tuple(dict.fromkeys(item.strip() for item in items))


def rope_theta(scheme: str, value, key: str = "rope_theta") -> float:
    """A RoPE / sinusoid base b in (1, THETA_MAX]."""
    return number(scheme, key, value, gt=1.0, le=THETA_MAX,
                  hint="It is the base b of θ_i = b^(−2i/d) (Llama 2: 1e4, Llama 3: 5e5, Code Llama: 1e6), which must "
                       "exceed 1 for the frequencies to fall with i.")


def choice(scheme: str, key: str, value, options) -> str:
    if value not in options:
        raise ValueError(
            f"{_where(scheme, key)} must be one of {', '.join(map(repr, options))}, got {_shown(value)}."
            f"{did_you_mean(value, options)}"
        )
    return value


# ---- checks that need the model (called from a scheme's resolve / build, still before the model is touched) -------
def physical_memory() -> int | None:
    """Bytes of physical memory of this machine, or None where it cannot be told."""
    try:
        import psutil  # psutil: optional (not a dependency); os.sysconf below where it is missing

        return int(psutil.virtual_memory().total)
    except (ImportError, AttributeError, OSError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def check_table_memory(scheme: str, key: str, rows: int, cols: int, dtype) -> int:
    """Refuse, before allocating it, a rows × cols table of `dtype` (a torch dtype) larger than
    TABLE_MEMORY_FRACTION of this machine's physical memory. Returns the estimate in bytes."""
    itemsize = getattr(dtype, "itemsize", None)
    if itemsize is None:
        itemsize = torch.empty((), dtype=dtype).element_size()
    need = int(rows) * int(cols) * int(itemsize)
    total = physical_memory()
    if total is not None and need > TABLE_MEMORY_FRACTION * total:
        gib = 2**30
        limit_rows = max(1, int(TABLE_MEMORY_FRACTION * total) // (int(cols) * int(itemsize)))
        raise ValueError(
            f"{_where(scheme, key)}={rows} needs a {rows} × {cols} table in {str(dtype).removeprefix('torch.')} of "
            f"about {need / gib:.1f} GiB, more than {TABLE_MEMORY_FRACTION:.0%} of this machine's "
            f"{total / gib:.1f} GiB of physical memory (the allowed size here: {key} <= {limit_rows}). Pass a smaller "
            f"{key} (the longest sequence the table must cover), or load the model in a smaller dtype."
        )
    return need
