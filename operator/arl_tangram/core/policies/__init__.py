"""The scheduler policies: ``static``, ``fcfs-min``, ``paper`` and ``tangram``."""
