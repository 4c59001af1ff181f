"""Exit codes a worker and totalrun agree on."""

# A worker that failed with an error no restart can mend (ranks whose calls disagree, a
# recovery that cannot go on) exits with this code: with --max-restarts, totalrun ends the
# job instead of starting the worker again into the same error.
NO_RESTART = 121
