"""Actions, resource vectors, the action queue and the scheduler policies (pure, no I/O)."""
