"""Studies behind the results: the detection-power matrix (DiFR section 5), its report, and the
cross-entropy-matching adversary (DiFR figure 2). The runnable scripts that use them live in the
top-level ``experiments/`` folder and ``verinfer experiment``."""
