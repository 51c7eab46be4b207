"""LongRoPE's evolutionary search of per-pair rescale factors (Ding et al. 2024, arXiv:2402.13753, §3.2 and
Algorithm 1; the authors' code is microsoft/LongRoPE, evolution/algorithms/dim_mono.py; this is written anew).

An individual is one rescale factor λ_i per rotary pair i (θ′_i = θ_i / λ_i, transformers' `longrope` long
factors), on a grid of `step` (0.01 as in the paper and the authors' code) between 1 and `max_factor` (default
1.25·s, the paper's search space; the authors' code stops at 1 + s). Every individual satisfies the monotonicity
constraint λ_i ≤ λ_{i+1}: the lower the frequency, the more it is interpolated.

Algorithm 1, as done here:
- generation 0: the factors of PI (λ_i = s), NTK-aware (λ_i = s^(2i/(d−2))) and YaRN (λ_i = θ_i/θ′_i of the model's
  own yarn ×s) on the grid, and mutations of them (round robin) up to `population`;
- each later generation: the `parents` best of the population so far (elitist) produce `mutations` mutants of
  random parents and `crossovers` children of random parent pairs (a failed crossover mutates the first parent, as
  the authors do); the next population is the parents plus the children.
- mutation (the authors' operator): each factor, with probability `mutation_rate`, is redrawn uniformly from the
  grid points between its neighbours' current values, so the constraint holds by construction;
- crossover (two-point): the child takes parent A's factors outside a random span and parent B's inside; it is kept
  only if it satisfies the constraint, otherwise another span is tried (`max_tries`).
No individual is evaluated twice.

Not searched: the initial-token count n̂ of the paper (positions < n̂ left unscaled) is 0, since transformers'
`longrope` cannot express it; and the short factors stay 1 (vanilla frequencies inside the window; for a target
beyond the window only the long factors are used). transformers' attention factor √(1 + ln s / ln L) applies to both
sets, as in Phi-3, and is kept.

Genes are integers k_i (λ_i = 1 + k_i·step), so equality and the constraint are exact.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Sequence

from ..analysis.frequencies import frequencies
from ..discovery import find_target
from .log import SearchLog, StopSearch

Genes = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class EvolutionSettings:
    population: int = 24
    generations: int = 10
    parents: int | None = None  # default population // 2 (the authors: 32 of 64)
    mutations: int | None = None  # default (population - parents) // 2 (the authors: 16)
    crossovers: int | None = None  # default the rest of population - parents (the authors: 16)
    step: float = 0.01
    max_factor: float | None = None  # default 1.25 × scale
    mutation_rate: float = 0.3
    max_tries: int = 20

    def resolved(self, scale: float) -> EvolutionSettings:
        parents = self.parents if self.parents is not None else max(2, self.population // 2)
        mutations = self.mutations if self.mutations is not None else max(1, (self.population - parents) // 2)
        crossovers = self.crossovers if self.crossovers is not None else max(0, self.population - parents - mutations)
        out = dataclasses.replace(self, parents=parents, mutations=mutations, crossovers=crossovers,
                                  max_factor=self.max_factor if self.max_factor is not None else round(1.25 * scale, 6))
        out.check()
        return out

    def check(self) -> None:
        if self.population < 2:
            raise ValueError(f"--population must be >= 2, got {self.population}.")
        if self.generations < 0:
            raise ValueError(f"--generations must be >= 0, got {self.generations}.")
        if not 2 <= self.parents <= self.population:
            raise ValueError(f"--parents must be between 2 and the population ({self.population}), got {self.parents}.")
        if self.mutations < 0 or self.crossovers < 0 or self.mutations + self.crossovers < 1:
            raise ValueError("a generation needs at least one mutation or crossover.")
        if not 0 < self.step <= 1:
            raise ValueError(f"the factor grid step must be in (0, 1], got {self.step}.")
        if self.max_factor is None or self.max_factor < 1:
            raise ValueError(f"the largest rescale factor must be >= 1, got {self.max_factor}.")
        if not 0 < self.mutation_rate <= 1:
            raise ValueError(f"the mutation rate must be in (0, 1], got {self.mutation_rate}.")

    def planned_evaluations(self) -> int:
        return self.population + self.generations * (self.mutations + self.crossovers)


# ---- the representation ----------------------------------------------------------------------------------------
def to_genes(factors: Sequence[float], step: float, top: int) -> Genes:
    """Factors -> grid indices, clipped to [0, top] and made non-decreasing (a running maximum)."""
    out, low = [], 0
    for f in factors:
        k = min(top, max(0, round((float(f) - 1.0) / step)))
        low = max(low, k)
        out.append(low)
    return tuple(out)


def to_factors(genes: Genes, step: float) -> list[float]:
    return [round(1.0 + k * step, 6) for k in genes]


def monotone(genes: Sequence[int]) -> bool:
    return all(a <= b for a, b in zip(genes, genes[1:], strict=False))


# ---- the operators ---------------------------------------------------------------------------------------------
def mutate(rng: random.Random, genes: Genes, top: int, rate: float = 0.3, seen: set | frozenset = frozenset(),
           max_tries: int = 20) -> Genes | None:
    """Each gene with probability `rate` redrawn uniformly between its neighbours (the left one already mutated,
    the right one not yet), bounds 0 and `top` at the ends; a child not in `seen` and unlike `genes`, or None."""
    n = len(genes)
    for _ in range(max_tries):
        g = list(genes)
        for i in range(n):
            if rng.random() < rate:
                g[i] = rng.randint(g[i - 1] if i else 0, g[i + 1] if i < n - 1 else top)
        child = tuple(g)
        if child != genes and child not in seen:
            return child
    return None


def crossover(rng: random.Random, a: Genes, b: Genes, seen: set | frozenset = frozenset(),
              max_tries: int = 20) -> Genes | None:
    """Two-point crossover: A outside [i, j), B inside; the first child that is monotone, new and unlike both
    parents, or None."""
    n = len(a)
    if a == b:
        return None
    for _ in range(max_tries):
        i, j = sorted(rng.sample(range(n + 1), 2))
        child = a[:i] + b[i:j] + a[j:]
        if child not in (a, b) and child not in seen and monotone(child):
            return child
    return None


# ---- the search ------------------------------------------------------------------------------------------------
def evolve(log: SearchLog, objective: Callable[[list[float]], dict], initial: dict[str, Sequence[float]],
           settings: EvolutionSettings, scale: float, *, seed: int = 0,
           spec: Callable[[list[float]], str] = lambda f: "/".join(map(str, f))) -> str | None:
    """Run Algorithm 1 through `log` (which evaluates, replays and stops); returns None when every generation ran,
    else the reason the budget stopped it. `objective(factors)` returns the record fields ({"objective", ...});
    `initial` maps an origin name ("linear" (PI), "ntk", "yarn") to its factors."""
    s = settings.resolved(scale)
    top = round((s.max_factor - 1.0) / s.step)
    rng = random.Random(seed)
    seen: set[Genes] = set()
    scored: list[tuple[float, int, Genes]] = []  # (objective, evaluation order, genes) of the population so far

    def evaluate(genes: Genes, generation: int, origin: str) -> tuple[float, int, Genes]:
        seen.add(genes)
        factors = to_factors(genes, s.step)
        value = log.evaluate({"long_factor": factors}, spec(factors), lambda: objective(factors),
                             generation=generation, origin=origin)
        return value, len(log.evaluations) - 1, genes

    try:
        starts = []
        for name, factors in initial.items():
            genes = to_genes(factors, s.step, top)
            if genes not in seen:
                starts.append((name, genes))
                scored.append(evaluate(genes, 0, f"init:{name}"))
        k = 0
        while len(scored) < s.population:
            name, genes = starts[k % len(starts)]
            child = mutate(rng, genes, top, s.mutation_rate, seen, s.max_tries)
            k += 1
            if child is None:
                if k > s.population * s.max_tries:
                    break  # the grid is too small to fill a population
                continue
            scored.append(evaluate(child, 0, f"mutation of init:{name}"))
        population = scored
        for generation in range(1, s.generations + 1):
            parents = sorted(population)[: s.parents]
            children = []
            for _ in range(s.mutations):
                parent = rng.choice(parents)[2]
                child = mutate(rng, parent, top, s.mutation_rate, seen, s.max_tries)
                if child is not None:
                    children.append(evaluate(child, generation, "mutation"))
            for _ in range(s.crossovers):
                (_, _, a), (_, _, b) = sorted(rng.sample(parents, 2))
                child, origin = crossover(rng, a, b, seen, s.max_tries), "crossover"
                if child is None:
                    child, origin = mutate(rng, a, top, s.mutation_rate, seen, s.max_tries), "mutation"
                if child is not None:
                    children.append(evaluate(child, generation, origin))
            population = parents + children
    except StopSearch as stop:
        return stop.reason
    return None


def initial_factors(model, scale: float, specs: Sequence[str] | None = None, *,
                    seq_len: int | None = None) -> dict[str, list[float]]:
    """λ_i of PI, NTK-aware and YaRN ×`scale` on this model (or of the frequency scheme `specs` given, keyed by
    spec): θ_i / θ′_i, the frequencies the model's rotary holds when patched with each scheme (rope_patch.analysis:
    transformers' own init functions, so YaRN's ramp is the one for this head size, base and window). A rotary with
    RoPE per layer type (Gemma 3's sliding / full attention bases) gives one seed per layer type where they differ,
    keyed "SPEC (LAYER_TYPE layers)"; a sin/cos-table rotary (GPT-J) is read the same way. A length-dependent spec
    (dynamic) is read at `seq_len` (the target: the long factors serve it); a spec that stops some pairs rotating
    (p_rope: θ′_i = 0, no finite factor) is refused with a ValueError."""
    layer_types = list(find_target(model).contexts())
    out: dict[str, list[float]] = {}
    for spec in specs if specs is not None else [f"{name}:{scale:g}" for name in ("linear", "ntk", "yarn")]:
        key = spec.split(":")[0] if specs is None else spec
        seeds = {lt: frequencies(spec, model=model, layer_type=lt, seq_len=seq_len).interpolation.tolist()
                 for lt in layer_types}
        for lt, f in seeds.items():
            if not all(math.isfinite(x) for x in f):
                where = f" on the {lt} layers" if lt else ""
                raise ValueError(f"--init {spec!r} stops {sum(not math.isfinite(x) for x in f)} of {len(f)} pairs "
                                 f"rotating{where} (θ′ = 0): no LongRoPE rescale factor expresses that. Seed with "
                                 "schemes that keep every pair rotating (linear, ntk, yarn, llama3, ...).")
        first = next(iter(seeds.values()))  # equal up to float32 rounding: one seed (to_genes rounds to the grid)
        if all(max(abs(a / b - 1) for a, b in zip(f, first, strict=True)) < 1e-6 for f in seeds.values()):
            out[key] = first
        else:
            out.update({f"{key} ({lt} layers)": f for lt, f in seeds.items()})
    return out
