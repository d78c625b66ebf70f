"""The study's pruner: Optuna's median rule, applied to each of a trial's seeds on its own.

A trial of a study with K seeds a trial reports seed j's evaluations at steps ``10 j + 1``
to ``10 j + 10`` (``trial.EVALUATIONS`` a seed). Optuna's ``MedianPruner`` judges a trial
by its best evaluation over all the steps it has reported, so once a first seed has done
well, no later seed is ever judged: a trial whose second seed fails runs to its end.
Optuna has no pruner that starts its best-so-far again at a boundary, hence this one, on
Optuna's public ``BasePruner``. With one seed a trial it decides exactly as
``MedianPruner(n_startup_trials, n_warmup_steps)`` does (tests/test_tune.py holds the two
to the same decisions).

The class is made when a study is opened (``seed_median_pruner``), so that importing
this module does not import Optuna.
"""

from __future__ import annotations

import math
import statistics
from types import ModuleType
from typing import TYPE_CHECKING

from trustrl.run.trial import EVALUATIONS

if TYPE_CHECKING:
    from optuna import Study
    from optuna.pruners import BasePruner
    from optuna.trial import FrozenTrial


def seed_median_pruner(optuna: ModuleType, startup_trials: int, warmup: int) -> BasePruner:
    """A pruner that stops a trial when the best evaluation of the seed it is training, so
    far, is below the median of the completed trials' evaluations at the same step; only
    once ``startup_trials`` trials have completed, and only from the seed's
    ``warmup``-th tenth of its budget on."""
    complete = optuna.trial.TrialState.COMPLETE

    class SeedMedianPruner(optuna.pruners.BasePruner):  # type: ignore[name-defined]
        def prune(self, study: Study, trial: FrozenTrial) -> bool:
            step = trial.last_step
            if step is None:
                return False
            completed = study.get_trials(deepcopy=False, states=(complete,))
            if not completed or len(completed) < startup_trials:
                return False
            first = (step - 1) // EVALUATIONS * EVALUATIONS + 1  # the seed's first step
            if step - first + 1 < warmup:
                return False
            seed = [v for at, v in trial.intermediate_values.items() if first <= at <= step]
            if all(math.isnan(v) for v in seed):  # as MedianPruner: nothing but NaN is pruned
                return True
            best = max(v for v in seed if not math.isnan(v))
            others = [
                value
                for t in completed
                if not math.isnan(value := t.intermediate_values.get(step, math.nan))
            ]
            return bool(others) and best < statistics.median(others)

    return SeedMedianPruner()
