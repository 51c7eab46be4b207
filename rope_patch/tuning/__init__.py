"""Search a scheme's parameters for a model at a target length (`rope-patch tune`): grid / random search of the
scalar schemes, LongRoPE's evolutionary search of per-pair rescale factors; every evaluation logged, resumable.

    search.py     tune / accept: the driver and the acceptance evaluation
    evolution.py  LongRoPE's Algorithm 1 (population, mutation, crossover under λ_i ≤ λ_{i+1})
    scalar.py     grid and random search spaces
    objective.py  the held-out split (tuning / acceptance) and the objective
    dpe.py        DPE's per-group effective-length detection (the authors' sweep, any score)
    log.py        the search log: atomic writes, replay for --resume, --max-evals / --budget-minutes
"""

from .dpe import candidate_sizes, detect_group_sizes
from .evolution import EvolutionSettings, crossover, evolve, initial_factors, monotone, mutate, to_factors, to_genes
from .log import FORMAT, SearchLog, StopSearch, load_best, load_log
from .objective import Objective, spec_of, split_heldout
from .scalar import default_space, grid_points, random_points, scalar_search
from .search import TuneOptions, accept, baselines, longrope_params, planned_evaluations, resolve_options, tune

__all__ = ["FORMAT", "EvolutionSettings", "Objective", "SearchLog", "StopSearch", "TuneOptions", "accept", "baselines",
           "candidate_sizes", "crossover", "detect_group_sizes", "default_space", "evolve", "grid_points",
           "initial_factors", "load_best", "load_log", "longrope_params",
           "monotone", "mutate", "planned_evaluations", "random_points", "resolve_options", "scalar_search",
           "spec_of", "split_heldout", "to_factors", "to_genes", "tune"]
